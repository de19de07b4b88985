"""The config as the Hugging Face integrations write it (issue 24, item 3).

The dicts below are what transformers 5.23.0, Accelerate 1.15.0 and TRL 1.16.0 hand to
`deepspeed.initialize`, captured from the real packages (with the `deepspeed` alias installed):
- TRAINER_STAGE3: `TrainingArguments(deepspeed=<the HF docs' all-"auto" ZeRO-3 config>,
  per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3)` then
  `hf_deepspeed_config.trainer_config_finalize(args, <Llama, hidden 64>, num_training_steps=10)`;
  Accelerate's plugin sets `steps_per_print` to `float("inf")`
  (accelerate/utils/dataclasses.py:1326).
- ACCELERATE_PLUGIN: `DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu",
  offload_param_device="cpu", gradient_accumulation_steps=1, gradient_clipping=1.0)` with the
  batch sizes that `Accelerator.prepare` fills in.
- TRL_REFERENCE: trl/models/utils.py:265-271 (`prepare_deepspeed` for a reference model) adds
  dotted top-level keys, one of them a fractional float.

DeepSpeed 0.19.8's own `DeepSpeedConfig` accepts each of them (checked in /tmp/dsvenv:
`steps_per_print` inf is kept as inf and never prints; the dotted top-level keys are ignored,
`zero_config.reduce_bucket_size` stays 5e8), and so must zeroshard. What a person writes stays
strict: 2.5 where an integer belongs is an error, as is "auto" left unfilled.
"""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.config.error import ConfigError
from zeroshard.resolve import resolve_config

TRAINER_STAGE3 = {
    "fp16": {"enabled": False}, "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1, "total_num_steps": 10}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 4096,
                          "stage3_prefetch_bucket_size": 3686, "stage3_param_persistence_threshold": 640,
                          "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": math.inf,
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
}

ACCELERATE_PLUGIN = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "nvme_path": None},
                          "offload_param": {"device": "cpu", "nvme_path": None},
                          "stage3_gather_16bit_weights_on_model_save": False},
    "gradient_clipping": 1.0, "steps_per_print": math.inf,
}

TRL_DOTTED = {
    "zero_optimization.reduce_bucket_size": 64 * 64,
    "zero_optimization.stage3_param_persistence_threshold": 10 * 64,
    "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64 * 64,  # 3686.4: DeepSpeed never reads it
}


def _resolve(raw: dict, world_size: int = 1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_config(raw, world_size=world_size)


@pytest.mark.parametrize("raw, world_size", [(TRAINER_STAGE3, 1), (ACCELERATE_PLUGIN, 2)],
                         ids=["trainer", "accelerate"])
def test_integration_configs_resolve(raw: dict, world_size: int) -> None:
    cfg = _resolve(raw, world_size)
    assert cfg.steps_per_print == math.inf
    assert cfg.zero_optimization.stage == 3
    assert cfg.train_batch_size == 4


def test_trl_dotted_top_level_keys_have_no_effect_as_in_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.config import schema

    monkeypatch.setattr(schema, "_warned_no_effect", set())  # each key warns once per process
    raw = {**{k: v for k, v in TRAINER_STAGE3.items() if k not in ("optimizer", "scheduler")}, **TRL_DOTTED}
    with pytest.warns(UserWarning, match=r'"zero_optimization.stage3_prefetch_bucket_size" \(a top-level key'):
        cfg = resolve_config(raw, world_size=1)
    # DeepSpeed keeps the values written inside zero_optimization; so does zeroshard.
    assert cfg.zero_optimization.reduce_bucket_size == 4096
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 3686
    assert sum("a top-level key" in k for k in cfg.no_effect_keys) == 3


def test_a_dotted_key_that_names_nothing_is_still_unknown() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization.reduce_bucket_sise: unknown key"):
        _resolve({"zero_optimization.reduce_bucket_sise": 1})


@pytest.mark.parametrize(
    "value, message",
    [
        (2.5, "steps_per_print=2.5: must be an integer, or Infinity to never print (what Accelerate writes). "
              "Write a whole number."),
        (-math.inf, "steps_per_print=-Infinity: must be an integer, or Infinity to never print"),
        (math.nan, "steps_per_print=NaN: must be an integer, or Infinity to never print"),
        (0, "steps_per_print=0: Input should be greater than or equal to 1."),
        (True, "steps_per_print=true: must be an integer. Write a number, not true or false."),
        ("10", 'steps_per_print="10": must be an integer. Write 10 without quotes.'),
    ],
)
def test_what_a_person_writes_stays_strict(value, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _resolve({"steps_per_print": value})
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(message), info.value.problems


def test_an_integral_float_is_an_integer() -> None:
    assert _resolve({"steps_per_print": 1e3}).steps_per_print == 1000


def test_auto_left_unfilled_says_who_fills_it_in() -> None:
    raw = {**TRAINER_STAGE3, "train_micro_batch_size_per_gpu": "auto"}
    with pytest.raises(ConfigError) as info:
        _resolve(raw)
    (problem,) = info.value.problems
    assert problem.startswith('train_micro_batch_size_per_gpu="auto": "auto" is a placeholder that the Hugging Face '
                              "Trainer and Accelerate fill in before they call initialize")
    assert "TrainingArguments(deepspeed=...)" in problem and "zeroshard install-deepspeed-alias" in problem


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).pow(2).mean()


@pytest.mark.parametrize("steps_per_print, lines", [(math.inf, 0), (2, 2)])
def test_inf_never_prints(steps_per_print: float, lines: int, caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed logs "step N: lr ..." at (global_steps + 1) % steps_per_print == 0: never for
    inf; every 2nd of 4 steps for 2 (the case that shows the line is counted)."""
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=_Model(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": steps_per_print,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "csv_monitor": {"enabled": False},
    })
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        for _ in range(4):
            engine.backward(engine(torch.randn(2, 4)))
            engine.step()
    assert sum("lr [" in r.getMessage() or ": lr " in r.getMessage() for r in caplog.records) == lines
