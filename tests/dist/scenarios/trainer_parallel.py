"""AutoEP and ALST through the Hugging Face Trainer on zeroshard (tests/dist/hf/test_trainer_parallel.py).

Both are switched on the way a Trainer user switches them, with the Trainer's own loop
(`TrainingArguments(deepspeed=cfg_dict, ...)`, 2 ranks, `use_cpu=True`):

- AutoEP: an `expert_parallel` section in the DeepSpeed config (autoep_size 2) and a tiny
  Qwen3-MoE built from a config; `initialize` swaps its MoE blocks for expert-parallel layers.
  Reference: the same Trainer run without DeepSpeed (DDP) on the unswapped model.
- ALST: `TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed",
  sp_size=2, ...))`, which accelerate turns into `UlyssesSPAttentionHF.register_with_transformers`
  + `deepspeed.initialize(mpu=...)` + `UlyssesSPDataLoaderAdapter` (accelerator.py
  `_prepare_deepspeed`), and transformers into `deepspeed_ulysses_dl_adapter` and
  `deepspeed_sp_compute_loss` (trainer.py). With 2 ranks and SP 2 there is one data-parallel
  replica: each step trains on `per_device_train_batch_size` samples, each rank holding half of
  every sequence. Reference: DDP on 2 ranks with half that per-device batch, the same samples
  per step (every label is a token, so the token-weighted SP loss equals DDP's mean of means).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset

from tests.dist.scenarios.hf_common import reset_trainer_state, use_alias

STEPS = 3


class TokenDataset(Dataset):
    def __init__(self, vocab: int, n: int = 24, length: int = 16) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(stage: int, **sections: Any) -> dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    config.update(sections)
    return config


_TASK_ENV: dict[str, str] = {}


def _reset() -> None:
    from zeroshard.sequence.ulysses_sp import UlyssesSPAttentionHF

    reset_trainer_state(_TASK_ENV)
    UlyssesSPAttentionHF.unregister_from_transformers()  # one Trainer with SP after another, in one process


def train(workdir: str, name: str, model, dataset, deepspeed: dict | None, batch: int, **extra: Any):
    from transformers import Trainer, TrainingArguments

    _reset()
    args = TrainingArguments(
        output_dir=os.path.join(workdir, name), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        max_steps=STEPS, learning_rate=1e-2, weight_decay=0.0, logging_steps=1, use_cpu=True, deepspeed=deepspeed,
        report_to=[], seed=0, save_strategy="no", dataloader_drop_last=True, **extra,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    losses["wrapper"] = type(trainer.model_wrapped).__name__
    return trainer, losses


def autoep_runs(workdir: str) -> dict[str, Any]:
    from tests.dist.scenarios.autoep import VOCAB, build_hf

    data = TokenDataset(VOCAB)
    out = {"ddp": train(workdir, "ep_ddp", build_hf("qwen3_moe"), data, None, 2, ddp_find_unused_parameters=True)[1]}
    for stage in (2, 3):
        config = ds_config(stage, expert_parallel={"enabled": True, "autoep_size": 2})
        trainer, out[f"stage{stage}"] = train(workdir, f"ep_s{stage}", build_hf("qwen3_moe"), data, config, 2)
        engine = trainer.model_wrapped
        out[f"stage{stage}_swapped"] = sorted({type(m).__name__ for m in engine.module.modules()
                                               if "AutoEP" in type(m).__name__ or "MoE" in type(m).__name__})
    return out


def alst_runs(workdir: str) -> dict[str, Any]:
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    from tests.dist.scenarios.sequence_hf import VOCAB, tiny_llama

    data = TokenDataset(VOCAB)
    out = {"ddp": train(workdir, "sp_ddp", tiny_llama("sdpa"), data, None, 1)[1]}
    for stage in (3,):
        pc = ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
        trainer, out[f"stage{stage}"] = train(workdir, f"sp_s{stage}", tiny_llama("sdpa"), data, ds_config(stage), 2,
                                              parallelism_config=pc)
        engine = trainer.model_wrapped
        out[f"stage{stage}_sp"] = engine.layout.sequence.size if engine.layout.sequence is not None else 1
    return out


def trainer_parallel(alias_dir: str, workdir: str, groups: list[str]) -> dict[str, Any]:
    use_alias(alias_dir)
    _TASK_ENV.clear()
    _TASK_ENV.update(os.environ)
    runs = {"autoep": autoep_runs, "alst": alst_runs}
    out = {name: runs[name](workdir) for name in groups}
    _reset()
    return out
