"""Automatic resume (issue 27 item 2): `engine.resume_latest(dir)` and `"preemption": {"resume":
true}` load the newest complete checkpoint and skip, with a message, every save that did not
finish or is damaged; the state loaded is bitwise the one saved (same world size: one process).
And the signal flag: a handler that only records the signal."""

from __future__ import annotations

import logging
import os
import shutil
import signal

import pytest

import zeroshard
from tests.dist.checkpoint.test_checkpoint_helpers import (
    TinyLM,
    assert_snapshots_equal,
    make_config,
    snapshot,
    train,
)
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.resume import find_complete
from zeroshard.launch.signals import STOP


def _engine(seed: int = 0, **preemption):
    import torch

    torch.manual_seed(seed)
    config = make_config(2, "fp32", 1)
    if preemption:
        config["preemption"] = preemption
    engine, *_ = zeroshard.initialize(model=TinyLM(), config=config)
    return engine


@pytest.fixture(scope="module")
def _pristine(tmp_path_factory):
    """global_step1..5 saved; 3 lost its marker, 4 a truncated file, 5 a flipped byte (same size,
    caught only by the load's sha256); a .global_step6.tmp a save killed half-way left."""
    save_dir = tmp_path_factory.mktemp("saves")
    engine = _engine()
    snapshots = {}
    for step in range(1, 6):
        train(engine, step - 1, step)
        engine.save_checkpoint(save_dir)
        snapshots[step] = snapshot(engine)
    (save_dir / "global_step3" / "index.sha256").unlink()
    rank_file = save_dir / "global_step4" / "rank_00000.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:-10])
    rank_file = save_dir / "global_step5" / "rank_00000.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    shutil.copytree(save_dir / "global_step2", save_dir / ".global_step6.tmp")
    return save_dir, snapshots


@pytest.fixture
def saves(_pristine, tmp_path):
    """A copy of the saves for one test to change."""
    shutil.copytree(_pristine[0], tmp_path / "ckpt")
    return tmp_path / "ckpt", _pristine[1]


def test_the_newest_complete_checkpoint_is_loaded_and_the_others_are_named(saves, caplog):
    save_dir, snapshots = saves
    tags, skipped = find_complete(save_dir)
    assert tags == ["global_step5", "global_step2", "global_step1"]  # 5 passes the scan: sizes match
    assert len(skipped) == 3
    for name in (".global_step6.tmp", "global_step3", "global_step4"):
        assert any(str(save_dir / name) in message for message in skipped), (name, skipped)
    engine = _engine(seed=1)
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        path, client_state = engine.resume_latest(save_dir)
    assert path == str(save_dir / "global_step2") and client_state == {}
    assert_snapshots_equal(snapshots[2], snapshot(engine), "resumed")
    text = caplog.text
    for name in (".global_step6.tmp", "global_step3", "global_step4", "global_step5"):
        assert f"resume: skipping {save_dir / name}" in text, name
    assert "sha256" in text  # why global_step5 was refused


def test_resume_key_loads_at_initialize_and_an_empty_directory_is_a_first_start(saves, tmp_path_factory):
    save_dir, snapshots = saves
    engine = _engine(seed=1, enabled=False, save_dir=str(save_dir), resume=True)
    assert engine.preemption.resumed[0] == str(save_dir / "global_step2")
    assert_snapshots_equal(snapshots[2], snapshot(engine), "resumed at initialize")
    empty = tmp_path_factory.mktemp("empty")
    assert _engine(save_dir=str(empty), resume=True).preemption.resumed == (None, None)
    assert _engine().resume_latest(empty / "missing") == (None, None)


def test_checkpoints_that_do_not_fit_the_model_are_an_error_not_a_fresh_start(saves, caplog):
    save_dir, _ = saves
    for name in ("global_step5", "global_step4", "global_step3"):
        shutil.rmtree(save_dir / name)
    config = make_config(2, "fp32", 1)
    model = TinyLM()
    model.extra = __import__("torch").nn.Linear(2, 2)  # a parameter the checkpoints lack
    engine, *_ = zeroshard.initialize(model=model, config=config)
    with pytest.raises(CheckpointError, match="extra"):
        engine.resume_latest(save_dir)


def test_resume_latest_without_a_directory_says_where_to_set_it():
    with pytest.raises(ValueError, match="preemption.save_dir"):
        _engine().resume_latest()


def test_the_handler_only_records_the_signal_and_uninstall_restores_the_previous_one():
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))
    STOP.clear()
    try:
        assert STOP.install([signal.SIGUSR1, signal.SIGUSR2]) == [signal.SIGUSR1, signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert (STOP.requested, STOP.name, STOP.count) == (True, "SIGUSR2", 2)
        assert seen == []  # replaced, not chained
        STOP.uninstall()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == [signal.SIGUSR2] and STOP.count == 2
    finally:
        STOP.uninstall()
        STOP.clear()
        signal.signal(signal.SIGUSR2, previous)


def test_a_signal_in_one_process_saves_and_exits_with_the_configured_status(tmp_path):
    STOP.clear()
    engine = _engine(enabled=True, save_dir=str(tmp_path), exit_code=75, tag="preempted")
    try:
        train(engine, 0, 1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert engine.should_stop()
        with pytest.raises(SystemExit) as stop:
            train(engine, 1, 2)
    finally:
        STOP.uninstall()
        STOP.clear()
    assert stop.value.code == 75 and engine.global_steps == 2
    assert (tmp_path / "latest").read_text().strip() == "preempted"
    assert find_complete(tmp_path) == (["preempted"], [])


@pytest.fixture
def _slow_writer():
    """The asynchronous writer takes 0.3 s to start: a reader that does not wait for it sees the
    previous checkpoint (on main, resume_latest did; load_checkpoint waited)."""
    import time

    from zeroshard.checkpoint import async_save

    def hold(point: str, rank: int) -> None:
        if point == "start":
            time.sleep(0.3)

    async_save.WRITER_HOOK = hold
    yield
    async_save.WRITER_HOOK = None


def test_readers_wait_for_a_pending_asynchronous_save(tmp_path, _slow_writer):
    """resume_latest (as load_checkpoint) and the one-rank readers (the fp32 consolidation,
    DeepSpeed's zero_to_fp32) read global_step4, saved asynchronously just before, not the
    global_step2 that `latest` named while the writer was still at work."""
    import torch

    from zeroshard.checkpoint import consolidate_fp32
    from zeroshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine = _engine()
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path / "step2")
    train(engine, 2, 4)
    saved = snapshot(engine)
    step4 = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    readers = {"consolidate_fp32": consolidate_fp32, "zero_to_fp32": get_fp32_state_dict_from_zero_checkpoint}
    for name, read in readers.items():
        shutil.copytree(tmp_path / "step2", tmp_path / name)
        engine.save_checkpoint(tmp_path / name, async_save=True)
        state = read(tmp_path / name)
        assert all(torch.equal(state[n], v) for n, v in step4.items()), name
        engine.wait_for_checkpoint()
    shutil.copytree(tmp_path / "step2", tmp_path / "resume")
    engine.save_checkpoint(tmp_path / "resume", async_save=True)
    resumed = _engine(seed=1)
    path, _ = resumed.resume_latest(tmp_path / "resume")
    assert path.endswith("global_step4"), path
    assert_snapshots_equal(snapshot(resumed), saved, "resumed at global_step4")
