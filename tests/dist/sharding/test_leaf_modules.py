"""Stage-3 leaf modules (zeroshard.utils.set_z3_leaf_modules), 2 ranks, stages 0-3.

An MoE block whose experts run data-dependently (rank r routes all its rows to expert r) and
whose experts would otherwise be units of their own: marked as a leaf, it is one unit, so every
rank gathers every expert at the block's forward and backward and the ranks' collectives match.
The reduced gradient equals the one-process gradient of the mean of the ranks' losses (fp32;
tolerance 1e-6 relative: the sum over ranks is taken in another order)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.sharding.units import plan_units
from zeroshard.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def results(dist_pool):
    pool = dist_pool(2)
    return {stage: pool.run("tests.dist.scenarios.leaf_modules:leaf_moe", stage, timeout=300)[0] for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_leaf_moe_gathers_as_one_and_matches_the_reference(results, stage) -> None:
    out = results[stage]
    assert out["marked"] == ["MoEBlock"] and out["leaf"]
    assert out["units"] == ["<root>", "moe"], "the leaf is one unit; no expert is a unit"
    for name, grad in out["grads"].items():
        torch.testing.assert_close(grad, out["expected"][name], rtol=1e-6, atol=1e-7, msg=name)
    # Experts 0 and 1 got rows (one rank each), 2 and 3 none: their gradient is exactly zero.
    assert torch.count_nonzero(out["grads"]["moe.experts.0.fc.weight"]) > 0
    assert torch.count_nonzero(out["grads"]["moe.experts.3.fc.weight"]) == 0


def test_plan_units_never_splits_a_leaf() -> None:
    from tests.dist.scenarios.leaf_modules import Expert, MoEBlock, Net

    model = Net()
    assert [s.name for s in plan_units(model, ["Expert"])] == ["<root>"] + [f"moe.experts.{i}" for i in range(4)]
    assert set_z3_leaf_modules(model, ["MoEBlock"]) == [model.moe]
    assert get_z3_leaf_modules(model) == [model.moe]
    assert [s.name for s in plan_units(model, ["Expert"])] == ["<root>", "moe"]
    # The automatic rule would pick the experts list; a leaf above it wins there too.
    assert [s.name for s in plan_units(model)] == ["<root>", "moe"]
    unset_z3_leaf_modules(model, [MoEBlock])
    assert not z3_leaf_module(model.moe)
    assert [s.name for s in plan_units(model)] == ["<root>"] + [f"moe.experts.{i}" for i in range(4)]
    with pytest.raises(ValueError, match="no module of"):
        set_z3_leaf_modules(model, [torch.nn.Conv2d])
    assert set_z3_leaf_modules(model, [Expert], raise_if_not_found=False) == list(model.moe.experts)


@pytest.mark.parametrize(
    "leaf_module",
    [{"classes": ["MoEBlock"]}, {"classes": ["tests.dist.scenarios.leaf_modules.MoEBlock"]},
     {"classes": [], "names": ["moe"]}, {"classes": [], "name_suffixes": ["oe"]}],
)
def test_the_leaf_module_config_marks_leaves_at_initialize(leaf_module) -> None:
    import zeroshard
    from tests.dist.scenarios.leaf_modules import Net

    model = Net()
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), dist_init_required=False,
        config={"train_micro_batch_size_per_gpu": 1, "zeroshard": {"unit_module_classes": ["Expert"]},
                "zero_optimization": {"stage": 3, "leaf_module": leaf_module}},
    )
    assert z3_leaf_module(model.moe)
    assert [u.name for u in engine.units] == ["<root>", "moe"]


def test_the_leaf_module_config_defaults_to_deepspeeds_classes_and_checks_names() -> None:
    import zeroshard
    from tests.dist.scenarios.leaf_modules import Net
    from zeroshard.resolve import resolve_config

    classes = resolve_config({}).zero_optimization.leaf_module.classes
    assert classes == ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                       "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                       "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]
    model = Net()
    with pytest.raises(ValueError, match=r"no module named \['mo'\]"):
        zeroshard.initialize(model=model, model_parameters=model.parameters(), dist_init_required=False,
                             config={"zero_optimization": {"stage": 3, "leaf_module": {"names": ["mo"]}}})
    with pytest.raises(zeroshard.DeepSpeedConfigError, match="must be a list"):
        resolve_config({"zero_optimization": {"leaf_module": {"classes": "MoEBlock"}}})
