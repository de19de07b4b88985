"""The Hugging Face Trainer on zeroshard, launched as users launch it (torchrun, 2 CPU processes).

    torchrun --nproc_per_node 2 tests/dist/scenarios/hf_trainer.py OUT.json WORKDIR [GROUP ...]

needs the `deepspeed` alias on PYTHONPATH (`zeroshard install-deepspeed-alias --target DIR`).
Runs every configuration of the groups named (default all) in this one launch, each through the
Trainer's own loop (`TrainingArguments(deepspeed=cfg_dict)`), and rank 0 writes what the test
compares (tests/dist/engine/test_hf_trainer.py) to OUT.json:

- `losses`: per-step losses of the same training without DeepSpeed (DDP) and with each stage
  0-3, in fp32 and in bf16, and `trainer.evaluate()`'s loss after it;
- `resume`: a stage-1 and a stage-3 run saved every 2 steps, then resumed
  (`resume_from_checkpoint=True`) from the step-2 checkpoint after the step-4 one is removed;
- `save_model`: `trainer.save_model()` at stage 3, loaded back with `from_pretrained`, against
  the weights the engine holds, gathered with `GatheredParameters`;
- `other`: `evaluate()` before training at stage 3 (ZeRO inference) against the plain model,
  `save_model` without `stage3_gather_16bit_weights_on_model_save`, `load_best_model_at_end`.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from tests.dist.scenarios.hf_common import reset_trainer_state

STEPS = 4


class TokenDataset(Dataset):
    """Fixed random token sequences; labels = inputs (causal LM)."""

    def __init__(self, n: int = 32, length: int = 16, vocab: int = 64, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def ds_config(stage: int, scheduler: bool = False) -> dict:
    """The config a Trainer user writes: "auto" wherever the Trainer fills the value in."""
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if scheduler:
        config["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                       "total_num_steps": "auto"},
        }
    return config


_LAUNCH_ENV = dict(os.environ)


def _reset_accelerate() -> None:
    reset_trainer_state(_LAUNCH_ENV)


def train(workdir: Path, name: str, deepspeed: dict | None, bf16: bool = False, save_steps: int | None = None,
          resume: bool = False, evaluate: bool = False, torch_compile_backend: str | None = None):
    """One Trainer run; returns (trainer, per-step losses). `torch_compile_backend` sets
    `torch_compile` (Accelerate then calls `engine.compile`), on a model without a KV cache
    in training (docs/compile.md)."""
    from transformers import Trainer, TrainingArguments

    _reset_accelerate()
    args = TrainingArguments(
        output_dir=str(workdir / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        per_device_eval_batch_size=2, max_steps=STEPS, learning_rate=1e-3, weight_decay=0.01, logging_steps=1,
        use_cpu=True, bf16=bf16,
        deepspeed=deepspeed, report_to=[], seed=0, dataloader_drop_last=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        torch_compile=torch_compile_backend is not None, torch_compile_backend=torch_compile_backend,
    )
    model = tiny_llama()
    if torch_compile_backend is not None:
        model.config.use_cache = False
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(),
                      eval_dataset=TokenDataset(n=8, seed=99))
    trainer.train(resume_from_checkpoint=True if resume else None)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    if evaluate:  # the Trainer's evaluation loop on the trained engine (prediction_step, gathers at stage 3)
        losses["eval"] = trainer.evaluate()["eval_loss"]
    losses["wrapper"] = type(trainer.model_wrapped).__name__
    return trainer, losses


def group_losses(workdir: Path) -> dict:
    out = {}
    for precision in ("fp32", "bf16"):
        bf16 = precision == "bf16"
        out[f"ddp_{precision}"] = train(workdir, f"ddp_{precision}", None, bf16, evaluate=True)[1]
        for stage in range(4):
            out[f"stage{stage}_{precision}"] = train(
                workdir, f"s{stage}_{precision}", ds_config(stage), bf16, evaluate=True
            )[1]
    return out


def group_resume(workdir: Path) -> dict:
    out = {}
    for stage in (1, 3):
        name = f"resume_s{stage}"
        _, whole = train(workdir, name, ds_config(stage, scheduler=True), save_steps=2)
        last = workdir / name / f"checkpoint-{STEPS}"
        found = sorted(p.name for p in (workdir / name / "checkpoint-2").iterdir())
        if int(os.environ["RANK"]) == 0:
            shutil.rmtree(last)  # as if the run had stopped after step 2
        torch.distributed.barrier()
        trainer, resumed = train(workdir, name, ds_config(stage, scheduler=True), save_steps=2, resume=True)
        out[f"stage{stage}"] = {"whole": whole, "resumed": resumed, "checkpoint_files": found,
                                "global_steps": trainer.model_wrapped.global_steps,
                                "fp32_from_checkpoint": _fp32_from_checkpoint(
                                    trainer, workdir / name / f"checkpoint-{STEPS}")}
    return out


def _fp32_from_checkpoint(trainer, checkpoint: Path) -> float | None:
    """DeepSpeed's recovery path for a Trainer checkpoint (`zero_to_fp32`): the largest difference
    between `load_state_dict_from_zero_checkpoint(model, checkpoint-N)` and the engine's weights
    gathered parameter by parameter (fp32 run: the weights are the masters). Rank 0's; None elsewhere."""
    from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    import zeroshard

    expected = {}
    for name, p in trainer.model_wrapped.module.named_parameters():
        with zeroshard.zero.GatheredParameters([p]):
            expected[name] = p.detach().clone()
    if int(os.environ["RANK"]) != 0:
        return None
    model = load_state_dict_from_zero_checkpoint(tiny_llama(), str(checkpoint))
    loaded = dict(model.named_parameters())
    return max(float((loaded[name].detach() - value).abs().max()) for name, value in expected.items())


def group_save_model(workdir: Path) -> dict:
    from transformers import LlamaForCausalLM
    from transformers.trainer_pt_utils import get_model_param_count

    import zeroshard

    trainer, _ = train(workdir, "save_model", ds_config(3))
    engine = trainer.model_wrapped
    saved = workdir / "save_model" / "final"
    trainer.save_model(str(saved))
    expected = {}
    for name, p in engine.module.named_parameters():
        with zeroshard.zero.GatheredParameters([p]):
            expected[name] = p.detach().clone()
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    out = {"param_count": get_model_param_count(trainer.model), "plain_param_count": tiny_llama().num_parameters()}
    _reset_accelerate()  # a plain load, as in a later inference process (no ZeRO-3 config alive)
    if int(os.environ["RANK"]) == 0:
        loaded = LlamaForCausalLM.from_pretrained(str(saved)).state_dict()
        out["files"] = sorted(p.name for p in saved.iterdir())
        out["loaded_vs_gathered"] = {
            name: float((loaded[name] - value).abs().max()) for name, value in expected.items()
        }
        out["missing"] = sorted(set(expected) - set(loaded))
        out["consolidated_vs_gathered"] = {
            name: float((consolidated[name] - value).abs().max()) for name, value in expected.items()
        }
        out["nonzero"] = all(bool(v.abs().sum() > 0) for v in expected.values())
    else:
        out["consolidated_on_other_rank"] = consolidated is None
    return out


def group_other(workdir: Path) -> dict:
    """ZeRO inference (evaluate before training), save_model without gathering, and
    load_best_model_at_end (deepspeed_load_checkpoint of the best checkpoint)."""
    from transformers import Trainer, TrainingArguments

    out = {}
    evaluation = TokenDataset(n=8, seed=99)
    for name, deepspeed in (("plain", None), ("inference", ds_config(3))):
        _reset_accelerate()
        args = TrainingArguments(output_dir=str(workdir / name), per_device_eval_batch_size=2, use_cpu=True,
                                 deepspeed=deepspeed, report_to=[], dataloader_drop_last=True)
        trainer = Trainer(model=tiny_llama(), args=args, eval_dataset=evaluation)
        out[f"{name}_eval_loss"] = trainer.evaluate()["eval_loss"]
        out[f"{name}_wrapper"] = type(trainer.model_wrapped).__name__

    # torch_compile=True: Accelerate calls engine.compile(backend=..., compile_kwargs=...); aot_eager runs
    # the eager kernels (inductor's C++ compile would take minutes on this machine).
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    trainer, out["compiled_losses"] = train(workdir, "compiled", ds_config(2), torch_compile_backend="aot_eager")
    out["is_compiled"] = trainer.model_wrapped.is_compiled
    out["compiled_regions"] = [(r.name, r.fullgraph) for r in trainer.model_wrapped.compiled_regions]
    out["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs

    # offload_optimizer with the Trainer's own torch optimizer: Accelerate swaps it for DeepSpeed's host
    # optimizer of the same family (map_pytorch_optim_to_deepspeed)
    offload = ds_config(2)
    del offload["optimizer"]
    offload["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    # (optim="adagrad" is not run: Accelerate passes adamw_mode= to DeepSpeedCPUAdagrad, whose DeepSpeed
    # signature has no such argument, so it fails with DeepSpeed 0.19.8 as here; docs/hf-trainer.md)
    trainer, losses = train(workdir, "offload_adamw_torch", offload)
    out["offload_adamw_torch"] = {"losses": losses, "optimizer": type(trainer.model_wrapped.optimizer).__name__}

    config = ds_config(3)
    del config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    trainer, _ = train(workdir, "nogather", config)
    trainer.save_model(str(workdir / "nogather" / "final"))
    out["nogather_files"] = sorted(p.name for p in (workdir / "nogather" / "final").iterdir())

    _reset_accelerate()
    args = TrainingArguments(
        output_dir=str(workdir / "best"), per_device_train_batch_size=2, per_device_eval_batch_size=2,
        max_steps=STEPS, learning_rate=1e-3, use_cpu=True, deepspeed=ds_config(2), report_to=[],
        dataloader_drop_last=True, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        load_best_model_at_end=True, seed=0,
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(), eval_dataset=evaluation)
    trainer.train()
    out["best_checkpoint"] = trainer.state.best_model_checkpoint
    out["best_metric"] = trainer.state.best_metric
    out["eval_history"] = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    out["eval_after_best"] = trainer.evaluate()["eval_loss"]
    return out


GROUPS = {"losses": group_losses, "resume": group_resume, "save_model": group_save_model, "other": group_other}


def main() -> None:
    out_path, workdir, *groups = sys.argv[1:]
    workdir = Path(workdir)
    results, seconds = {}, {}
    for name in groups or GROUPS:
        start = time.perf_counter()
        results[name] = GROUPS[name](workdir)
        seconds[name] = round(time.perf_counter() - start, 1)
    results["seconds"] = seconds
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, results)
    if int(os.environ["RANK"]) == 0:
        Path(out_path).write_text(json.dumps({"rank0": gathered[0], "rank1": gathered[1]}, indent=1))
    # The group was created by Accelerate for the first (DDP) Trainer, not by zeroshard, so no
    # atexit handler frees it: a script that leaves it to interpreter shutdown aborts there about
    # one time in three on a loaded machine ([Note: process-group lifetime] in
    # zeroshard/launch/distributed.py). The Trainers' cycles go first so nothing still holds it.
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
