"""A short training run that ends like a user's script: run by tests/dist/launch/test_clean_exit.py.

    torchrun --standalone --nproc_per_node 2 tests/dist/clean_exit_script.py CHECKPOINT_DIR

A stage-2 engine and then a stage-3 engine (hybrid sharding: a second process group) each
train two optimizer steps (two micro-steps each, so every backward issues asynchronous
gradient reductions from autograd hooks), save a checkpoint, and the stage-3 engine runs one
more backward just before the script ends. The
script neither frees the engines nor destroys the process group: zeroshard created the group
(`initialize` under torchrun) and must tear it down at exit without an abort.

An atexit probe registered before zeroshard's own handler runs after it (atexit is last in,
first out): it checks that the process group's gloo worker threads, seen alive during the
run, are gone before the interpreter finalizes. A worker thread that survives into
finalization is what aborted ("terminate called without an active exception"); the probe
makes that visible on every run instead of on the unlucky ones.
"""

import atexit
import os
import sys

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended while listing
            pass
    return names


def probe_workers_joined() -> None:
    alive = thread_names().count(GLOO_WORKER)
    if alive:
        sys.stderr.write(f"clean_exit_script: {alive} gloo worker thread(s) alive at interpreter exit\n")
        sys.stderr.flush()
        os._exit(3)


atexit.register(probe_workers_joined)  # before zeroshard registers its handler: runs after it

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zeroshard  # noqa: E402


def config(stage: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        # Small buckets: several reductions per backward, so several are in flight at once.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
    }
    if stage == 3:
        # Hybrid sharding with shard groups of 1: the engine creates a second process group
        # (the replicas, both ranks) and holds it; it must not outlive the default group.
        cfg["zeroshard"] = {"shard_group_size": 1}
    return cfg


def train(stage: int, save_dir: str, trailing_backward: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    g = torch.Generator().manual_seed(engine.global_rank)
    while engine.global_steps < 2:
        x = torch.randn(4, 16, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.save_checkpoint(save_dir, tag=f"stage{stage}")
    if trailing_backward:
        # Exit in the middle of an accumulation: the last thing the run does is a backward
        # whose reductions ran on gloo's worker threads.
        engine.backward(engine(torch.randn(4, 16, generator=g)).pow(2).mean())
    return engine


ENGINES = []  # kept alive to the end, as a script's module-level engine is


def main() -> None:
    save_dir = sys.argv[1]
    ENGINES.append(train(2, save_dir, trailing_backward=False))
    workers = thread_names().count(GLOO_WORKER)
    if workers == 0:
        # The probe above could not see a leak: fail loudly rather than pass vacuously.
        raise SystemExit(f"clean_exit_script: no '{GLOO_WORKER}' thread while the group is alive")
    ENGINES.append(train(3, save_dir, trailing_backward=True))


if __name__ == "__main__":
    main()
