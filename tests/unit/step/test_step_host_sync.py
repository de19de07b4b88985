"""The optimizer step reads the device once, for the packed all-reduce that every step needs
(issue 14, docs/design.md section 10; step.py's [Note: host reads in a step]): whether the norm is finite,
which ranks produced a non-finite gradient and whether the ranks are at the same step (issue 13).
The norm, the clip coefficient and the clipped gradients stay on the device.

On CPU there is no device to wait for, so the test counts what would be a device-to-host
read on a GPU: every `item()`, `float()`, `int()`, `bool()` and `tolist()` of a tensor inside
`engine.step()`. Reads of the optimizer's `step` counters are allowed: torch keeps them on
the host unless the optimizer is fused or capturable (then its kernels read them on the
device), so reading them waits for nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard

READERS = ("item", "__float__", "__int__", "__bool__", "tolist")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).float().pow(2).mean()


def _engine(stage: int, precision: dict) -> zeroshard.Engine:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.01,  # below the norm: clipping runs
        "steps_per_print": 1000,  # the log line reads the norm: not on this step
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **precision,
    }
    engine, _, _, _ = zeroshard.initialize(model=_Model(), config=config)
    return engine


def _reads_in_step(monkeypatch, engine) -> list[tuple[str, tuple]]:
    engine.backward(engine(torch.randn(4, 8)))
    reads: list[tuple[str, torch.Tensor]] = []
    for name in READERS:
        original = getattr(torch.Tensor, name)

        def reader(self, *args, __name=name, __original=original):
            reads.append((__name, self))
            return __original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, reader)
    engine.step()
    monkeypatch.undo()
    step_counters = {id(s["step"]) for s in engine.optimizer.state.values() if "step" in s}
    return [(name, tuple(t.shape)) for name, t in reads if id(t) not in step_counters]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "precision", [{}, {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}], ids=["fp32", "autocast"]
)
def test_one_device_read_inside_a_step(monkeypatch, stage: int, precision: dict) -> None:
    engine = _engine(stage, precision)
    # One process: the packed vector is [norm^2, 1 flag, 1 step counter, 1 forward count, stop vote].
    assert _reads_in_step(monkeypatch, engine) == [("tolist", (5,))]
    norm = engine.get_global_grad_norm()  # read lazily, when asked
    assert norm is not None and norm > 0.01
    assert engine.get_post_clip_grad_norm() == pytest.approx(0.01, rel=1e-5)


@pytest.mark.parametrize("stage", [0, 3])
def test_overflow_checking_reads_nothing_more(monkeypatch, stage: int) -> None:
    """bf16 checks overflow by default: the skip decision comes from the same one read."""
    engine = _engine(stage, {"bf16": {"enabled": True}})
    assert _reads_in_step(monkeypatch, engine) == [("tolist", (5,))]
