"""`zeroshard launch`: torchrun for user scripts."""

import sys

from zeroshard.cli import main
from zeroshard.launch.torchrun import torchrun_command


def test_command_is_standalone_torchrun_with_the_script_arguments():
    cmd = torchrun_command(3, "train.py", ["--deepspeed_config", "ds.json"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == ["--standalone", "--nproc_per_node", "3", "train.py", "--deepspeed_config", "ds.json"]


def test_missing_script_exits_2_naming_it(capsys):
    assert main(["launch", "--nproc", "2", "no_such_script.py"]) == 2
    assert "no_such_script.py: no such file" in capsys.readouterr().err


def test_launch_runs_the_script_in_every_process(tmp_path, capsys):
    script = tmp_path / "hello.py"
    out = tmp_path / "ranks"
    out.mkdir()
    script.write_text(
        "import os, pathlib, sys\n"
        f"pathlib.Path({str(out)!r}, os.environ['RANK']).write_text(os.environ['WORLD_SIZE'] + ' ' + sys.argv[1])\n"
    )
    assert main(["launch", "--nproc", "2", str(script), "hi"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["0", "1"]
    assert (out / "1").read_text() == "2 hi"
