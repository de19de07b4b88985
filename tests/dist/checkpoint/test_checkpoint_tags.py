"""Every rank saves and loads the same tag (issue 13 item 7, issue 19 item 6).

One pooled 2-rank run holds all the scenarios: loads where the ranks resolve different tags
(explicitly, or through a `latest` that changes between reads), and saves where they pass
different tags under each `checkpoint.tag_validation` mode, plus DeepSpeed's default tag.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

import zeroshard
from tests.dist.checkpoint.test_checkpoint_helpers import TinyLM, assert_snapshots_equal, make_config, snapshot, train
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint import load as checkpoint_load
from zeroshard.config.schema import ConfigError


def _engine(tag_validation: str | None = None, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    config = make_config(1, "fp32", dist.get_world_size())
    if tag_validation is not None:
        config["checkpoint"] = {"tag_validation": tag_validation}
    engine, *_ = zeroshard.initialize(model=TinyLM(), config=config)
    return engine


def _error(fn) -> str | None:
    try:
        fn()
    except CheckpointError as error:
        return str(error)
    return None


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def tag_scenarios(root: str) -> dict:
    rank = dist.get_rank()
    out: dict = {}
    ckpt = Path(root) / "ckpt"
    engine = _engine()
    train(engine, 0, 1)
    engine.save_checkpoint(str(ckpt), tag="a")
    train(engine, 1, 2)
    engine.save_checkpoint(str(ckpt), tag="b")  # latest -> b

    # ---- loads
    victim = _engine(seed=1)
    before = snapshot(victim)
    out["load_a_vs_b"] = _error(lambda: victim.load_checkpoint(str(ckpt), tag="a" if rank == 0 else "b"))
    out["load_latest_vs_a"] = _error(lambda: victim.load_checkpoint(str(ckpt), tag=None if rank == 0 else "a"))
    out["load_bad_tag_on_one_rank"] = _error(
        lambda: victim.load_checkpoint(str(ckpt), tag="b" if rank == 0 else "../ckpt/b")
    )
    assert_snapshots_equal(before, snapshot(victim), "after the refused loads")

    # `latest` rewritten between the ranks' reads: rank 1 would see "a" if it read it itself.
    real_read_latest = checkpoint_load.read_latest
    if rank == 1:
        checkpoint_load.read_latest = lambda save_dir: "a"
    try:
        path, _ = victim.load_checkpoint(str(ckpt))
    finally:
        checkpoint_load.read_latest = real_read_latest
    out["latest_changing"] = (Path(path).name, victim.global_steps)
    path, _ = victim.load_checkpoint(str(ckpt), tag="b" if rank == 0 else None)
    out["explicit_and_latest_agree"] = Path(path).name

    # Reading `latest` fails on rank 0 only with an OSError: every rank raises, none hangs.
    def unreadable(save_dir):
        raise PermissionError(13, "Permission denied", str(save_dir / "latest"))

    if rank == 0:
        checkpoint_load.read_latest = unreadable
    try:
        out["latest_unreadable"] = _error(lambda: victim.load_checkpoint(str(ckpt)))
    finally:
        checkpoint_load.read_latest = real_read_latest

    # ---- saves with different tags per rank
    records = _Records()
    logging.getLogger("zeroshard").addHandler(records)
    try:
        for mode in ("Fail", "Warn", "Ignore", None, "warn"):
            saver = _engine(mode)
            train(saver, 0, 1)
            records.messages.clear()
            target = Path(root) / f"save_{mode}"
            result: dict = {}
            try:
                result["path"] = Path(saver.save_checkpoint(str(target), tag=f"r{rank}")).name
                result["latest"] = (target / "latest").read_text().strip()
            except CheckpointError as error:
                result["error"] = str(error)
                result["saved"] = target.exists() and sorted(p.name for p in target.iterdir())
            result["warnings"] = [m for m in records.messages if "different tags" in m]
            out[f"save_{mode}"] = result
    finally:
        logging.getLogger("zeroshard").removeHandler(records)

    # ---- DeepSpeed's default tag
    saver = _engine()
    train(saver, 0, 2)
    out["tag_none"] = Path(saver.save_checkpoint(str(Path(root) / "default"), tag=None)).name
    out["tag_empty"] = Path(saver.save_checkpoint(str(Path(root) / "default_empty"), tag="")).name
    # A bad mode is refused by the config, at initialize, before any save can run.
    try:
        _engine("Sometimes")
        out["bad_mode"] = None
    except ConfigError as error:
        out["bad_mode"] = str(error)
    return out


def test_ranks_agree_on_tags(dist_pool, tmp_path) -> None:
    ranks = dist_pool(2).run(tag_scenarios, str(tmp_path), timeout=180)
    for rank, out in enumerate(ranks):
        # Loads: an error on every rank, naming both tags.
        for key, tags in (("load_a_vs_b", ("'a'", "'b'")), ("load_latest_vs_a", ("'b' (from latest)", "'a'"))):
            assert out[key] is not None and "different checkpoints" in out[key], (rank, key, out[key])
            assert all(t in out[key] for t in tags), (rank, key, out[key])
        assert "plain directory name" in out["load_bad_tag_on_one_rank"], (rank, out["load_bad_tag_on_one_rank"])
        assert out["latest_changing"] == ("b", 2), (rank, out["latest_changing"])
        assert out["explicit_and_latest_agree"] == "b"
        assert "latest: PermissionError" in out["latest_unreadable"], (rank, out["latest_unreadable"])
        # Saves.
        fail = out["save_Fail"]
        assert "'r0'" in fail["error"] and "'r1'" in fail["error"] and "tag_validation is Fail" in fail["error"]
        assert not fail["saved"], fail  # refused before anything was written
        for mode in ("Warn", "Ignore", "None", "warn"):
            result = out[f"save_{mode}"]
            assert result["path"] == "r0" and result["latest"] == "r0", (rank, mode, result)
            warned = rank == 0 and mode in ("Warn", "None", "warn")
            assert len(result["warnings"]) == (1 if warned else 0), (rank, mode, result)
        assert out["tag_none"] == "global_step2" and out["tag_empty"] == "global_step2"
        assert out["bad_mode"] is not None and 'checkpoint.tag_validation="Sometimes"' in out["bad_mode"]
    assert "rank 0: 'r0', rank 1: 'r1'" in ranks[0]["save_Warn"]["warnings"][0]
