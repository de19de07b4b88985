"""Rank-side scenarios for tests/dist/hf/test_hf_zero3_load.py: `from_pretrained` under ZeRO-3.

Rank 0 writes a tiny Llama with `save_pretrained` (safetensors). Every rank loads it plainly
first (no DeepSpeed config alive: the reference), then with a stage-3 config alive
(`HfDeepSpeedConfig`, or the Trainer's own through `TrainingArguments(deepspeed=...)`), which
makes transformers build the model under `deepspeed.zero.Init` and copy the checkpoint in one
module at a time under `deepspeed.zero.GatheredParameters(params, modifier_rank=0)`.

While the ZeRO-3 load runs, zeroshard/zero/partition.py's `gather` and `partition` are watched:
the most full-parameter elements this rank held at once is recorded (gathered and not yet
partitioned again; during construction, what a module's `__init__` created before Init
partitioned it), to compare with the largest module's own parameters.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.scenarios.hf_common import tiny_llama_config, use_alias

STAGE3 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}


class _Watch:
    """Full-parameter elements held at once by Init's partitioned parameters (see module doc)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # id(param) -> full numel, while it is whole
        self.peak = 0
        self.gathers = 0

    def note(self) -> None:
        self.peak = max(self.peak, sum(self.live.values()))


@contextlib.contextmanager
def _watch_partitioning() -> Iterator[_Watch]:
    from zeroshard.zero import init as init_mod
    from zeroshard.zero import partition as parts

    watch = _Watch()
    original_gather, original_partition = parts.gather, parts.partition
    original_tree = init_mod.Init._partition_tree

    def gather(p):
        original_gather(p)
        watch.gathers += 1
        watch.live[id(p)] = p.numel()
        watch.note()

    def partition(p, spec):
        watch.live.pop(id(p), None)
        original_partition(p, spec)

    def partition_tree(self, module):
        # What the module's __init__ created is whole now, next to what is gathered.
        fresh = {id(p): p.numel() for p in module.parameters() if not parts.was_partitioned(p)}
        watch.live.update(fresh)
        watch.note()
        original_tree(self, module)
        for key in fresh:
            watch.live.pop(key, None)

    parts.gather, parts.partition = gather, partition
    init_mod.Init._partition_tree = partition_tree
    try:
        yield watch
    finally:
        parts.gather, parts.partition = original_gather, original_partition
        init_mod.Init._partition_tree = original_tree


def _largest_module_numel(model: torch.nn.Module) -> int:
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def _write_checkpoint(path: str, tie: bool, dtype: torch.dtype) -> None:
    from transformers import LlamaForCausalLM

    if dist.get_rank() == 0:
        torch.manual_seed(1)
        LlamaForCausalLM(tiny_llama_config(tie=tie)).to(dtype).save_pretrained(path)
    dist.barrier()


def _summary(model: torch.nn.Module) -> dict[str, Any]:
    import deepspeed

    held = {
        name: {"numel": p.numel(), "ds_shape": tuple(p.ds_shape), "ds_numel": p.ds_numel,
               "part": p.ds_tensor.numel(), "dtype": p.dtype}
        for name, p in model.named_parameters()
    }
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        values = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return {"held": held, "values": values, "buffers": buffers,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight}


def load_cases(alias_dir: str, directory: str, cases: list[tuple[str, bool, str]]) -> list[dict[str, Any]]:
    """For each (name, tie_word_embeddings, dtype name): the plain load and the ZeRO-3 load."""
    use_alias(alias_dir)
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    results = []
    for name, tie, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        path = os.path.join(directory, name)
        _write_checkpoint(path, tie, dtype)
        plain = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
        reference = {
            "values": {n: p.detach().clone() for n, p in plain.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in plain.named_buffers()},
            "largest_module": _largest_module_numel(plain),
            "model_numel": sum(p.numel() for p in plain.parameters()),
        }
        del plain
        config = dict(STAGE3)
        if dtype == torch.bfloat16:
            config["bf16"] = {"enabled": True}
        keep_alive = HfDeepSpeedConfig(config)  # transformers holds only a weak reference
        assert is_deepspeed_zero3_enabled()
        with _watch_partitioning() as watch:
            model = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
        result = _summary(model)
        del keep_alive
        result.update(reference=reference, peak_full_numel=watch.peak, gathers=watch.gathers)
        results.append(result)
    return results


def trainer_config_load(alias_dir: str, directory: str) -> dict[str, Any]:
    """The Trainer's own config (with the "auto" values it fills in only after the model is
    built) alive through TrainingArguments: from_pretrained builds under zero.Init too."""
    use_alias(alias_dir)
    from transformers import LlamaForCausalLM, TrainingArguments
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled

    path = os.path.join(directory, "trainer")
    _write_checkpoint(path, False, torch.float32)
    plain = LlamaForCausalLM.from_pretrained(path)
    reference = {"values": {n: p.detach().clone() for n, p in plain.named_parameters()},
                 "buffers": {n: b.detach().clone() for n, b in plain.named_buffers()}}
    del plain
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
    }
    args = TrainingArguments(output_dir=os.path.join(directory, "out"), deepspeed=ds_config, use_cpu=True,
                             per_device_train_batch_size=2, report_to=[])
    assert is_deepspeed_zero3_enabled()
    left = sorted(k for k, v in deepspeed_config()["zero_optimization"].items() if v == "auto")
    with _watch_partitioning() as watch:
        model = LlamaForCausalLM.from_pretrained(path)
    result = _summary(model)
    del args
    result.update(reference=reference, peak_full_numel=watch.peak, autos_left=left)
    return result


def from_config_and_resize(alias_dir: str) -> dict[str, Any]:
    """The other ZeRO-3 paths of modeling_utils.py: `from_config` (built under zero.Init, then
    `initialize_weights_zero3`: rank 0 initialises each module's gathered parameters,
    `GatheredParameters(params, modifier_rank=0)` hands them to every rank) and
    `resize_token_embeddings` (gathers the old embedding and head and copies them into new,
    whole ones: transformers 5.23 builds those outside zero.Init on purpose, and `initialize`
    partitions them later from the first rank's values, as DeepSpeed's does)."""
    use_alias(alias_dir)
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(STAGE3)
    config = tiny_llama_config(initializer_range=0.02)
    model = AutoModelForCausalLM.from_config(config)
    partitioned = all(p.numel() == 0 and p.ds_tensor is not None for p in model.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    vocab = config.vocab_size  # resize_token_embeddings updates the config
    new_vocab = vocab + 8
    model.resize_token_embeddings(new_vocab)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    resized_whole = embed.numel() == new_vocab * config.hidden_size and head.numel() == embed.numel()
    with deepspeed.zero.GatheredParameters([embed, head]):
        resized = {"embed": embed.detach().clone(), "head": head.detach().clone()}
    del keep_alive
    return {"partitioned": partitioned, "values": values, "resized": resized,
            "resized_whole": resized_whole, "vocab": vocab, "new_vocab": new_vocab}
