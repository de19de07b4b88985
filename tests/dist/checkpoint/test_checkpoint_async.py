"""Asynchronous saves (docs/checkpoints.md, "Asynchronous saves"), on 2 gloo ranks.

- The files of an asynchronous save hold the same tensors, bit for bit, as a synchronous save
  of the same state, although the writer is held back until a training step has changed
  every master weight and optimizer state (the reference: the synchronous save).
- The writer overlaps training, shown by the order of events, not by timing: the save
  returns, a training step completes and `latest` still names the previous tag, and only
  then does the writer start (it is held at "start" until the step is done; a save that
  wrote before returning would reach "start" first).
- A writer that fails (disk full on rank 1, permission denied on rank 0) surfaces as a
  CheckpointError on every rank at the next wait, naming the rank and the cause, and
  `latest` keeps naming the previous checkpoint; the save after that succeeds.
"""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from tests.dist.checkpoint.test_checkpoint_helpers import make_engine, train
from zeroshard.checkpoint import CheckpointError, async_save, consolidate_fp32

WORLD = 2
GATE_TIMEOUT_S = 60.0  # only reached when the writer does not overlap (the test then fails)


def _tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


def _same_files(sync_dir: Path, async_dir: Path) -> list[str]:
    """Differences between two checkpoints' tensors, metadata and index (tag aside)."""
    problems = []
    for path in sorted(sync_dir.glob("*.safetensors")):
        (a, meta_a), (b, meta_b) = _tensors(path), _tensors(async_dir / path.name)
        if a.keys() != b.keys():
            problems.append(f"{path.name}: keys {sorted(a.keys() ^ b.keys())}")
        problems += [f"{path.name}: {k}" for k in a.keys() & b.keys() if not _bitwise_equal(a[k], b[k])]
        if meta_a != meta_b:
            problems.append(f"{path.name}: metadata")
    index_a = json.loads((sync_dir / "index.json").read_text())
    index_b = json.loads((async_dir / "index.json").read_text())
    # Not "files": its sha256s cover the safetensors headers, whose metadata order safetensors
    # does not fix (two synchronous saves of one state differ there too); sizes must match.
    problems += [f"index.json: {k}" for k in index_a if k not in ("tag", "files") and index_a[k] != index_b.get(k)]
    sizes_a = {name: entry["size"] for name, entry in index_a["files"].items()}
    sizes_b = {name: entry["size"] for name, entry in index_b["files"].items()}
    if sizes_a != sizes_b:
        problems.append(f"index.json: files {sizes_a} != {sizes_b}")
    return problems


def async_equals_sync_and_overlaps(root: str) -> dict:
    """Per configuration: the event order and, on rank 0, the differences found."""
    rank = dist.get_rank()
    results = {}
    for stage, mode in ((1, "bf16"), (3, "fp16")):
        ckpt = Path(root) / f"stage{stage}_{mode}"
        engine = make_engine(stage, mode, seed=0, dropout=0.1)
        train(engine, 0, 2)
        engine.save_checkpoint(ckpt, tag="sync")  # the reference, of the same state
        events: list[str] = []
        stepped = threading.Event()

        def hook(point: str, _rank: int, events=events, stepped=stepped) -> None:
            if point == "start" and not stepped.wait(GATE_TIMEOUT_S):
                events.append("gate timed out")
            events.append(point)

        async_save.WRITER_HOOK = hook
        try:
            engine.save_checkpoint(ckpt, tag="async", async_save=True)
            events.append("save returned")
            masters_before = [f.master.detach().clone() for f in engine.flats]
            train(engine, 2, 3)  # changes every master and optimizer state the writer holds
            changed = all(not torch.equal(m, f.master) for m, f in zip(masters_before, engine.flats, strict=True))
            events.append("step done")
            latest_during = (ckpt / "latest").read_text().strip() if rank == 0 else None
            stepped.set()
            engine.wait_for_checkpoint()
            events.append("waited")
        finally:
            async_save.WRITER_HOOK = None
        result = {"events": events, "changed": changed, "latest_during": latest_during}
        dist.barrier()
        if rank == 0:
            result["latest"] = (ckpt / "latest").read_text().strip()
            result["problems"] = _same_files(ckpt / "sync", ckpt / "async")
            full_a, full_b = consolidate_fp32(ckpt, "sync"), consolidate_fp32(ckpt, "async")
            result["fp32_equal"] = full_a.keys() == full_b.keys() and all(
                _bitwise_equal(full_a[k], full_b[k]) for k in full_a
            )
            result["leftovers"] = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("."))
        results[f"stage{stage}_{mode}"] = result
    return results


def test_async_save_equals_sync_and_overlaps_training(dist_pool, tmp_path):
    results = dist_pool(WORLD).run(async_equals_sync_and_overlaps, str(tmp_path), timeout=240)
    for rank, per_config in enumerate(results):
        for name, result in per_config.items():
            writer = ["start", "rank_file"] + (["all_ranks", "before_rename", "published"] if rank == 0 else [])
            assert result["events"] == ["save returned", "step done", *writer, "waited"], (rank, name, result)
            assert result["changed"], (rank, name)
            if rank == 0:
                assert result["latest_during"] == "sync", (name, result)
                assert result["latest"] == "async", (name, result)
                assert result["problems"] == [], (name, result["problems"])
                assert result["fp32_equal"], name
                assert result["leftovers"] == [], (name, result["leftovers"])


def _fail_at(point: str, rank: int, error: OSError):
    def hook(at: str, at_rank: int) -> None:
        if at == point and at_rank == rank:
            raise error

    return hook


def writer_errors_surface(root: str) -> dict:
    rank = dist.get_rank()
    ckpt = Path(root)
    engine = make_engine(1, "fp32", seed=0)
    train(engine, 0, 1)
    engine.save_checkpoint(ckpt, tag="good", async_save=True)
    outcome = {}
    cases = [
        ("disk_full", "start", 1, OSError(errno.ENOSPC, "No space left on device"), "save"),
        ("permission", "before_rename", 0, PermissionError(errno.EACCES, "Permission denied"), "load"),
    ]
    for name, point, failing, error, surfaced_by in cases:
        async_save.WRITER_HOOK = _fail_at(point, failing, error)
        try:
            engine.save_checkpoint(ckpt, tag=name, async_save=True)  # waits for "good" first: no error
            train(engine, 1, 2)
            try:
                if surfaced_by == "save":
                    engine.save_checkpoint(ckpt, tag="never")
                else:
                    engine.load_checkpoint(ckpt)
                outcome[name] = "no error"
            except CheckpointError as exc:
                outcome[name] = str(exc)
        finally:
            async_save.WRITER_HOOK = None
        dist.barrier()
        if rank == 0:
            outcome[name + ":latest"] = (ckpt / "latest").read_text().strip()
    # The next save works, and clears the failed save's temporary directory.
    engine.save_checkpoint(ckpt, tag="after", async_save=True)
    engine.destroy()  # waits for it
    dist.barrier()
    if rank == 0:
        outcome["after:latest"] = (ckpt / "latest").read_text().strip()
        outcome["leftovers"] = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("."))
    return outcome


def test_writer_errors_surface_on_every_rank(dist_pool, tmp_path):
    results = dist_pool(WORLD).run(writer_errors_surface, str(tmp_path), timeout=240)
    for rank, outcome in enumerate(results):
        disk_full, permission = outcome["disk_full"], outcome["permission"]
        assert "rank 1" in disk_full and "No space left on device" in disk_full, (rank, disk_full)
        assert "asynchronous save" in disk_full and "disk_full" in disk_full, (rank, disk_full)
        assert "rank(s) [0]" in permission or rank == 0, (rank, permission)
        assert "Permission denied" in permission and "permission" in permission, (rank, permission)
    assert results[0]["disk_full:latest"] == "good"
    assert results[0]["permission:latest"] == "good"
    assert results[0]["after:latest"] == "after"
    # ".permission.tmp" is cleared; ".disk_full.tmp" too (this process's own unfinished saves).
    assert results[0]["leftovers"] == [], results[0]["leftovers"]
