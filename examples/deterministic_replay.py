"""Replay a training step on one process, bit for bit (docs/deterministic-reduction.md).

The run, on any power-of-two number of processes (here 2; the recipe is the same at 64 GPUs):

    torchrun --nproc_per_node 2 examples/deterministic_replay.py --dir /tmp/replay --steps 4

trains the tiny demo GPT (with dropout) on synthetic bytes through the engine's own loader, in
steps of 16 samples = 8 micro-batches of 2, with "zeroshard": {"deterministic_reduction": true}.
Before each step it saves a checkpoint (tag `before_step<N>`), and it records in
/tmp/replay/record.json every micro-batch's loss (by its global index k: rank k mod W, micro-step
k div W), the step's grad norm and a digest of the parameters after the step.

The replay, on one process (so 8 micro-steps of accumulation instead of 4 x 2 ranks):

    python examples/deterministic_replay.py --dir /tmp/replay --replay-step 2

loads `before_step2`, runs step 2 on the same micro-batches, prints each micro-batch's loss and
samples, and whether the losses, the grad norm and the parameters are the recorded bits. On a CPU
the run and the replay must use the same number of threads per process (a matmul's order depends
on it): torchrun sets one, so the replay sets one too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import zeroshard
from zeroshard.models import build_gpt

CONFIG = {
    "train_batch_size": 16,  # the same at every world size: the step's 8 micro-batches
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "steps_per_print": 1000,
    "seed": 7,
    "zeroshard": {"deterministic_reduction": True},
}
SEQ = 32


def dataset() -> TensorDataset:
    """64 sequences of random bytes (an epoch is 4 steps); the targets are the next bytes."""
    data = torch.randint(0, 256, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(data[:, :-1], data[:, 1:])


def world_and_rank() -> tuple[int, int]:
    """(ranks, this rank); (1, 0) for one process without a launcher (no process group)."""
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def digest(engine) -> str:
    """sha256 of every full fp32 master, in order (a collective)."""
    h = hashlib.sha256()
    for _, p in engine.module.named_parameters():
        h.update(zeroshard.safe_get_full_fp32_param(p).numpy().tobytes())
    return h.hexdigest()[:16]


def train_step(engine, batches, step: int) -> dict:
    """One optimizer step over this rank's micro-batches; the losses by global index k."""
    world, rank = world_and_rank()
    losses = {}
    for j in range(engine.gradient_accumulation_steps()):
        x, y = next(batches)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        k = (step * engine.gradient_accumulation_steps() + j) * world + rank
        losses[k] = loss.item()
    gathered = [losses]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, losses)
    every = {k: v for part in gathered for k, v in part.items()}
    return {"losses": {str(k): every[k].hex() for k in sorted(every)},
            "grad_norm": engine.get_global_grad_norm().hex(), "params_after": digest(engine)}


def engine_and_loader():
    torch.manual_seed(0)
    model = build_gpt("tiny", block_size=SEQ, dropout=0.1)
    engine, _, loader, _ = zeroshard.initialize(model=model, config=CONFIG, training_data=dataset())
    return engine, loader


def run(out: Path, steps: int) -> None:
    engine, loader = engine_and_loader()
    steps_per_epoch = len(dataset()) // CONFIG["train_batch_size"]
    record = {}
    batches = None
    for step in range(steps):
        if step % steps_per_epoch == 0:
            loader.batch_sampler.set_epoch(step // steps_per_epoch)
            batches = iter(loader)
        engine.save_checkpoint(str(out), tag=f"before_step{step}")
        record[step] = train_step(engine, batches, step)
        world, rank = world_and_rank()
        if rank == 0:
            print(f"step {step} grad_norm {float.fromhex(record[step]['grad_norm']):.6f} "
                  f"params {record[step]['params_after']} (world {world})")
    if world_and_rank()[1] == 0:
        (out / "record.json").write_text(json.dumps({"world_size": world_and_rank()[0], "steps": record}))


def replay(out: Path, step: int) -> bool:
    recorded = json.loads((out / "record.json").read_text())
    engine, loader = engine_and_loader()
    engine.load_checkpoint(str(out), tag=f"before_step{step}")
    steps_per_epoch = len(dataset()) // CONFIG["train_batch_size"]
    loader.batch_sampler.set_epoch(step // steps_per_epoch)
    loader.batch_sampler.set_start_step(step % steps_per_epoch)
    samples = list(loader.batch_sampler)
    got = train_step(engine, iter(loader), step)
    want = recorded["steps"][str(step)]
    world, _ = world_and_rank()
    first = step * engine.gradient_accumulation_steps() * world
    for k, loss in got["losses"].items():
        print(f"micro-batch {k}: loss {float.fromhex(loss):.6f} samples {samples[int(k) - first]}")
    same = {what: got[what] == want[what] for what in ("losses", "grad_norm", "params_after")}
    print(f"replayed step {step} on {world} process(es) (recorded on {recorded['world_size']}): "
          f"losses same bits: {same['losses']}, grad norm {float.fromhex(got['grad_norm']):.6f} same bits: "
          f"{same['grad_norm']}, parameters after the step same bits: {same['params_after']}")
    return all(same.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="checkpoints and record.json")
    parser.add_argument("--steps", type=int, default=4, help="the run: steps to train")
    parser.add_argument("--replay-step", type=int, default=None, help="replay this step instead of training")
    args = parser.parse_args()
    if args.replay_step is not None and "WORLD_SIZE" not in os.environ:
        torch.set_num_threads(1)  # as each torchrun process has (OMP_NUM_THREADS=1)
    zeroshard.init_distributed()
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.replay_step is None:
        run(out, args.steps)
        return 0
    return 0 if replay(out, args.replay_step) else 1


if __name__ == "__main__":
    sys.exit(main())
