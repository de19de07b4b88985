"""resolve_precision_plan: every row of docs/design.md section 2's table and every rule under it."""

import pytest
import torch
from torch import nn

from zeroshard.config.schema import ConfigError, _check_config
from zeroshard.precision.plan import assign_param_groups, resolve_precision_plan

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def checked_key_by_key(raw):
    """The config before the resolve pass (`resolve_config` would raise the precision
    problems these tests hand to `resolve_precision_plan` themselves)."""
    cfg, problems, _ = _check_config(raw)
    assert problems == [], problems
    return cfg


def plan_for(raw):
    return resolve_precision_plan(checked_key_by_key(raw))


def roles(group):
    return (
        group.param_dtype, group.grad_dtype, group.grad_accum_dtype, group.reduce_dtype,
        group.gather_dtype, group.master_dtype, group.optimizer_state_dtype, group.master_is_param,
    )


def test_fp32_column():
    plan = plan_for({})
    assert plan.mode == "fp32" and plan.autocast_dtype is None and list(plan.groups) == ["all"]
    group = plan.groups["all"]
    assert roles(group) == (F32, F32, F32, F32, F32, F32, F32, True)
    assert group.compute == "fp32"
    # A non-finite gradient skips the step in fp32 too (zeroshard.skip_nonfinite_steps, default true).
    assert plan.loss_scale.kind == "none" and plan.check_grad_overflow is True


def test_bf16_column_defaults_to_fp32_accumulation_and_says_so():
    plan = plan_for({"bf16": {"enabled": True}})
    group = plan.groups["all"]
    assert plan.mode == "bf16" and group.compute == "bf16"
    assert roles(group) == (BF16, BF16, F32, F32, BF16, F32, F32, False)
    assert plan.loss_scale.kind == "none"
    assert plan.check_grad_overflow is True  # DeepSpeed 0.19's documented default
    assert any("DeepSpeed's default is bf16" in note for note in plan.notes)


def test_bf16_accumulation_restores_deepspeed_behaviour():
    group = plan_for({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}).groups["all"]
    assert (group.grad_accum_dtype, group.reduce_dtype) == (BF16, BF16)


def test_bf16_communication_data_type_halves_the_wire():
    group = plan_for({"bf16": {"enabled": True}, "communication_data_type": "bf16"}).groups["all"]
    assert (group.grad_accum_dtype, group.reduce_dtype) == (F32, BF16)


def test_bf16_check_grad_overflow_follows_config():
    assert plan_for({"bf16": {"enabled": True, "check_grad_overflow": False}}).check_grad_overflow is False


@pytest.mark.parametrize(
    "config, keys",
    [
        ({}, "zeroshard.skip_nonfinite_steps"),
        ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "zeroshard.skip_nonfinite_steps"),
        ({"bf16": {"enabled": True}}, "bf16.check_grad_overflow, zeroshard.skip_nonfinite_steps"),
    ],
)
def test_skip_nonfinite_steps_turns_the_check_off_and_names_its_key(config, keys):
    """Modes without loss scaling skip non-finite steps unless zeroshard.skip_nonfinite_steps
    is false (DeepSpeed's behaviour); the plan names the key(s) that control it (explain prints them)."""
    assert plan_for(config).check_grad_overflow is True
    assert plan_for(config).overflow_keys == keys
    off = {**config, "zeroshard": {"skip_nonfinite_steps": False}}
    assert plan_for(off).check_grad_overflow is False


def test_fp16_always_checks_overflow():
    """fp16's loss scale needs the check: the switch does not turn it off."""
    plan = plan_for({"fp16": {"enabled": True}, "zeroshard": {"skip_nonfinite_steps": False}})
    assert plan.check_grad_overflow is True and plan.overflow_keys == ""


def test_bf16_low_precision_master_weights_and_optimizer_states():
    plan = plan_for({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    group = plan.groups["all"]
    assert (group.master_dtype, group.optimizer_state_dtype, group.grad_accum_dtype) == (BF16, F32, BF16)
    plan = plan_for({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}})
    group = plan.groups["all"]
    assert (group.master_dtype, group.optimizer_state_dtype) == (BF16, BF16)
    # fp32 accumulation beside bf16 masters is allowed when asked for.
    plan = plan_for({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                     "data_types": {"grad_accum_dtype": "fp32"}})
    assert plan.groups["all"].grad_accum_dtype == F32


def test_fp16_column_dynamic_loss_scale():
    plan = plan_for({"fp16": {"enabled": True}})
    group = plan.groups["all"]
    assert plan.mode == "fp16" and group.compute == "fp16"
    assert roles(group) == (F16, F16, F32, F32, F16, F32, F32, False)
    scale = plan.loss_scale
    assert (scale.kind, scale.init_scale, scale.window, scale.hysteresis, scale.min_scale) == (
        "dynamic", 65536.0, 1000, 2, 1.0)
    assert scale.consecutive_hysteresis is False
    assert plan.check_grad_overflow is True


def test_fp16_settings_and_static_scale():
    plan = plan_for({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 50,
                              "hysteresis": 3, "min_loss_scale": 0.25, "consecutive_hysteresis": True}})
    scale = plan.loss_scale
    assert (scale.kind, scale.init_scale, scale.window, scale.hysteresis, scale.min_scale) == (
        "dynamic", 4096.0, 50, 3, 0.25)
    assert scale.consecutive_hysteresis is True
    plan = plan_for({"fp16": {"enabled": True, "loss_scale": 128}})
    assert (plan.loss_scale.kind, plan.loss_scale.init_scale) == ("static", 128.0)


def test_fp16_accumulation_and_wire_options():
    group = plan_for({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}}).groups["all"]
    assert (group.grad_accum_dtype, group.reduce_dtype) == (F16, F16)
    group = plan_for({"fp16": {"enabled": True}, "communication_data_type": "fp16"}).groups["all"]
    assert (group.grad_accum_dtype, group.reduce_dtype) == (F32, F16)


@pytest.mark.parametrize("dtype_name, dtype", [("bfloat16", BF16), ("float16", F16)])
def test_torch_autocast_column(dtype_name, dtype):
    plan = plan_for({"torch_autocast": {"enabled": True, "dtype": dtype_name}})
    assert plan.mode == "torch_autocast" and plan.autocast_dtype == dtype
    assert plan.safe_module_classes == (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    safe, other = plan.groups["lower_precision_safe"], plan.groups["other"]
    assert roles(safe) == (F32, F32, F32, dtype, dtype, F32, F32, True)
    assert roles(other) == (F32, F32, F32, F32, F32, F32, F32, True)
    short = "bf16" if dtype == BF16 else "fp16"
    assert safe.compute == f"autocast({short})"
    if dtype == F16:
        assert plan.loss_scale.kind == "grad_scaler" and plan.check_grad_overflow is True
    else:
        assert plan.loss_scale.kind == "none" and plan.check_grad_overflow is True


def test_custom_lower_precision_safe_modules():
    plan = plan_for({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear",
                                                                                         "torch.nn.Embedding"]}})
    assert plan.safe_module_classes == (nn.Linear, nn.Embedding)


class _TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight  # tied: owned by an Embedding and a Linear


def test_group_assignment_in_autocast_mode():
    plan = plan_for({"torch_autocast": {"enabled": True}})
    model = _TinyLM()
    assert assign_param_groups(plan, model) == {
        "wte.weight": "other",  # tied with a non-safe owner: stays fp32
        "ln.weight": "other",
        "ln.bias": "other",
        "fc.weight": "lower_precision_safe",
        "fc.bias": "lower_precision_safe",
    }
    assert plan.group_for_module(model.fc).reduce_dtype == BF16
    assert plan.group_for_module(model.ln).reduce_dtype == F32


def test_tied_parameter_with_only_safe_owners_is_safe():
    plan = plan_for({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear",
                                                                                         "torch.nn.Embedding"]}})
    assert assign_param_groups(plan, _TinyLM())["wte.weight"] == "lower_precision_safe"


def test_group_assignment_outside_autocast_is_one_group():
    plan = plan_for({"bf16": {"enabled": True}})
    assert set(assign_param_groups(plan, _TinyLM()).values()) == {"all"}
    assert plan.group_for_module(nn.LayerNorm(4)).name == "all"


# ---------------------------------------------------------------------------------------------
# Rules: each broken rule is an error that names the key and says what to do
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, pattern",
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
         r"^bf16\.enabled and fp16\.enabled are both true: pick one precision\.$"),
        ({"torch_autocast": {"enabled": True, "dtype": "float16"}, "bf16": {"enabled": True}},
         r'^torch_autocast\.dtype="float16": with bf16\.enabled the parameters are bf16'),
        ({"torch_autocast": {"enabled": True}, "fp16": {"enabled": True}},
         r"^torch_autocast\.enabled and fp16\.enabled are both true"),
        ({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Lineer"]}},
         r'^torch_autocast\.lower_precision_safe_modules="torch\.nn\.Lineer": does not import'),
        ({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["no_such_pkg.Layer"]}},
         r'^torch_autocast\.lower_precision_safe_modules="no_such_pkg\.Layer": does not import'),
        ({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["Linear"]}},
         r'^torch_autocast\.lower_precision_safe_modules="Linear": needs a dotted class name'),
        ({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.Tensor"]}},
         r'^torch_autocast\.lower_precision_safe_modules="torch\.Tensor": is not a torch\.nn\.Module subclass'),
        ({"torch_autocast": {"enabled": True, "dtype": "float32"}},
         r'^torch_autocast\.dtype="float32": autocast to fp32 changes nothing'),
        ({"bf16": {"bf16_master_weights_and_grads": True}},
         r"^bf16\.bf16_master_weights_and_grads=true: applies only with bf16\.enabled=true"),
        ({"bf16": {"bf16_optimizer_states": True}},
         r"^bf16\.bf16_optimizer_states=true: applies only with bf16\.enabled=true"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}},
         r"^bf16\.bf16_optimizer_states=true: needs bf16\.bf16_master_weights_and_grads=true"),
    ],
)
def test_precision_rules(raw, pattern):
    cfg = checked_key_by_key(raw)
    with pytest.raises(ConfigError, match=pattern):
        resolve_precision_plan(cfg)


def test_fp32_communication_is_always_allowed():
    assert plan_for({"communication_data_type": "fp32"}).groups["all"].reduce_dtype == F32
    assert plan_for({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"},
                     "communication_data_type": "fp32"}).groups["all"].reduce_dtype == F32


def test_all_precision_problems_in_one_raise():
    cfg = checked_key_by_key({"fp16": {"enabled": True}, "bf16": {"enabled": True, "bf16_optimizer_states": True},
                              "torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["x.Y"]}})
    with pytest.raises(ConfigError) as info:
        resolve_precision_plan(cfg)
    assert len(info.value.problems) == 4


def test_plan_as_dict_is_json_ready():
    import json

    text = json.dumps(plan_for({"torch_autocast": {"enabled": True}}).as_dict())
    assert '"reduce": "bf16"' in text and '"master": "the params"' in text


# ---------------------------------------------------------------------------------------------
# Combinations DeepSpeed accepts (issue 19 item 4): bf16 with torch_autocast, and lossy choices
# ---------------------------------------------------------------------------------------------


def test_bf16_with_torch_autocast_is_bf16_params_under_autocast():
    plan = plan_for({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}})
    assert plan.mode == "bf16" and plan.autocast_dtype == BF16
    assert plan.groups["all"].as_dict() == {
        "param": "bf16", "compute": "autocast(bf16)", "grad": "bf16", "grad_accum": "fp32", "reduce": "fp32",
        "gather": "bf16", "master": "fp32", "optimizer_state": "fp32",
    }
    assert plan.lossy == []


@pytest.mark.parametrize(
    "raw, group, grad_accum, reduce",
    [
        ({"data_types": {"grad_accum_dtype": "bf16"}}, "all", "bf16", "bf16"),
        ({"data_types": {"grad_accum_dtype": "fp16"}}, "all", "fp16", "fp16"),
        ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}}, "all", "fp16", "fp16"),
        ({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}, "all", "bf16", "bf16"),
        ({"torch_autocast": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}, "other", "bf16", "bf16"),
    ],
)
def test_accumulation_narrower_than_the_gradient_is_lossy(raw, group, grad_accum, reduce):
    plan = plan_for(raw)
    role = plan.groups[group].as_dict()
    assert (role["grad_accum"], role["reduce"]) == (grad_accum, reduce)
    assert len(plan.lossy) == 1
    assert plan.lossy[0].startswith(f'data_types.grad_accum_dtype="{raw["data_types"]["grad_accum_dtype"]}": ')
    assert "(lossy;" in plan.lossy[0]


@pytest.mark.parametrize(
    "raw, reduce",
    [
        ({"communication_data_type": "bf16"}, {"all": "bf16"}),
        ({"communication_data_type": "fp16"}, {"all": "fp16"}),
        ({"bf16": {"enabled": True}, "communication_data_type": "bf16"}, {"all": "bf16"}),
        ({"bf16": {"enabled": True}, "communication_data_type": "fp16"}, {"all": "fp16"}),
        ({"fp16": {"enabled": True}, "communication_data_type": "bf16"}, {"all": "bf16"}),
        ({"torch_autocast": {"enabled": True}, "communication_data_type": "bf16"},
         {"lower_precision_safe": "bf16", "other": "bf16"}),
        ({"torch_autocast": {"enabled": True, "dtype": "float16"}, "communication_data_type": "fp16"},
         {"lower_precision_safe": "fp16", "other": "fp16"}),
    ],
)
def test_communication_narrower_than_the_accumulation_is_lossy_in_every_mode(raw, reduce):
    plan = plan_for(raw)
    assert {name: role.as_dict()["reduce"] for name, role in plan.groups.items()} == reduce
    wire = raw["communication_data_type"]
    assert len(plan.lossy) == 1 and plan.lossy[0].startswith(f'communication_data_type="{wire}"')


@pytest.mark.parametrize(
    "raw",
    [{}, {"bf16": {"enabled": True}}, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
     {"communication_data_type": "fp32"}, {"torch_autocast": {"enabled": True}},
     {"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}}],
)
def test_defaults_and_widening_choices_are_not_lossy(raw):
    assert plan_for(raw).lossy == []


def test_lossy_choices_are_warned_once_and_marked_by_explain(tmp_path, capsys, monkeypatch):
    import json

    import zeroshard.resolve.rules as resolve_module
    from zeroshard.cli import main
    from zeroshard.resolve import resolve_config

    monkeypatch.setattr(resolve_module, "_warned_lossy", set())
    raw = {"data_types": {"grad_accum_dtype": "bf16"}, "communication_data_type": "fp16"}
    with pytest.warns(UserWarning, match="lossy precision choices") as caught:
        resolve_config(raw)
    assert len(caught) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_config(raw)  # once per process
    path = tmp_path / "lossy.json"
    path.write_text(json.dumps(raw))
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("LOSSY: ") == 2 and 'data_types.grad_accum_dtype="bf16"' in out
