"""DeepSpeed 0.19's engine surface that trainers and user code read (issue 30, items 5 and 11):
attribute reads fall back to the module, `modules()`, `has_moe_layers` and the torch_autocast
accessors."""

import copy

import pytest
import torch
from torch import nn

import zeroshard as deepspeed
from zeroshard.engine.engine import Engine
from zeroshard.moe.layer import MoE


class NamedModel(nn.Module):
    """Attributes a user reads through the engine, as DeepSpeed's `engine.moe_1` tests do."""

    def __init__(self, with_moe: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.moe_1 = MoE(4, nn.Linear(4, 4), num_experts=2, k=1) if with_moe else nn.Identity()
        self.marker = "user attribute"

    def forward(self, x):
        return self.moe_1(self.linear(x))


def make_engine(model=None, **config):
    torch.manual_seed(0)
    model = model if model is not None else NamedModel()
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      dist_init_required=False, config={**base, **config})
    return engine


def test_attribute_reads_fall_back_to_the_module():
    engine = make_engine()
    assert engine.moe_1 is engine.module.moe_1
    assert engine.linear is engine.module.linear
    assert engine.marker == "user attribute"
    # The engine's own names still win over the module's (both have `forward` and `train`).
    assert engine.forward.__self__ is engine
    assert engine.train() is engine


def test_a_missing_attribute_raises_attribute_error_naming_it():
    engine = make_engine()
    with pytest.raises(AttributeError, match="'Engine' object has no attribute 'no_such_thing'"):
        engine.no_such_thing  # noqa: B018
    assert not hasattr(engine, "no_such_thing")
    assert getattr(engine, "no_such_thing", 7) == 7


def test_an_engine_without_its_module_raises_instead_of_recursing():
    # What unpickling and copy.copy see: an instance whose __dict__ is still empty.
    bare = Engine.__new__(Engine)
    with pytest.raises(AttributeError, match="has no attribute 'module'"):
        bare.module  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'linear'"):
        bare.linear  # noqa: B018
    assert copy.copy(bare).__dict__ == {}


def test_dunder_names_are_not_forwarded():
    engine = make_engine()
    # nn.Module has no __deepcopy__ either way, but a module that had one must not be asked.
    engine.module.__dict__["__custom__"] = 1
    assert not hasattr(engine, "__custom__")


def test_modules_are_the_module_modules():
    engine = make_engine()
    assert list(engine.modules()) == list(engine.module.modules())
    assert [n for n, _ in engine.named_modules()] == ["", "linear", "moe_1"]


def test_has_moe_layers_follows_the_model():
    assert make_engine().has_moe_layers is False
    assert make_engine(NamedModel(with_moe=True)).has_moe_layers is True


def test_torch_autocast_accessors_report_the_config():
    engine = make_engine()
    assert engine.torch_autocast_enabled() is False
    assert engine.torch_autocast_dtype() is torch.bfloat16  # the section's default
    engine = make_engine(torch_autocast={"enabled": True, "dtype": "float16"})
    assert engine.torch_autocast_enabled() is True
    assert engine.torch_autocast_dtype() is torch.float16


@pytest.mark.parametrize("key", ["stage3_gather_16bit_weights_on_model_save",
                                 "stage3_gather_fp16_weights_on_model_save",
                                 "gather_16bit_weights_on_model_save"])
def test_zero_gather_16bit_weights_on_model_save_reports_every_spelling(key):
    assert make_engine(zero_optimization={"stage": 1}).zero_gather_16bit_weights_on_model_save() is False
    engine = make_engine(zero_optimization={"stage": 1, key: True})
    assert engine.zero_gather_16bit_weights_on_model_save() is True


def test_lower_precision_safe_modules_default_to_deepspeeds_classes():
    import importlib

    def resolve(dotted):
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)

    # DeepSpeed 0.19's default list (runtime/torch_autocast.py): Linear and Conv1d-3d.
    default = [resolve(n) for n in make_engine().torch_autocast_lower_precision_safe_modules()]
    assert default == [nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d]
    engine = make_engine(torch_autocast={"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]})
    assert engine.torch_autocast_lower_precision_safe_modules() == ["torch.nn.Linear"]


def test_optimizer_overflow_says_whether_each_step_was_skipped():
    """`engine.optimizer.overflow`, which Accelerate's DeepSpeedOptimizerWrapper looks for when it
    wraps the optimizer (before any step: accelerate/utils/deepspeed.py `__has_overflow__`) and
    returns as `step_was_skipped`. The reference is the engine's own skip count."""
    # fp16 with a loss scale of 2**32: the scaled loss overflows fp16 until the scale has halved
    # far enough, so the first steps are skipped and a later one is taken.
    engine = make_engine(fp16={"enabled": True, "initial_scale_power": 32, "hysteresis": 1})
    assert engine.optimizer.overflow is False
    x = torch.randn(2, 4, dtype=torch.float16)
    seen = []
    for _ in range(40):
        before = engine.skipped_steps
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        skipped = engine.skipped_steps == before + 1
        assert engine.optimizer.overflow is skipped
        seen.append(skipped)
        if not skipped:
            break
    assert seen[0] is True and seen[-1] is False, seen
