"""resolve_config: the three key classes, "did you mean", "auto", defaults and the batch triangle."""

import json
import warnings

import pytest

from zeroshard.config.schema import ConfigError, canonical_dtype_name
from zeroshard.resolve import resolve_config


def test_empty_config_takes_deepspeed_defaults():
    cfg = resolve_config({})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (1, 1, 1)
    assert cfg.gradient_clipping == 1.0
    assert cfg.steps_per_print == 10
    assert cfg.fp16.enabled is False
    assert (cfg.fp16.loss_scale, cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window) == (0, 16, 1000)
    assert (cfg.fp16.hysteresis, cfg.fp16.min_loss_scale, cfg.fp16.consecutive_hysteresis) == (2, 1, False)
    assert cfg.bf16.enabled is False and cfg.bf16.check_grad_overflow is True
    assert cfg.bf16.bf16_master_weights_and_grads is False
    assert cfg.bf16.bf16_master_weights_and_gradients is False
    assert cfg.bf16.bf16_optimizer_states is False
    assert cfg.torch_autocast.enabled is False and cfg.torch_autocast.dtype == "bfloat16"
    assert cfg.torch_autocast.lower_precision_safe_modules is None
    assert cfg.data_types.grad_accum_dtype is None and cfg.communication_data_type is None
    zero = cfg.zero_optimization
    assert zero.stage == 0
    assert zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.stage3_max_reuse_distance == 0  # DeepSpeed: 1e9 (zeroshard frees after each use: sections.py)
    assert zero.overlap_comm is False and zero.contiguous_gradients is True and zero.reduce_scatter is True
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.seed is None
    assert cfg.zeroshard.unit_module_classes is None and cfg.zeroshard.unit_min_params == 0
    assert cfg.no_effect_keys == []
    assert "gradient_clipping" in cfg.defaults_applied
    assert "fp16.enabled" in cfg.defaults_applied
    # A switched-off section lists only its switch, not its inner defaults.
    assert "fp16.loss_scale" not in cfg.defaults_applied
    assert "train_micro_batch_size_per_gpu" in cfg.defaults_applied


def test_overlap_comm_default_depends_on_stage_as_in_deepspeed():
    assert resolve_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert resolve_config({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False


def test_values_as_written_and_from_file(tmp_path):
    raw = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
        "seed": 7,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    for source in (raw, path, str(path)):
        cfg = resolve_config(source, world_size=4)
        assert cfg.train_batch_size == 32
        assert cfg.derived_keys == ["train_batch_size"]
        assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params["lr"] == 3e-4
        assert cfg.scheduler.type == "WarmupCosineLR"
        assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
        assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
        assert cfg.seed == 7 and cfg.world_size == 4
        assert cfg.raw == raw
        assert "zero_optimization.stage" not in cfg.defaults_applied
        assert "zero_optimization.allgather_bucket_size" in cfg.defaults_applied


# ---------------------------------------------------------------------------------------------
# The batch-size triangle: train = micro * accum * world
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, world, expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4,
         (32, 4, 2)),
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
        ({"gradient_accumulation_steps": 5}, 2, (10, 1, 5)),
        ({}, 8, (8, 1, 1)),
    ],
)
def test_batch_triangle_derives_the_missing_side(given, world, expected):
    cfg = resolve_config(given, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_batch_triangle_inconsistent_shows_the_numbers():
    raw = {"train_batch_size": 96, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}
    with pytest.raises(ConfigError) as info:
        resolve_config(raw, world_size=4)
    assert str(info.value) == (
        "train_batch_size=96 != train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps (3) "
        "* world_size (4) = 48. Fix one of them, or drop one key and it will be derived."
    )
    # The same three numbers agree at world size 8.
    assert resolve_config(raw, world_size=8).train_batch_size == 96


@pytest.mark.parametrize(
    "given, pattern",
    [
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
         r"train_batch_size=30 is not divisible by train_micro_batch_size_per_gpu \(4\) \* world_size \(2\) = 8"),
        ({"train_batch_size": 30, "gradient_accumulation_steps": 4},
         r"train_batch_size=30 is not divisible by gradient_accumulation_steps \(4\) \* world_size \(2\) = 8"),
        ({"train_batch_size": 31}, r"train_batch_size=31 is not divisible by world_size \(2\)"),
    ],
)
def test_batch_triangle_indivisible(given, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve_config(given, world_size=2)


def test_batch_sizes_must_be_positive():
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu=0: Input should be greater than"):
        resolve_config({"train_micro_batch_size_per_gpu": 0})


def test_world_size_must_be_positive():
    with pytest.raises(ConfigError, match=r"world_size=0"):
        resolve_config({}, world_size=0)


# ---------------------------------------------------------------------------------------------
# Unknown keys, at every level
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, pattern",
    [
        ({"gradient_cliping": 1.0}, r"^gradient_cliping: unknown key\. Did you mean 'gradient_clipping'\?$"),
        ({"zero_optimization": {"stgae": 2}}, r"^zero_optimization\.stgae: unknown key\. Did you mean 'stage'\?$"),
        ({"fp16": {"enabeld": True}}, r"^fp16\.enabeld: unknown key\. Did you mean 'enabled'\?$"),
        ({"bf16": {"bf16_master_weights_and_gradients": True}},
         r"^bf16\.bf16_master_weights_and_gradients: unknown key\. Did you mean 'bf16_master_weights_and_grads'\?"),
        ({"torch_autocast": {"lower_precision_safe_module": []}},
         r"Did you mean 'lower_precision_safe_modules'\?"),
        ({"data_types": {"grad_acc_dtype": "fp32"}}, r"^data_types\.grad_acc_dtype: unknown key\. Did you mean"),
        ({"zeroshard": {"unit_min_param": 3}},
         r"^zeroshard\.unit_min_param: unknown key\. Did you mean 'unit_min_params'"),
        ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
         r"^optimizer\.params\.weight_decy: unknown parameter of AdamW\. Did you mean 'weight_decay'\?$"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
         r"^scheduler\.params\.warmup_num_step: unknown parameter of WarmupLR\. Did you mean 'warmup_num_steps'"),
        ({"optimizer": {"type": "Adamm"}},
         r'^optimizer\.type="Adamm": unknown optimizer type\. Did you mean \'Adam\'\?$'),
        ({"scheduler": {"type": "WarmupCosine"}}, r"Did you mean 'WarmupCosineLR'\?"),
        ({"xyzzy": 1}, r"^xyzzy: unknown key\. Known keys here: "),
    ],
)
def test_unknown_keys_get_did_you_mean(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve_config(raw)


def test_every_problem_is_reported_in_one_raise():
    with pytest.raises(ConfigError) as info:
        resolve_config({"zero_optimization": {"stgae": 2}, "fp16": {"loss_scale": -1}, "train_batch_size": "auto"})
    assert str(info.value).startswith("invalid config:\n")
    assert len(info.value.problems) == 3
    assert "zero_optimization.stgae: unknown key. Did you mean 'stage'?" in info.value.problems
    assert "fp16.loss_scale=-1: Input should be greater than or equal to 0." in info.value.problems


# ---------------------------------------------------------------------------------------------
# "auto"
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, path",
    [
        ({"train_batch_size": "auto"}, "train_batch_size"),
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, "zero_optimization.reduce_bucket_size"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": ["auto", 0.9]}}}, "optimizer.params.betas.0"),
        ({"gradient_clipping": "AUTO"}, "gradient_clipping"),
    ],
)
def test_auto_must_be_resolved_before_initialize(raw, path):
    with pytest.raises(ConfigError) as info:
        resolve_config(raw)
    assert info.value.problems == [
        f'{path}="auto": "auto" is a placeholder that the Hugging Face Trainer and Accelerate fill in before they '
        "call initialize; zeroshard does not. Pass this config to the Trainer (TrainingArguments(deepspeed=...)) or "
        "`accelerate launch` (with the `deepspeed` alias: `zeroshard install-deepspeed-alias`), or write a concrete "
        "value."
    ]


def test_many_autos_explain_once():
    with pytest.raises(ConfigError) as info:
        resolve_config({"train_batch_size": "auto", "gradient_clipping": "auto"})
    first, second = info.value.problems
    assert first.startswith('train_batch_size="auto": "auto" is a placeholder that the Hugging Face Trainer')
    assert second == 'gradient_clipping="auto": the same placeholder (see the first "auto" above).'


# ---------------------------------------------------------------------------------------------
# Recognised but not supported / accepted with no effect
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, path",
    [
        ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
        ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size"),
        ({"amp": {"enabled": True}}, "amp"),
        ({"prescale_gradients": True}, "prescale_gradients"),
        ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
        ({"pipeline": {"stages": 2}}, "pipeline"),
        ({"fp16": {"auto_cast": True}}, "fp16.auto_cast"),
        ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ],
)
def test_not_supported_keys_are_errors(raw, path):
    with pytest.raises(ConfigError, match=rf"^{path}=.*: recognised DeepSpeed key, not supported by zeroshard\. "):
        resolve_config(raw)


@pytest.mark.parametrize(
    "raw, pattern",
    [
        ({"optimizer": {"type": "Lamb"}}, r'^optimizer\.type="Lamb": recognised DeepSpeed optimizer, not supported'),
        ({"scheduler": {"type": "LRRangeTest"}},
         r'^scheduler\.type="LRRangeTest": recognised DeepSpeed scheduler, not supported'),
    ],
)
def test_not_supported_optimizer_and_scheduler(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve_config(raw)


def test_inert_values_of_unsupported_keys_and_no_effect_knobs_are_accepted_and_listed():
    raw = {
        "memory_breakdown": False,
        "prescale_gradients": False,
        "fp16": {"enabled": False, "auto_cast": False},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "none", "buffer_count": 4},
            "overlap_comm": True,
            "use_multi_rank_bucket_allreduce": True,
            "sub_group_size": 1e9,
        },
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every value above leaves behaviour as it is: no warning
        cfg = resolve_config(raw)
    assert sorted(cfg.no_effect_keys) == sorted(
        [
            "memory_breakdown",
            "prescale_gradients",
            "fp16.auto_cast",
            "zero_optimization.offload_optimizer.buffer_count",
            "zero_optimization.overlap_comm",
            "zero_optimization.use_multi_rank_bucket_allreduce",
            "zero_optimization.sub_group_size",
        ]
    )


def test_no_effect_knob_set_to_something_warns_once():
    raw = {"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 12345}}
    key = r"zero_optimization\.stage3_module_granularity_threshold"
    with pytest.warns(UserWarning, match=r"change nothing here: " + key):
        cfg = resolve_config(raw)
    assert cfg.no_effect_keys == ["zero_optimization.stage3_module_granularity_threshold"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_config(raw)  # already warned in this process



@pytest.mark.parametrize(
    "key", ["stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"]
)
def test_the_save_time_gather_flag_is_not_reported_as_without_effect(key):
    """The Hugging Face Trainer reads it (engine.zero_gather_16bit_weights_on_model_save()) to
    choose between one gathered weights file and a checkpoint, so "changes nothing" would be false."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = resolve_config({"zero_optimization": {"stage": 3, key: True}})
    assert cfg.no_effect_keys == []

# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, pattern",
    [
        ({"zero_optimization": {"stage": 4}},
         r"^zero_optimization\.stage=4: Input should be less than or equal to 3\.$"),
        ({"fp16": {"enabled": True, "hysteresis": 0}},
         r"^fp16\.hysteresis=0: must be at least 1 with dynamic loss scaling \(fp16 enabled, loss_scale 0\)\."),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}},
         r"^fp16\.min_loss_scale=0: must be greater than 0 with dynamic loss scaling"),
        ({"gradient_clipping": -1}, r"^gradient_clipping=-1: Input should be greater than or equal to 0\.$"),
        ({"fp16": True}, r"^fp16=true: Input should be a valid dictionary"),
        ({"data_types": {"grad_accum_dtype": "fp64"}}, r'^data_types\.grad_accum_dtype="fp64": unknown dtype'),
        ({"communication_data_type": "int8"}, r'^communication_data_type="int8": unknown dtype'),
        ({"torch_autocast": {"dtype": "float64"}}, r'^torch_autocast\.dtype="float64": unknown dtype'),
        ({"optimizer": {"params": {"lr": 1}}}, r"^optimizer\.type: required key is missing\.$"),
    ],
)
def test_bad_values_name_the_key(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve_config(raw)


def test_optimizer_type_is_case_insensitive_and_kept_as_written():
    assert resolve_config({"optimizer": {"type": "adamw"}}).optimizer.type == "adamw"
    assert resolve_config({"optimizer": {"type": "Muon", "params": {"momentum": 0.9}}}).optimizer.params == {
        "momentum": 0.9
    }


@pytest.mark.parametrize(
    "name, canonical",
    [("fp32", "fp32"), ("float32", "fp32"), ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"),
     ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), ("BF16", "bf16")],
)
def test_dtype_spellings(name, canonical):
    assert canonical_dtype_name(name) == canonical
    assert resolve_config({"data_types": {"grad_accum_dtype": name}}).data_types.grad_accum_dtype == name


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot be read"):
        resolve_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ConfigError, match=r"is not valid JSON: .* line 1"):
        resolve_config(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must hold a JSON object"):
        resolve_config(arr)


def test_preemption_section_defaults_names_and_refusals():
    from zeroshard.resolve import resolve_config

    base = {"train_micro_batch_size_per_gpu": 1}
    section = resolve_config(base, world_size=1).preemption
    assert (section.enabled, section.signals, section.exit_code, section.resume) == (
        False, ["SIGTERM", "SIGUSR1", "SIGUSR2"], 143, False)
    ok = resolve_config({**base, "preemption": {"enabled": True, "signals": ["usr1", "SIGHUP"], "save_dir": "c"}},
                        world_size=1)
    assert ok.preemption.signals == ["usr1", "SIGHUP"]
    with pytest.raises(ConfigError) as error:
        resolve_config({**base, "preemption": {"signals": ["SIGKILL", "SIGNOPE"], "resume": True, "exit_code": 300,
                                               "tag": "../elsewhere"}}, world_size=1)
    text = str(error.value)
    for expected in ("preemption.signals.0=\"SIGKILL\": SIGKILL cannot be handled",
                     "preemption.signals.1=\"SIGNOPE\": no signal called",
                     "preemption.resume=true: resume from where? Set preemption.save_dir",
                     "preemption.exit_code=300",
                     'preemption.tag="../elsewhere": must be a plain directory name'):
        assert expected in text, text
