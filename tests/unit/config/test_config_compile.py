"""The `compile` section: DeepSpeed 0.19.8's keys, `autoep_non_moe` honoured, DeepCompile refused
by name unless a key is at the value that asks for nothing (zeroshard/config/compile.py)."""

import pytest

from zeroshard.config.compile import DEEPCOMPILE_KEYS, CompileConfig
from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config

# DeepSpeed 0.19.8, deepspeed/compile/config.py: CompileConfig's fields and defaults, copied from
# the sdist by hand (the independent list this section must cover, key by key).
DEEPSPEED_0_19_8 = {
    "deepcompile": False, "autoep_non_moe": False, "free_activation": False,
    "free_activation_threshold": 10 * 1024 * 1024, "offload_activation": False,
    "offload_activation_pin_memory": True, "offload_opt_states": False, "double_buffer": True,
    "symmetric_memory": False, "debug_log": False, "offload_parameters": False, "sync_before_reduce": False,
    "sync_after_reduce": False, "sync_before_allgather": False, "sync_after_allgather": False,
    "keep_int_input_tensors": True, "keep_all_input_tensors": False, "passes": None,
}


def _asking(default):
    """A value of the key's type that asks for something (not DeepSpeed's default)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return 1024
    return ["z3"]


def test_every_deepspeed_key_is_recognised():
    assert sorted(CompileConfig.json_keys()) == sorted(DEEPSPEED_0_19_8)
    assert {k: DEEPSPEED_0_19_8[k] for k in DEEPCOMPILE_KEYS} == DEEPCOMPILE_KEYS


def test_absent_section_compiles_every_unit():
    cfg = resolve_config({})
    assert cfg.compile.autoep_non_moe is False
    assert not any(path.startswith("compile") for path in cfg.defaults_applied)


def test_autoep_non_moe_is_honoured():
    assert resolve_config({"compile": {"autoep_non_moe": True}}).compile.autoep_non_moe is True


def test_deepspeed_defaults_are_accepted_with_no_effect():
    cfg = resolve_config({"compile": dict(DEEPSPEED_0_19_8)})
    listed = {p.removeprefix("compile.") for p in cfg.no_effect_keys}
    assert listed == set(DEEPSPEED_0_19_8) - {"autoep_non_moe"}


def test_deepcompile_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as info:
        resolve_config({"compile": {"deepcompile": True}})
    assert info.value.problems == [
        "compile.deepcompile=true: recognised DeepSpeed key, not supported by zeroshard. DeepCompile (DeepSpeed's "
        "compiler that rewrites ZeRO's gathers and reductions into the graph) is not implemented; engine.compile() "
        "compiles each unit with torch.compile (docs/compile.md). Set false or remove it."
    ]


@pytest.mark.parametrize("key", [k for k in DEEPSPEED_0_19_8 if k not in ("deepcompile", "autoep_non_moe")])
def test_each_deepcompile_key_asking_for_something_is_refused_by_name(key):
    value = _asking(DEEPSPEED_0_19_8[key])
    with pytest.raises(ConfigError) as info:
        resolve_config({"compile": {key: value}})
    (problem,) = info.value.problems
    assert problem.startswith(f"compile.{key}=")
    assert "recognised DeepSpeed key, not supported by zeroshard." in problem
    assert "DeepCompile" in problem and problem.endswith("Remove it.")


def test_every_problem_in_one_error_and_unknown_keys_get_a_hint():
    with pytest.raises(ConfigError) as info:
        resolve_config({"compile": {"passes": ["z1"], "double_buffer": False, "autoep_non_mo": True}})
    problems = info.value.problems
    assert [p.split("=")[0].split(":")[0] for p in problems] == [
        "compile.passes", "compile.double_buffer", "compile.autoep_non_mo"]
    assert "Did you mean 'autoep_non_moe'?" in problems[2]
