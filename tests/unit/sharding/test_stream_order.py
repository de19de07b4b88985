"""The event ordering of stage 3's gather stream and the reduce stream (zeroshard/sharding/streams.py's
[Note: streams and events]), checked on CPU with `RecordingStreams` injected where the engine
puts real CUDA streams on a GPU. No GPU ran these orderings (none was available); the test
proves the calls are made in the order the note requires:

* the gather stream waits on a compute event recorded after the buffer's allocation, before
  the all-gather writes it;
* compute waits on the gather's completion event before a unit's forward and backward use its
  parameters, and before its buffer is released; a release comes after the backward use;
* the reduce stream waits on the producer's compute event before the collective, and compute
  waits on every reduction's event before the step.
"""

from __future__ import annotations

import torch
from torch import nn

import zeroshard
from zeroshard.comm import collectives as comm
from zeroshard.sharding.streams import NULL_STREAMS, RecordingStreams, streams_for

BLOCKS = ("blocks.0", "blocks.1", "blocks.2")


class _MarkUse(torch.autograd.Function):
    """Identity that logs when its forward and backward run (on the Linear's output: its
    backward runs just before the Linear's backward reads the weight)."""

    @staticmethod
    def forward(ctx, x, name, log):
        ctx.name, ctx.log = name, log
        log.append(("forward", name))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("backward", ctx.name))
        return grad, None, None


class _Block(nn.Module):
    def __init__(self, name: str, log: list) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.name, self.log = name, log

    def forward(self, x):
        return torch.tanh(_MarkUse.apply(self.fc(x), self.name, self.log))


class _Model(nn.Module):
    def __init__(self, log: list) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(name, log) for name in BLOCKS)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _engine(log: list, stage: int = 3, bucket: int = 20) -> zeroshard.Engine:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": bucket,
        },
        "zeroshard": {"unit_module_classes": ["_Block"]},
    }
    engine, _, _, _ = zeroshard.initialize(model=_Model(log), config=config)
    return engine


def _record_streams(engine, monkeypatch) -> RecordingStreams:
    """Put recording streams where a GPU engine has real ones, and log each collective."""
    streams = RecordingStreams()
    engine._grads.reducer.streams = streams
    for flat in engine.flats:
        flat.streams = streams
    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        original = getattr(comm, name)

        def logged(*args, __name=name, __original=original, **kwargs):
            streams.log.append(("collective", __name, kwargs.get("tag", "")))
            return __original(*args, **kwargs)

        monkeypatch.setattr(comm, name, logged)
    return streams


def _train_step(engine, log: list) -> None:
    torch.manual_seed(1)
    engine.backward(engine(torch.randn(4, 8)))
    log.append(("step",))
    engine.step()


def test_cpu_engines_get_no_streams():
    assert streams_for(torch.device("cpu")) is NULL_STREAMS
    engine = _engine([])
    assert engine._grads.reducer.streams is NULL_STREAMS
    assert all(flat.streams is NULL_STREAMS for flat in engine.flats)


def test_gathers_wait_on_compute_and_compute_waits_before_use_and_release(monkeypatch):
    engine = _engine([])
    streams = _record_streams(engine, monkeypatch)
    for block in engine.module.blocks:
        block.log = streams.log
    _train_step(engine, streams.log)
    log = streams.log

    # Each all-gather of parameters runs inside the gather stream, after that stream waited on
    # a compute event recorded after the buffer's allocation.
    gathers = [i for i, e in enumerate(log) if e[:3] == ("collective", "all_gather", "param")]
    assert len(gathers) >= 2 * len(BLOCKS)  # every block in forward and again in backward
    for i in gathers:
        assert log[i - 2][:2] == ("enter", "gather"), log[i - 3 : i + 1]
        assert log[i - 1][:2] == ("wait", "gather") and log[i - 1][2].startswith("gather-ready:")
        assert log[i - 3][:2] == ("record", "compute") and log[i - 3][2] == log[i - 1][2]

    for name in BLOCKS:
        state = "released"  # sharded at the start; "gathered": compute waited on the gather
        uses = {"forward": 0, "backward": 0}
        for entry in log:
            if entry == ("wait", "compute", f"gather-done:{name}"):
                state = "gathered"
            elif entry == ("released", name):
                assert state == "gathered", f"{name} released before compute waited on its gather"
                state = "released"
            elif entry[0] in uses and entry[1] == name:
                assert state == "gathered", f"{name}'s {entry[0]} ran before compute waited on its gather"
                uses[entry[0]] += 1
        assert uses == {"forward": 1, "backward": 1}
        # Its buffer is released after its backward use (and only then, within the backward).
        backward_at = log.index(("backward", name))
        assert ("released", name) in log[backward_at:]
        assert state == "released"


def test_reductions_wait_on_the_producer_and_the_step_waits_on_them(monkeypatch):
    engine = _engine([], bucket=20)  # smaller than a block's 72 elements: several buckets
    streams = _record_streams(engine, monkeypatch)
    _train_step(engine, streams.log)
    log = streams.log
    step_at = log.index(("step",))

    reductions = [i for i, e in enumerate(log) if e[0] == "collective" and e[2] == "grad"]
    assert len(reductions) >= len(BLOCKS) + 1
    for i in reductions:
        # Inside the reduce stream, after it waited on the compute event of its bucket's producer.
        assert log[i - 2] == ("enter", "reduce")
        assert log[i - 1][:2] == ("wait", "reduce") and log[i - 1][2].startswith("produced:bucket-")
        label = log[i - 1][2].removeprefix("produced:")
        assert log[i - 3] == ("record", "compute", f"produced:{label}")
        # The reduction's event is recorded on the reduce stream and compute waits on it
        # before the step reads the reduced shard.
        done = log.index(("record", "reduce", f"reduced:{label}"))
        assert log.index(("wait", "compute", f"reduced:{label}")) > done
        assert done < step_at and log.index(("wait", "compute", f"reduced:{label}")) < step_at


def test_recorded_streams_change_no_value(monkeypatch):
    """The injected ordering calls leave the training bitwise what it is without them."""
    plain = _engine([])
    _train_step(plain, [])
    recorded = _engine([])
    _record_streams(recorded, monkeypatch)
    _train_step(recorded, [])
    for a, b in zip(plain.flats, recorded.flats, strict=True):
        assert torch.equal(a.master, b.master)
