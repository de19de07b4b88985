"""An out-of-memory error during training is re-raised naming the phase, the rank, the predicted
and the actual peak (zeroshard/memory/oom.py). The error is injected where torch would raise it:
the CPU allocator's own message, from inside the second block's forward and from the optimizer."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import zeroshard
from zeroshard.memory.budget import human_bytes
from zeroshard.memory.oom import ZeroshardOutOfMemoryError
from zeroshard.models import build_gpt

CPU_OOM = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1"


def _engine(budget_gb):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**9,
              "zeroshard": {"memory_budget_gb": budget_gb}}
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=build_gpt("tiny"), config=config)
    return engine


def _raise(*args):
    raise RuntimeError(CPU_OOM)


def _raise_on_real_input(module, args):
    if not isinstance(args[0], FakeTensor):  # the memory check traces a copy on fake tensors: let it
        _raise()


def test_out_of_memory_in_a_unit_forward_names_unit_rank_and_peaks():
    engine = _engine(1.0)  # a budget: the check runs, so there is a prediction to quote
    x = torch.randint(0, 256, (2, 16))
    handle = engine.module.blocks[1].register_forward_pre_hook(_raise_on_real_input)
    try:
        with pytest.raises(ZeroshardOutOfMemoryError) as info:
            engine(x, x)
    finally:
        handle.remove()
    message = str(info.value)
    assert isinstance(info.value, torch.OutOfMemoryError)  # `except torch.OutOfMemoryError` still catches it
    assert "out of memory on rank 0 in the forward of unit 'blocks.1' at step 0" in message
    predicted = engine.memory_guard.prediction.device_peak_bytes
    assert f"predicted peak {human_bytes(predicted)} (in backward; this phase " in message and "actual" in message
    assert CPU_OOM in message  # torch's own error follows
    engine.destroy()


def test_out_of_memory_in_the_optimizer_step_without_the_check():
    engine = _engine(None)  # null: no check, so no prediction to quote
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x)[1])
    engine.optimizer.step = _raise
    with pytest.raises(ZeroshardOutOfMemoryError, match="in the optimizer step at step 0: no prediction"):
        engine.step()
    assert engine.memory_guard.prediction is None
    engine.destroy()
