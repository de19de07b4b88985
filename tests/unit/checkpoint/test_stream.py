"""Checkpoints in bounded host memory (docs/memory.md): the streamed safetensors writer against
safetensors' own reader, and save / to-fp32 / 16-bit export / load of a one-rank engine measured by
the CPU allocator's count (zeroshard.memory.AllocationTracker) against what one tensor, one unit
or one flat takes, well under the model (the issue's cap is the rank's share plus the largest
unit plus 10%)."""

import pytest
import torch
from safetensors.torch import load_file

import zeroshard
from zeroshard.checkpoint import write_fp32
from zeroshard.checkpoint.stream import StreamedSafetensors
from zeroshard.memory import AllocationTracker, enable_cpu_memory_reporting
from zeroshard.models import build_gpt

# What a step of these operations allocates besides the tensors bounded below: index and
# metadata strings, RNG state, safetensors' handles (measured: under 40 KiB).
SMALL = 64 * 1024


def test_streamed_file_reads_back_as_written(tmp_path):
    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.arange(7), "z": torch.randn(2, 2, 2),
               "empty": torch.empty(0), "scalar": torch.tensor(3.0), "mask": torch.tensor([True, False])}
    path = tmp_path / "x.safetensors"
    with StreamedSafetensors(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], {"k": "v"}) as out:
        for name in reversed(list(tensors)):  # any order
            out.write(name, tensors[name])
    back = load_file(path)
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value)
    with pytest.raises(ValueError, match=r"'a': torch.int64 \(6,\), the header says torch.int64 \(7,\)"):
        StreamedSafetensors(tmp_path / "y.safetensors", [("a", torch.int64, (7,))]).write("a", torch.arange(6))
    with pytest.raises(RuntimeError, match="1 tensor\\(s\\) never written"):
        StreamedSafetensors(tmp_path / "z.safetensors", [("a", torch.int64, (7,))]).close()


def _peak(fn) -> int:
    with AllocationTracker() as tracker:
        fn()
    return tracker.peak_bytes


def test_save_consolidate_export_load_hold_one_piece_at_a_time(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    # Counted from before the engine exists, so that a state the load replaces counts as freed.
    enable_cpu_memory_reporting()
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=build_gpt("tiny"), config=config)
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x)[1])
    engine.step()
    flats = engine.flats
    params = sum(f.numel for f in flats)
    largest_param = max(n for f in flats for n in f.numels)
    largest_flat = max(f.master.numel() * 4 * 3 for f in flats)  # fp32 master and AdamW's two moments
    largest_unit = max(sum(f.padded_numel * 2 for f in u.flats) for u in engine.units)  # bf16, gathered
    share = sum(f.master.numel() * 4 * 3 for f in flats)
    assert largest_flat < share / 4  # the bounds below are far from "a copy of everything"

    save = _peak(lambda: engine.save_checkpoint(tmp_path / "ckpt", tag="t"))
    assert save <= SMALL, save  # on the CPU every tensor is written where it lies
    fp32 = _peak(lambda: write_fp32(tmp_path / "ckpt", tmp_path / "model.safetensors", tag="t"))
    assert fp32 <= 2 * 4 * largest_param + SMALL < 4 * params, fp32  # one parameter and its fragments
    export = _peak(lambda: engine.save_16bit_model(tmp_path, "model16.safetensors"))
    assert export <= largest_unit + 2 * largest_param + SMALL, export  # one gathered unit
    load = _peak(lambda: engine.load_checkpoint(tmp_path / "ckpt", tag="t"))
    assert load <= largest_flat + 4 * largest_param + SMALL, load  # one flat's master and state
    engine.destroy()
