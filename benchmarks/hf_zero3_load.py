"""Peak host memory per rank of Hugging Face `from_pretrained`: plain, and under ZeRO-3 through
the `deepspeed` alias (transformers builds the model in `deepspeed.zero.Init` and copies the
checkpoint in one module at a time).

    python benchmarks/hf_zero3_load.py [--world-size 2] [--hidden 1024] [--layers 6] [--vocab 16000]

The parent writes a Llama checkpoint (fp32 safetensors, `save_pretrained`) of the given shape
once. Then for each variant `world-size` fresh processes (gloo, CPU) import transformers, create
the process group, and load it: plainly (every rank loads the whole model), or with a stage-3
`HfDeepSpeedConfig` alive. A thread samples /proc/self/statm every millisecond during the load;
the table shows, per rank, the peak above the RSS just before the load, in all and for anonymous
memory only (RSS minus the file-backed, shared pages), and what is still held after it.

Why both: safetensors files are memory-mapped, and a page of the file that the load reads
counts in RSS while it is mapped. Under ZeRO-3 rank 0 reads every value (it alone copies the
checkpoint into the gathered modules; the other ranks read only names and shapes), so its
file-backed pages reach the checkpoint's size until the load returns; they are the page cache,
which the kernel can drop, not memory the process allocated. The anonymous peak is what the
load allocates: about one rank's parts plus one module's full parameters under ZeRO-3.

Workers run with MALLOC_MMAP_THRESHOLD_=65536 (unless set), as benchmarks/zero_init_memory.py
explains, so that freed parameters leave RSS in both variants alike. Writes
benchmarks/results/hf_zero3_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from host_memory import PeakSampler, rss, spawn_ranks

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
STAGE3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def llama_config(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, vocab_size=vocab,
                       max_position_embeddings=256, tie_word_embeddings=False)


def worker(rank: int, world: int, port: int, variant: str, path: str, alias: str, queue) -> None:
    import sys

    if variant == "zero3":
        sys.path.insert(0, alias)  # before transformers is imported: it looks for deepspeed once
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import zeroshard

    keep_alive = None
    if variant == "zero3":
        keep_alive = HfDeepSpeedConfig(STAGE3)
        assert is_deepspeed_zero3_enabled()
    dist.barrier()
    before, before_anon = rss()
    sampler = PeakSampler().start()
    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(path)
    seconds = time.perf_counter() - start
    sampler.stop()
    after, after_anon = rss()
    # Read every value once (a forward would): a plain load's memory-mapped pages become resident.
    touch = PeakSampler().start()
    with torch.no_grad():
        for p in model.parameters():
            (p.ds_tensor if getattr(p, "ds_tensor", None) is not None else p).sum()
    touch.stop()
    touched, touched_anon = rss()
    # Then what training starts with: initialize at stage 3 (the engine's flats and shards).
    init = PeakSampler().start()
    engine, *_ = zeroshard.initialize(model=model, config=STAGE3)
    init.stop()
    engine_held, engine_anon = rss()
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    largest = max(sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False))
                  for m in model.modules())
    queue.put({"variant": variant, "rank": rank, "peak": sampler.peak - before,
               "peak_anon": sampler.peak_anon - before_anon, "held": after - before,
               "held_anon": after_anon - before_anon, "touched": touched - before,
               "touched_anon": touched_anon - before_anon, "init_peak": init.peak - before,
               "init_peak_anon": init.peak_anon - before_anon, "engine_anon": engine_anon - before_anon,
               "model_bytes": numel * 4,
               "largest_module_bytes": largest * 4, "seconds": seconds})
    del keep_alive
    dist.barrier()
    dist.destroy_process_group()


def run_variant(variant: str, world: int, path: str, alias: str) -> list[dict]:
    return spawn_ranks(worker, world, (variant, path, alias), variant, timeout_s=1200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16000)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the workers (docstring)
    import torch
    from transformers import LlamaForCausalLM

    from zeroshard.tools.deepspeed_alias import install

    with tempfile.TemporaryDirectory(prefix="hf_zero3_load-") as tmp:
        alias = str(Path(tmp) / "alias")
        install(target=Path(alias))  # the folder that goes on sys.path (it holds deepspeed/ and its dist-info)
        path = str(Path(tmp) / "checkpoint")
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(args.hidden, args.layers, args.vocab)).save_pretrained(path)
        rows = run_variant("plain", args.world_size, path, alias)
        rows += run_variant("zero3", args.world_size, path, alias)
    first = rows[0]
    print(f"model: {first['model_bytes'] / MIB:.1f} MiB in fp32 (largest module "
          f"{first['largest_module_bytes'] / MIB:.1f} MiB); world size {args.world_size}; "
          "MiB above the RSS before the load")
    columns = [("peak", "load: peak RSS"), ("peak_anon", "peak anon"), ("held", "held RSS"),
               ("held_anon", "held anon"), ("touched", "read: RSS"), ("touched_anon", "anon"),
               ("init_peak_anon", "initialize: peak anon"), ("engine_anon", "engine anon")]
    print(f"{'variant':<7} {'rank':>4} " + " ".join(f"{title:>{max(9, len(title))}}" for _, title in columns)
          + f" {'load s':>7}")
    for row in rows:
        print(f"{row['variant']:<7} {row['rank']:>4} "
              + " ".join(f"{row[key] / MIB:>{max(9, len(title))}.1f}" for key, title in columns)
              + f" {row['seconds']:>7.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "hf_zero3_load.json"
    out.write_text(json.dumps({"world_size": args.world_size, "hidden": args.hidden, "layers": args.layers,
                               "vocab": args.vocab, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
