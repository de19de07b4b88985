"""Check g: zeroshard.fp8 on the device (docs/precision.md, "FP8 compute"), in the GPU check's
group of one.

- `fp8_loss(stage, device)`: the demo GPT ("tiny", block Linears in fp8) trained STEPS steps (the
  CPU: CPU_STEPS short ones, stage 3 only; tests/dist/precision/test_fp8.py covers the CPU) in
  bf16 and in fp8 on the device (torchao's emulation where the device has no fp8 matmuls: the
  CPU, a GPU below compute capability 8.9): the mean loss of the last 10 steps of fp8 within BAND
  of bf16's. BAND is the bf16 band over seeds that benchmarks/fp8_band.py measured on the CPU
  (docs/precision.md quotes the run); a GPU's kernels round differently, so a failure here is
  worth reading against that script run on the GPU.
- `fp8_speed(device)`: an 8B-shaped stack (Llama-3-8B's width 4096, 32 heads, the demo GPT's
  4x MLP, 4 layers, sequence 8192, micro-batch 1) in bf16 and in fp8 at each stage: tokens/s and
  peak memory, eager (no torch.compile). A GPU with fp8 matmuls only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.gpu_check.report import Skip

STEPS = 20
CPU_STEPS = 2
BAND = 0.155  # nats: the bf16 band over seeds after 50 steps (benchmarks/fp8_band.py, docs/precision.md)


def _has_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_loss(stage: int, device: torch.device) -> dict[str, Any] | tuple[str, dict[str, Any], str]:
    from tests.dist.scenarios.fp8 import batches, build, train

    emulate = not _has_fp8(device)
    # The CPU run only keeps the check's code alive (its figures are the suite's and
    # benchmarks/fp8_band.py's): a few short steps.
    steps, micro, seq = (STEPS, 4, 64) if device.type == "cuda" else (CPU_STEPS, 2, 32)
    data = batches(0, steps, micro, seq)
    window = min(10, steps)
    tails = {}
    for fp8 in (False, True):
        engine = build(stage, fp8, 0, micro, 1, emulate=emulate)
        losses = train(engine, data, micro, 1)
        engine.destroy()
        tails["fp8" if fp8 else "bf16"] = sum(losses[-window:]) / window
    gap = abs(tails["fp8"] - tails["bf16"])
    numbers = {**tails, "gap": gap, "band": BAND, "emulated": emulate}
    if gap > BAND:
        return "FAIL", numbers, f"fp8 loss {tails['fp8']:.4f} is {gap:.4f} from bf16's {tails['bf16']:.4f}"
    return numbers


def fp8_speed(device: torch.device) -> dict[str, Any]:
    if not _has_fp8(device):
        raise Skip("needs a GPU with fp8 matmuls (compute capability 8.9 or newer)")
    from tests.dist.scenarios.fp8 import build

    seq, steps, warmup = 8192, 6, 2
    shape = {"n_embd": 4096, "n_head": 32, "n_layer": 4, "block_size": seq}
    numbers: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        for fp8 in (False, True):
            engine = build(stage, fp8, 0, 1, 1, preset="1b", emulate=False, **shape)
            tokens = torch.randint(0, 256, (1, seq + 1), device=engine.device)
            torch.cuda.reset_peak_memory_stats(device)
            for i in range(warmup + steps):
                if i == warmup:
                    torch.cuda.synchronize(device)
                    start = time.perf_counter()
                _, loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
            torch.cuda.synchronize(device)
            key = f"s{stage}_{'fp8' if fp8 else 'bf16'}"
            numbers[f"{key}_tok_s"] = round(steps * seq / (time.perf_counter() - start))
            numbers[f"{key}_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            engine.destroy()
            del engine
            torch.cuda.empty_cache()
        numbers[f"s{stage}_speedup"] = round(numbers[f"s{stage}_fp8_tok_s"] / numbers[f"s{stage}_bf16_tok_s"], 3)
    return numbers
