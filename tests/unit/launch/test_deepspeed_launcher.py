"""The `deepspeed` command's flags (DeepSpeed 0.19.8's runner: names, spellings, defaults) and
what each gives: the torchrun command and the environment of the ranks. The device choices
were checked against DeepSpeed 0.19.8's own `parse_inclusion_exclusion` (same inputs, same
slots); the expected values below are DeepSpeed's. A real launch:
tests/dist/launch/test_deepspeed_command.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zeroshard.launch import deepspeed_launcher as dl
from zeroshard.launch.deepspeed_launcher import LaunchUsageError, build_parser, filter_resources, main, plan_launch

REPO = Path(__file__).resolve().parents[3]

# DeepSpeed 0.19.8's `deepspeed --help`: every option, its spellings and its default.
DEEPSPEED_0_19_8_FLAGS = {
    ("-H", "--hostfile"): "/job/hostfile", ("-i", "--include"): "", ("-e", "--exclude"): "",
    ("--num_nodes",): -1, ("--num_gpus", "--num_accelerators"): -1, ("--master_port",): 29500,
    ("--master_addr",): "", ("--node_rank",): -1, ("--launcher",): "pdsh", ("--launcher_args",): "",
    ("--module",): False, ("--no_python",): False, ("--no_local_rank",): False, ("--no_ssh",): False,
    ("--no_ssh_check",): False, ("--force_multi",): False, ("--save_pid",): False,
    ("--enable_each_rank_log",): "None", ("--autotuning",): "", ("--bind_cores_to_rank",): False,
    ("--bind_core_list",): None, ("--ssh_port",): None, ("--venv_script",): None, ("--log_level",): "info",
    ("-q", "--quiet"): False,
}


def _plan(argv, environ=None, gpus=0, hostfile=None, tmp_path=None):
    script = "train.py"
    if tmp_path is not None:
        script = str(tmp_path / "train.py")
        Path(script).write_text("")
    args = build_parser().parse_args([*argv, script, "--deepspeed_config", "ds.json"])
    return plan_launch(args, dict(environ or {}), gpus, hostfile)


def test_the_flags_are_deepspeeds():
    parser = build_parser()
    ours = {tuple(a.option_strings): a.default for a in parser._actions if a.option_strings and a.dest != "help"}
    assert ours == DEEPSPEED_0_19_8_FLAGS
    assert parser.prog == "deepspeed"


def test_cpu_num_gpus_gives_that_many_processes_and_deepspeeds_environment(tmp_path):
    launch = _plan(["--num_gpus", "2", "--master_port", "29612"], {"OMP_NUM_THREADS": "3"}, tmp_path=tmp_path)
    cmd = launch.command
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2" and cmd[cmd.index("--nnodes") + 1] == "1"
    assert cmd[cmd.index("--master_addr") + 1] == "127.0.0.1" and cmd[cmd.index("--master_port") + 1] == "29612"
    module = cmd.index("--module")
    assert cmd[module + 1:] == ["zeroshard.launch.deepspeed_rank", str(tmp_path / "train.py"),
                                "--deepspeed_config", "ds.json"]
    env = launch.env
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")} \
        == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29612", "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
            "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    assert "CUDA_VISIBLE_DEVICES" not in env and env["OMP_NUM_THREADS"] == "3"  # the user's value kept
    assert launch.warnings == []


def test_cpu_without_flags_runs_one_process(tmp_path):
    assert _plan([], tmp_path=tmp_path).slots == [0]


def test_num_accelerators_is_num_gpus(tmp_path):
    assert _plan(["--num_accelerators", "3"], tmp_path=tmp_path).slots == [0, 1, 2]


@pytest.mark.parametrize(("argv", "environ", "visible"), [
    ([], {}, "0,1,2,3"),                                           # every GPU
    (["--num_gpus", "2"], {}, "0,1"),
    (["--include", "localhost:0,2"], {}, "0,2"),
    (["-i", "localhost:2@localhost:0"], {}, "0,2"),
    (["--exclude", "localhost:1"], {}, "0,2,3"),
    (["-i", "localhost"], {}, "0,1,2,3"),
    ([], {"CUDA_VISIBLE_DEVICES": "1,3"}, "1,3"),                  # the user's choice acts as --include
    (["--num_gpus", "1"], {"CUDA_VISIBLE_DEVICES": "1,3"}, "0"),   # ... unless a flag chooses
])
def test_gpu_choice_reaches_the_ranks_as_cuda_visible_devices(tmp_path, argv, environ, visible):
    launch = _plan(argv, environ, gpus=4, tmp_path=tmp_path)
    assert launch.env["CUDA_VISIBLE_DEVICES"] == visible
    nproc = len(visible.split(","))
    assert launch.command[launch.command.index("--nproc_per_node") + 1] == str(nproc)
    assert launch.env["WORLD_SIZE"] == launch.env["LOCAL_SIZE"] == str(nproc)


def test_flags_for_the_rank_shim(tmp_path):
    cmd = _plan(["--no_local_rank", "--module"], tmp_path=tmp_path).command
    shim = cmd.index("zeroshard.launch.deepspeed_rank")
    assert cmd[shim + 1:shim + 3] == ["--module", "--no_local_rank"]
    cmd = _plan(["--no_python"], tmp_path=tmp_path).command
    assert cmd[cmd.index("zeroshard.launch.deepspeed_rank") + 1] == "--no_python"


def test_master_addr_as_deepspeed_sets_it(tmp_path):
    # No hostfile: DeepSpeed's runner uses 127.0.0.1 whatever --master_addr says.
    assert _plan(["--master_addr", "10.0.0.7"], tmp_path=tmp_path).env["MASTER_ADDR"] == "127.0.0.1"
    # A one-host hostfile: --master_addr is used.
    launch = _plan(["--master_addr", "10.0.0.7"], gpus=2, hostfile="node1 slots=2\n", tmp_path=tmp_path)
    assert launch.env["MASTER_ADDR"] == "10.0.0.7" and launch.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_one_host_of_a_hostfile_is_one_node(tmp_path):
    launch = _plan(["--include", "b:1"], gpus=2, hostfile="# two hosts\na slots=2\nb slots=2\n", tmp_path=tmp_path)
    assert launch.slots == [1]


def test_no_effect_flags_warn_once(tmp_path):
    launch = _plan(["--save_pid", "--enable_each_rank_log", "logs", "--bind_cores_to_rank", "--bind_core_list", "0-3",
                    "--launcher", "openmpi", "--ssh_port", "22"], tmp_path=tmp_path)
    assert len(launch.warnings) == 1
    assert launch.warnings[0].startswith("--save_pid, --enable_each_rank_log, --bind_cores_to_rank, --bind_core_list: "
                                         "no effect in zeroshard")


@pytest.mark.parametrize(("argv", "gpus", "hostfile", "message"), [
    (["--force_multi"], 0, None, r"--force_multi .*torchrun --nnodes N.*srun.*mpirun"),
    (["--num_nodes", "2"], 0, None, r"--num_nodes 2: no hostfile .*torchrun --nnodes"),
    ([], 0, "a slots=2\nb slots=2\n", r"gives 2 nodes \(a, b\)\. .*torchrun --nnodes"),
    (["--launcher", "slurm"], 0, "a slots=2\nb slots=2\n", r"with --launcher slurm\. .*srun"),
    (["--autotuning", "tune"], 0, None, r"no autotuner"),
    (["--include", "localhost:4"], 4, None, r"localhost has no device 4 \(it has 0, 1, 2, 3\)"),
    (["--include", "localhost:1"], 0, None, r"localhost has no device 1 \(it has 0\)"),
    (["--include", "worker-1:0"], 2, None, r"host 'worker-1' is not there"),
    (["--include", "localhost:0", "--exclude", "localhost:1"], 2, None, r"cannot be used together"),
    (["--num_gpus", "1", "--include", "localhost:0"], 2, None, r"cannot be combined"),
    (["--num_gpus", "8"], 4, None, r"this machine has 4 GPUs"),
    (["--exclude", "localhost"], 2, None, r"leaves no device"),
    (["--module", "--no_python"], 0, None, r"cannot be used together"),
    (["--no_ssh"], 0, None, r"--node_rank 0"),
    ([], 0, "a slots=x\n", r"bad line 'a slots=x'"),
])
def test_refusals_name_the_cause(tmp_path, argv, gpus, hostfile, message):
    with pytest.raises(LaunchUsageError, match=message):
        _plan(argv, gpus=gpus, hostfile=hostfile, tmp_path=tmp_path)


def test_main_exits_2_with_one_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dl, "physical_gpu_count", lambda: 0)
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["--hostfile", str(tmp_path / "none"), "--force_multi", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepspeed: error: --force_multi") and err.count("\n") == 1
    assert main(["--hostfile", str(tmp_path / "none"), str(tmp_path / "missing.py")]) == 2
    assert "missing.py: no such file" in capsys.readouterr().err
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=8\nworker-1 slots=8\n")
    assert main(["-H", str(hostfile), str(script)]) == 2
    assert "gives 2 nodes (worker-0, worker-1)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--no_such_flag", str(script)])
    assert exit_.value.code == 2 and "unrecognized arguments: --no_such_flag" in capsys.readouterr().err


def test_filter_matches_deepspeeds_on_several_hosts():
    from collections import OrderedDict

    pool = OrderedDict([("a", 2), ("b", 2)])
    assert dict(filter_resources(pool, "b:1", "")) == {"b": [1]}
    assert dict(filter_resources(pool, "", "a")) == {"b": [0, 1]}


def _rank(tmp_path, flags, script, *args, local_rank="1"):
    env = dict(os.environ, LOCAL_RANK=local_rank, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]))
    return subprocess.run([sys.executable, "-m", "zeroshard.launch.deepspeed_rank", *flags, script, *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_rank_shim_runs_the_script_as_python_would(tmp_path):
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        print(__name__, sys.argv, sys.path[0])
        sys.exit(int(sys.argv[-1]))
    """))
    result = _rank(tmp_path, [], str(script), "--x", "7")
    assert result.returncode == 7, result.stderr  # the script's exit status
    assert result.stdout.split("\n")[0] == f"__main__ {[str(script), '--local_rank=1', '--x', '7']} {script.parent}"
    crash = tmp_path / "crash.py"
    crash.write_text("raise RuntimeError('boom')\n")
    result = _rank(tmp_path, ["--no_local_rank"], str(crash))
    assert result.returncode == 1 and "RuntimeError: boom" in result.stderr


def test_rank_shim_module_and_no_python(tmp_path):
    module = "import sys\nprint(__name__, sys.argv[1:], sys.argv[0].endswith('trainmod.py'))\n"
    (tmp_path / "trainmod.py").write_text(module)
    result = _rank(tmp_path, ["--module"], "trainmod", "--a", local_rank="0")
    assert result.stdout.strip() == "__main__ ['--local_rank=0', '--a'] True", result.stderr
    program = tmp_path / "prog.sh"
    program.write_text('#!/bin/sh\necho "$0 $*"\n')
    program.chmod(0o755)
    result = _rank(tmp_path, ["--no_python", "--no_local_rank"], str(program), "--b")
    assert result.stdout.strip() == f"{program} --b", result.stderr
