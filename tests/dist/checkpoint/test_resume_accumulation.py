"""A resume at another world size keeps the accumulation boundary (issue 36 item 1).

World 2 with train_batch_size 12 and micro-batch 3 (accumulation 2) saves after step 3; world 1
with the same config (accumulation 4) loads it and continues. The resumed run must start at a
boundary: the optimizer steps after the 4th and 8th micro-batch (`global_steps` after each
micro-step 3,3,3,4,4,4,4,5; before the fix 3,4,4,4,4,5,5,5, so the first step averaged half a
batch), and steps 4-5 equal the uninterrupted world-2 run. Both runs see the same 12 samples per
step (micro-batch m of a step is rank m // 2's (m % 2)-th at world 2, the m-th at world 1).

Tolerance: the world-1 run sums the same four micro-batch gradients in another order (one
process instead of a reduce-scatter over two), fp32: masters and losses within rtol 1e-5,
atol 1e-7 (measured max relative difference about 1e-7; the unfixed run is 1e-2 apart).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zeroshard
from tests.dist.checkpoint.test_checkpoint_helpers import VOCAB, TinyLM

MICRO, TRAIN_BATCH, SEQ = 3, 12, 5
SAVE_AFTER, STEPS = 3, 5


def _engine():
    torch.manual_seed(0)
    config = {
        "train_batch_size": TRAIN_BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
    }
    engine, *_ = zeroshard.initialize(model=TinyLM(), config=config)
    return engine


def _micro_batch(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + m)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen), torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)


def _train(engine, steps: range) -> tuple[list[float], list[int]]:
    """(each step's mean loss over the global batch, global_steps after every micro-step)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ga = engine.gradient_accumulation_steps()
    losses, counted = [], []
    for step in steps:
        total = torch.zeros(())
        for i in range(ga):
            loss = engine(*_micro_batch(step, rank * ga + i))
            engine.backward(loss)
            engine.step()
            counted.append(engine.global_steps)
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(float(total) / (world * ga))
    return losses, counted


def _masters(engine) -> dict[str, torch.Tensor]:
    return {n: zeroshard.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()
            if p.requires_grad}


def uninterrupted_on_two(save_dir: str) -> dict:
    engine = _engine()
    _train(engine, range(SAVE_AFTER))
    engine.save_checkpoint(save_dir)
    losses, _ = _train(engine, range(SAVE_AFTER, STEPS))
    return {"losses": losses, "masters": _masters(engine)}


def resumed_on_one(save_dir: str) -> dict:
    engine = _engine()
    engine.load_checkpoint(save_dir)
    position = (engine.global_steps, engine.micro_steps)
    losses, counted = _train(engine, range(SAVE_AFTER, STEPS))
    return {"position": position, "counted": counted, "losses": losses, "masters": _masters(engine)}


def test_resume_at_another_world_size_starts_at_a_boundary(dist_pool, tmp_path) -> None:
    save_dir = str(tmp_path / "ckpt")
    two = dist_pool(2).run(uninterrupted_on_two, save_dir, timeout=120)[0]
    one = dist_pool(1).run(resumed_on_one, save_dir, timeout=120)[0]
    assert one["position"] == (3, 12), one["position"]  # 3 windows of 4 micro-steps
    assert one["counted"] == [3, 3, 3, 4, 4, 4, 4, 5], one["counted"]
    torch.testing.assert_close(one["losses"], two["losses"], rtol=1e-5, atol=1e-7)
    for name, value in two["masters"].items():
        torch.testing.assert_close(one["masters"][name], value, rtol=1e-5, atol=1e-7, msg=name)
