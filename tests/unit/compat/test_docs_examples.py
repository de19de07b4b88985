"""The documentation cannot go stale: every page is tested.

Each page of docs/ (and README.md) links to a runnable file under examples/ or holds a
`console` transcript. A transcript is a fenced block whose `$ ` lines are commands (`zeroshard
...`, run in this process, and `echo '...' > FILE`) and whose other lines are output the commands
must print. The single-process examples run here against plain PyTorch; the torchrun ones run in
tests/dist/compat/test_examples.py. Links between pages, anchors included, must resolve.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(page.read_text(encoding="utf-8"))]


def _prose(page: Path) -> str:
    """The page without its fenced blocks (links inside code are not links)."""
    return FENCE.sub("", page.read_text(encoding="utf-8"))


def _transcripts() -> list:
    found = []
    for page in PAGES:
        for i, (_info, body) in enumerate(b for b in _blocks(page) if b[0] == "console"):
            found.append(pytest.param(body, id=f"{page.name}-{i}"))
    return found


def _example_links(page: Path) -> list[Path]:
    links = [(page.parent / target.split("#")[0]).resolve() for target in LINK.findall(_prose(page))]
    return [p for p in links if p.is_relative_to(ROOT / "examples")]


def _collapse(text: str) -> str:
    # Rich and argparse wrap at the terminal's width; comparing with runs of whitespace
    # collapsed makes a transcript independent of it.
    return " ".join(text.split())


def _run_zeroshard(argv: list[str], capsys) -> tuple[str, int]:
    from zeroshard.cli import main

    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's --help and usage errors
        status = exc.code or 0
    out = capsys.readouterr()
    return out.out + out.err, status


@pytest.mark.parametrize("body", _transcripts())
def test_console_transcript_prints_what_the_page_says(body, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    output = ""
    expected = []
    for line in body.splitlines():
        if not line.startswith("$ "):
            if line.strip() and line.strip() != "...":
                expected.append(line)
            continue
        command = line[2:]
        if written := re.fullmatch(r"echo '(.*)' > (\S+)", command):
            (tmp_path / written.group(2)).write_text(written.group(1) + "\n", encoding="utf-8")
            continue
        command, echo_status = re.subn(r';\s*echo "exit \$\?"$', "", command)
        argv = shlex.split(command)
        assert argv[0] == "zeroshard", f"a transcript runs zeroshard or echo, not {command!r}"
        # It would install into this test environment's site-packages: such a block is a `shell` one,
        # run by tests/unit/tools/test_deepspeed_alias.py with --target.
        assert argv[1:2] != ["install-deepspeed-alias"] or "--target" in argv, command
        printed, status = _run_zeroshard(argv[1:], capsys)
        output += printed + (f"exit {status}\n" if echo_status else "")
    actual = _collapse(output)
    missing = [line for line in expected if _collapse(line) not in actual]
    assert not missing, f"not printed: {missing}\n--- printed:\n{output}"


def test_every_page_links_an_example_or_holds_a_transcript():
    for page in PAGES:
        examples = _example_links(page)
        transcripts = [b for b in _blocks(page) if b[0] == "console"]
        assert examples or transcripts, f"{page.name}: link an examples/ file or add a console transcript"


def test_the_index_lists_every_page():
    index = _prose(ROOT / "docs" / "README.md")
    for page in PAGES:
        if page.parent == ROOT / "docs" and page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not list {page.name}"


def test_readme_layout_names_every_package_folder():
    layout = next(body for info, body in _blocks(ROOT / "README.md") if body.startswith("zeroshard/"))
    named = set(re.findall(r"([a-z_]+)/", layout))
    folders = {p.parent.name for p in (ROOT / "zeroshard").glob("*/__init__.py")}
    assert folders <= named, f"README.md's package layout lacks {sorted(folders - named)}"


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in LINK.findall(_prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to a missing {target}"
            if anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", _prose(dest), re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
                assert anchor in slugs, f"{page.name}: {target}: no such heading in {dest.name}"


def test_every_example_is_run_by_a_test():
    tests = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("test_*.py"))
    for example in sorted((ROOT / "examples").glob("*.py")):
        assert re.search(rf'[/"]{re.escape(example.name)}"', tests), f"no test runs examples/{example.name}"


def test_every_example_config_resolves():
    from zeroshard.config.schema import ConfigError
    from zeroshard.resolve import resolve_config

    configs = sorted((ROOT / "examples" / "configs").glob("*.json"))
    assert len(configs) >= 8
    for config in configs:
        if '"auto"' in config.read_text(encoding="utf-8"):
            # A Trainer config: the Trainer fills its "auto" values in (tests/dist/compat/test_example_hf_trainer.py
            # trains with it); on its own it is refused, naming them.
            with pytest.raises(ConfigError, match="auto"):
                resolve_config(str(config), world_size=2)
            continue
        resolve_config(str(config), world_size=2)


def test_readme_example_is_examples_quickstart():
    code = (ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8")
    code = code.split('"""', 2)[2].lstrip("\n")  # past the module docstring
    readme_python = [body for info, body in _blocks(ROOT / "README.md") if info == "python"]
    assert code in readme_python, "README.md's training example must be examples/quickstart.py verbatim"


# Running the single-process examples.


@pytest.fixture
def run_example(monkeypatch, capsys):
    """Run examples/NAME in this process, as `python examples/NAME ARGS` would, and return what it
    printed. In-process because starting a fresh interpreter with torch costs seconds each on a
    loaded machine; with no launcher in the environment the example runs as one process."""

    def run(name: str, *args: str) -> str:
        for var in list(os.environ):  # one process, even when pytest runs under a launcher
            if var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or var.startswith(
                    ("SLURM_", "OMPI_", "PMI_", "PMIX_")):
                monkeypatch.delenv(var)
        monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / name), *args])
        capsys.readouterr()
        runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
        return capsys.readouterr().out

    return run


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _floats(pattern: str, text: str) -> list[float]:
    return [float(v) for v in re.findall(pattern, text)]


def test_quickstart_matches_plain_pytorch(run_example):
    got = _floats(r"step \d+ loss ([0-9.]+)", run_example("quickstart.py"))
    # The reference: the same data, model and order (the engine's loader is a DistributedSampler,
    # shuffled with seed 0), torch's AdamW and clip_grad_norm_.
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = TensorDataset(x, x @ torch.randn(8, 1))
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    want = []
    for xb, yb in DataLoader(data, batch_size=16, sampler=sampler):
        loss = nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        want.append(loss.item())
    assert len(got) == len(want) == 32
    # 1e-5 relative: the print rounds to 1e-6 (losses are above 0.5), and fp32 AdamW kernels that
    # differ in operation order drift by ~1e-7 relative over 32 steps (measured 3.7e-7 in all).
    assert got == pytest.approx(want, rel=1e-5)
    assert want[-1] < 0.2 * want[0]  # it trains


def test_compile_blocks_matches_plain_pytorch(run_example):
    out = run_example("compile_blocks.py", "--backend", "eager", "--steps", "3")  # dynamo alone: cheapest
    assert "compiled blocks.0: one graph True, eager parts {}" in out
    assert "compiled blocks.1: one graph True, eager parts {}" in out
    got = _floats(r"step \d+ loss ([0-9.]+)", out)
    from zeroshard.models import build_gpt

    torch.manual_seed(0)
    model = build_gpt("tiny", n_layer=2, n_embd=32, block_size=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data = torch.Generator().manual_seed(1)
    want = []
    for _ in range(3):
        idx = torch.randint(0, 256, (2, 16), generator=data)
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        want.append(loss.item())
    # 2e-6 absolute: the print rounds to 1e-6 (the first loss is the same computation; the next
    # ones follow AdamW steps whose fp32 kernels differ from torch's in operation order, ~1e-7).
    assert got == pytest.approx(want, abs=2e-6)


def test_full_tensors_are_the_plain_pytorch_gradient(run_example):
    out = run_example("full_tensors.py")
    assert "holds 0 elements on this rank outside a gather" in out  # stage 3: only the shard
    loss = float(re.search(r"^loss ([0-9.]+)$", out, re.M).group(1))
    grad_sum, grad_norm = (float(v) for v in re.search(r"full grad \(8, 8\) sum (\S+) norm (\S+)", out).groups())
    example = _load_example("full_tensors")
    torch.manual_seed(0)
    model = example.Model()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    ref_loss = model(x, y)
    ref_loss.backward()
    g = model.blocks[0].fc.weight.grad
    # 2e-6 absolute: the print rounds to 1e-6; one process sums in the same order as plain torch.
    assert loss == pytest.approx(ref_loss.item(), abs=2e-6)
    assert grad_sum == pytest.approx(g.sum().item(), abs=2e-6)
    assert grad_norm == pytest.approx(g.norm().item(), abs=2e-6)
    assert "master (8, 8) exp_avg (8, 8)" in out
    assert "after GatheredParameters: |master| = 0.0" in out  # rank 0's zeros reached the master


def test_checkpoint_resume_is_bit_exact_and_the_export_is_the_trained_model(run_example, tmp_path):
    out = run_example("checkpoint_resume.py", str(tmp_path / "ckpt"))
    assert "bit-exact: True" in out, out
    assert "client_state {'epoch': 3}" in out
    exported_loss, = _floats(r"step-1 batch loss ([0-9.]+)", out)
    # The reference: plain torch trained on the same two batches; AdamW with weight decay 0.0,
    # DeepSpeed's default that the engine applies, clipping at 1.0, the default.
    example = _load_example("checkpoint_resume")
    model = example.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in (1, 2):
        x, y = example.batch(step, 0)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    x, y = example.batch(1, 0)
    # 2e-6 absolute: the print rounds to 1e-6; two fp32 steps in another kernel differ by ~1e-7.
    assert exported_loss == pytest.approx(nn.functional.mse_loss(model(x), y).item(), abs=2e-6)


def test_checkpoint_async_resumes_from_the_checkpoint_written_while_training(run_example, tmp_path):
    """docs/checkpoints.md, "Asynchronous saves": the checkpoint written while steps 3-4 ran
    holds the step-2 state: a fresh engine loaded from it repeats those losses bit for bit."""
    out = run_example("checkpoint_async.py", str(tmp_path / "ckpt"))
    assert "bit-exact: True" in out, out
    assert "latest: step4" in out, out
    assert (tmp_path / "ckpt" / "step4" / "index.json").is_file()
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))


def test_skip_nonfinite_step_leaves_the_parameters(run_example):
    out = run_example("skip_nonfinite_step.py")
    assert "skipped_steps 1, global_steps 2, parameters unchanged: True" in out, out
    assert "next clean batch: skipped_steps 1, parameters changed: True" in out, out


def test_offload_config_trains_as_without_offload(run_example):
    """docs/offload.md: the optimizer on the host gives the losses of the engine without it."""
    configs = ROOT / "examples" / "configs"
    on_device = run_example("train_minimal.py", "--steps", "4", "--deepspeed_config", str(configs / "zero2_fp32.json"))
    offloaded = run_example(
        "train_minimal.py", "--steps", "4", "--deepspeed_config", str(configs / "zero2_offload_fp32.json"))
    pattern = r"step\s+\d+\s+loss\s+([0-9.]+)\s+grad_norm\s+([0-9.]+)"
    want = [float(v) for pair in re.findall(pattern, on_device) for v in pair]
    got = [float(v) for pair in re.findall(pattern, offloaded) for v in pair]
    assert len(want) == 8
    # 1e-4 absolute: the print keeps 4 decimals; tests/dist/sharding/test_offload.py shows the
    # two within 1e-6 in fp32.
    assert got == pytest.approx(want, abs=1e-4)

