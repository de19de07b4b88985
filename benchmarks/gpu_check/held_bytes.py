"""Bytes each engine keeps between optimizer steps, per parameter, measured on the CPU.

    python -m benchmarks.gpu_check.held_bytes [--preset small] [--stages 0,1,2,3]

Every live tensor's storage is counted once (by its data pointer) after two steps, minus what was
alive before the engine was built: what stays allocated into the next forward, where activations
come on top. The GPU check's model rows measure the same on the device (`states_gb`); this one
needs no GPU and names the bytes per parameter, for docs/benchmarks.md's accounting. World size 1
(gloo); zeroshard with bf16 as the model benchmark configures it, the plain loop as it runs it
(fp32 parameters, AdamW, gradients set to None after the step).
"""

from __future__ import annotations

import argparse
import gc
import os
import warnings

import torch
import torch.distributed as dist

from benchmarks.gpu_check.model_bench import ADAMW
from zeroshard.models import build_gpt


def live_bytes() -> int:
    """Bytes of every distinct storage a live tensor (parameters and their .grad included) holds."""
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for obj in objects:
        tensors = [obj]
        if isinstance(obj, torch.nn.Parameter) and obj.grad is not None:
            tensors.append(obj.grad)
        for t in tensors:
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def _is_tensor(obj) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a dead weak proxy
        return False


def _batch(preset: str):
    gen = torch.Generator().manual_seed(1)
    seq = 32
    x = torch.randint(0, 256, (2, seq), generator=gen)
    return x, torch.randint(0, 256, (2, seq), generator=gen)


def held_zeroshard(preset: str, stage: int) -> tuple[int, int]:
    import zeroshard

    base = live_bytes()
    torch.manual_seed(0)
    model = build_gpt(preset)
    n = model.num_params()
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
        "steps_per_print": 1_000_000,
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    del model
    x, y = _batch(preset)
    for _ in range(2):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    del loss
    held = live_bytes() - base - x.nbytes - y.nbytes
    engine.destroy()
    return held, n


def held_plain(preset: str) -> tuple[int, int]:
    base = live_bytes()
    torch.manual_seed(0)
    model = build_gpt(preset)
    n = model.num_params()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    x, y = _batch(preset)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    del loss
    held = live_bytes() - base - x.nbytes - y.nbytes
    del opt, model
    return held, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--stages", default="0,1,2,3")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    held, n = held_plain(args.preset)
    print(f"plain (fp32 params, autocast bf16): {held / n:6.2f} bytes/param held between steps ({n:,} params)")
    for stage in (int(s) for s in args.stages.split(",")):
        held, n = held_zeroshard(args.preset, stage)
        print(f"zeroshard stage {stage} bf16:            {held / n:6.2f} bytes/param held between steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
