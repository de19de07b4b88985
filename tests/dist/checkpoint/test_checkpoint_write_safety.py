"""What a save writes and where: never through a planted symbolic link, one file mode for all
files (the umask's), no temporaries left behind by failed saves, tags that resume, and state
tensors that keep their shapes (issue 13 item 9). One engine in the test process."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

import zeroshard
from tests.dist.checkpoint.test_checkpoint_helpers import TinyLM, make_config, make_engine, train
from zeroshard.checkpoint import CheckpointError, write_fp32
from zeroshard.checkpoint import save as checkpoint_save
from zeroshard.cli import main as cli_main

VICTIM_TEXT = "not yours to overwrite\n"


@pytest.fixture
def engine():
    engine = make_engine(1, "fp32", seed=0)
    train(engine, 0, 1)
    return engine


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    return victim


def test_tag_with_surrounding_whitespace_is_refused_at_save(engine, tmp_path) -> None:
    for tag in ("best ", " best", "best\n"):
        with pytest.raises(CheckpointError, match="no leading or trailing whitespace"):
            engine.save_checkpoint(str(tmp_path / "ckpt"), tag=tag)
    assert not (tmp_path / "ckpt").exists()


def test_latest_is_not_written_through_a_planted_link(engine, tmp_path) -> None:
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    victim = _victim(tmp_path)
    (save_dir / ".latest.tmp").symlink_to(victim)
    engine.save_checkpoint(str(save_dir), tag="t")
    assert victim.read_text() == VICTIM_TEXT
    assert (save_dir / "latest").read_text() == "t\n" and not (save_dir / "latest").is_symlink()


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_is_not_written_through_planted_links(engine, tmp_path, suffix: str) -> None:
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    victim = _victim(tmp_path)
    out = out_dir / f"model{suffix}"
    (out_dir / f".model{suffix}.tmp").symlink_to(victim)  # the temporary name exports used to use
    out.symlink_to(tmp_path / "victim_final.txt")
    write_fp32(tmp_path / "ckpt", out)
    assert victim.read_text() == VICTIM_TEXT
    assert not (tmp_path / "victim_final.txt").exists()
    assert not out.is_symlink() and out.is_file()
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([out.name, f".model{suffix}.tmp"])


def test_linked_tag_directory_is_refused_before_writing(engine, tmp_path) -> None:
    save_dir = tmp_path / "ckpt"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_dir.mkdir()
    (save_dir / "t").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"ckpt/t: a symbolic link"):
        engine.save_checkpoint(str(save_dir), tag="t")
    assert (save_dir / "t").is_symlink() and list(elsewhere.iterdir()) == []
    assert sorted(p.name for p in save_dir.iterdir()) == ["t"]  # nothing written, no temporary


def test_failed_save_temporaries_are_cleaned_by_the_next_save(engine, tmp_path, monkeypatch) -> None:
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / ".someone_else.tmp").mkdir()  # another job's save in progress: not ours to remove

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_save, "write_rank0_files", disk_full)
    with pytest.raises(OSError, match="No space left"):
        engine.save_checkpoint(str(save_dir), tag="first")
    monkeypatch.undo()
    assert (save_dir / ".first.tmp").is_dir()
    engine.save_checkpoint(str(save_dir), tag="second")
    assert sorted(p.name for p in save_dir.iterdir()) == [".someone_else.tmp", "latest", "second"]


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_every_checkpoint_file_gets_the_umask_mode(tmp_path, umask: int) -> None:
    engine = make_engine(1, "fp32", seed=0)
    train(engine, 0, 1)
    previous = os.umask(umask)
    try:
        engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"t": (1, 2)})  # python_state.pt too
        write_fp32(tmp_path / "ckpt", tmp_path / "model.safetensors")
    finally:
        os.umask(previous)
    files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()] + [tmp_path / "model.safetensors"]
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert {"rank_00000.safetensors", "index.json", "python_state.pt", "latest"} <= modes.keys()
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


class CountingSGD(torch.optim.Optimizer):
    """SGD with momentum that also counts its steps in a 1-element state tensor."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["count"] = torch.zeros(1)
                    state["momentum"] = torch.zeros_like(p)
                state["count"] += 1
                state["momentum"].mul_(0.9).add_(p.grad)
                p.add_(state["momentum"], alpha=-group["lr"])


def _counting_engine(seed: int):
    torch.manual_seed(seed)
    config = make_config(2, "fp32", 1)
    del config["optimizer"], config["scheduler"]
    engine, *_ = zeroshard.initialize(model=TinyLM(), config=config, optimizer=lambda groups: CountingSGD(groups))
    return engine


def test_one_element_optimizer_state_keeps_its_shape(tmp_path) -> None:
    engine = _counting_engine(0)
    train(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path))
    fresh = _counting_engine(1)
    fresh.load_checkpoint(str(tmp_path))
    for flat, fresh_flat in zip(engine.flats, fresh.flats, strict=True):
        original, loaded = engine.optimizer.state[flat.master], fresh.optimizer.state[fresh_flat.master]
        assert loaded["count"].shape == (1,), loaded["count"].shape
        assert torch.equal(loaded["count"], original["count"]) and torch.equal(loaded["count"], torch.tensor([2.0]))
        assert torch.equal(loaded["momentum"], original["momentum"])


def test_to_fp32_refuses_a_latest_outside_the_directory(engine, tmp_path, capsys) -> None:
    engine.save_checkpoint(str(tmp_path / "other"), tag="secret")
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    for latest in (str(tmp_path / "other" / "secret"), "../other/secret"):
        (save_dir / "latest").write_text(latest + "\n")
        assert cli_main(["to-fp32", str(save_dir), str(tmp_path / "out.safetensors")]) == 1
        assert "plain directory name" in capsys.readouterr().err
        assert cli_main(["to-fp32", str(save_dir), str(tmp_path / "out.safetensors"), "--tag", latest]) == 1
        assert "plain directory name" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()


def test_to_fp32_output_that_cannot_be_written_is_one_message(engine, tmp_path, capsys) -> None:
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    (tmp_path / "a_file").write_text("")
    assert cli_main(["to-fp32", str(tmp_path / "ckpt"), str(tmp_path / "a_file" / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zeroshard to-fp32: ") and "a_file" in err and "Traceback" not in err
