"""`zeroshard.zero.Init` reads the config the Hugging Face integration hands it while the model is
built: "auto" values the Trainer fills in only later are left out (zeroshard/zero/init_config.py),
as DeepSpeed's Init falls back to defaults for them; everything else is still checked."""

from __future__ import annotations

import json

import pytest

from zeroshard.config.error import DeepSpeedConfigError
from zeroshard.zero import Init
from zeroshard.zero.init_config import without_placeholders

# What TrainingArguments(deepspeed=...) leaves in the config when from_pretrained runs
# (transformers 5.23: trainer_config_process has filled the batch sizes, not the buckets).
TRAINER_CONFIG = {
    "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0, "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}


def test_placeholders_are_left_out_everywhere() -> None:
    out = without_placeholders(TRAINER_CONFIG)
    assert out["zero_optimization"] == {"stage": 3}
    assert out["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}
    assert TRAINER_CONFIG["zero_optimization"]["reduce_bucket_size"] == "auto", "the caller's dict is not changed"


def test_init_accepts_the_trainers_config(tmp_path) -> None:
    init = Init(config_dict_or_path=TRAINER_CONFIG)
    assert init.stage == 3 and init.active
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(TRAINER_CONFIG))
    assert Init(config_dict_or_path=str(path)).stage == 3


def test_init_still_checks_what_is_written() -> None:
    bad = {**TRAINER_CONFIG, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 2.5}}
    with pytest.raises(DeepSpeedConfigError, match="stage3_prefetch_bucket_size=2.5"):
        Init(config_dict_or_path=bad)
