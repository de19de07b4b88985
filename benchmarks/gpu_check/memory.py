"""Check i (issue 39): the predicted per-rank peak against the measured one, stages 0-3.

On a GPU: the demo's `1b` preset at sequence 2048, bf16, AdamW, clipping 1.0 (the model rows'
configuration, micro-batch from the same memory arithmetic), measured as
`torch.cuda.max_memory_allocated` over one step after a warm-up step, predicted by
`zeroshard.memory.predict_memory(..., device_type="cuda")` (what `zeroshard explain --model 1b
--seq 2048 --micro-batch M` prints); on the CPU the `tiny` preset at sequence 64, measured by
`zeroshard.memory.AllocationTracker`. Within 5% passes (issue 39's goal). The row also reports
the predicted reserved memory beside `torch.cuda.max_memory_reserved`.
"""

from __future__ import annotations

import gc

import torch

from benchmarks.gpu_check.model_bench import ADAMW, micro_batch_from_memory

TOLERANCE = 0.05


def _config(stage: int, micro: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
        "steps_per_print": 1_000_000,
    }


def memory_peak(stage: int, device: torch.device) -> dict:
    import zeroshard
    from zeroshard.memory import AllocationTracker, enable_cpu_memory_reporting, predict_memory, preset_spec
    from zeroshard.models import build_gpt
    from zeroshard.resolve import resolve_config

    on_gpu = device.type == "cuda"
    preset, seq = ("1b", 2048) if on_gpu else ("tiny", 64)
    micro = micro_batch_from_memory() if on_gpu else 4
    raw = _config(stage, micro)
    plan = predict_memory(preset_spec(preset), resolve_config(raw, world_size=1), 1, micro_batch=micro, seq=seq,
                          device_type=device.type)
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    else:
        enable_cpu_memory_reporting()
        base = AllocationTracker.live_bytes()
    torch.manual_seed(0)
    with torch.device(device):
        model = build_gpt(preset, block_size=max(seq, 64))
    engine, *_ = zeroshard.initialize(model=model, config=raw)
    del model
    x = torch.randint(0, 256, (micro, seq), device=device)
    y = torch.randint(0, 256, (micro, seq), device=device)
    try:
        engine.backward(engine(x, y)[1])  # warm-up: the optimizer's state comes to exist
        engine.step()
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            engine.backward(engine(x, y)[1])
            engine.step()
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
        else:
            with AllocationTracker() as tracker:
                engine.backward(engine(x, y)[1])
                engine.step()
            measured = tracker.zero_bytes - base + tracker.peak_bytes
            reserved = None
    finally:
        engine.destroy()
        del engine
        gc.collect()
    ratio = plan.device_peak_bytes / measured
    gib = 2**30
    numbers = {
        "preset": preset, "seq": seq, "micro": micro, "predicted_gib": round(plan.device_peak_bytes / gib, 3),
        "measured_gib": round(measured / gib, 3), "ratio": round(ratio, 4), "peak_phase": plan.peak_phase,
        "largest_parts": {k: round(v / gib, 3) for k, v in plan.largest_parts(4)},
    }
    if reserved is not None:
        numbers.update(predicted_reserved_gib=round(plan.reserved_bytes / gib, 3),
                       measured_reserved_gib=round(reserved / gib, 3))
    if abs(ratio - 1) > TOLERANCE:
        return "FAIL", numbers, f"predicted/measured {ratio:.3f}, outside {TOLERANCE:.0%}"
    return "ok", numbers, ""
