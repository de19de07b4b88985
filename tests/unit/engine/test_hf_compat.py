"""The engine surface the Hugging Face Trainer and Accelerate call, in one process: DeepSpeed's
signatures, `engine.config.get`, the consolidated state dict's refusal below stage 3 and an
in-place op on the engine's output (the Trainer's `loss *= ...`)."""

import inspect

import pytest
import torch
from torch import nn

import zeroshard as deepspeed


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0}


def make_engine(config=CONFIG):
    torch.manual_seed(0)
    model = TwoLayer()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      dist_init_required=False, config=config)
    return engine


def test_signatures_are_deepspeeds():
    # DeepSpeed 0.19.8's runtime/engine.py, parameter names in order (the Trainer passes them by name).
    engine = make_engine()
    load = list(inspect.signature(engine.load_checkpoint).parameters)
    assert load[:7] == ["load_dir", "tag", "load_module_strict", "load_optimizer_states",
                        "load_lr_scheduler_states", "load_module_only", "custom_load_fn"]
    assert list(inspect.signature(engine.compile).parameters) == [
        "backend", "compile_kwargs", "schedule", "compiled_autograd_enabled"]
    for name in ("_zero3_consolidated_16bit_state_dict", "_consolidated_16bit_state_dict"):
        assert list(inspect.signature(getattr(engine, name)).parameters) == ["exclude_frozen_parameters"]


def test_config_get_reads_the_dict_as_given():
    engine = make_engine()
    # transformers' save_model: self.deepspeed.config.get("zero_optimization", {}).get("stage", None)
    assert engine.config.get("zero_optimization", {}).get("stage", None) == 1
    assert engine.config.get("bf16", {}) == {}
    assert engine.config.zero_optimization.stage == 1  # the validated view is unchanged


def test_consolidated_state_dict_below_stage3_is_deepspeeds_value_error():
    engine = make_engine()
    with pytest.raises(ValueError, match="requires ZeRO-3 mode"):
        engine._zero3_consolidated_16bit_state_dict()
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        engine._consolidated_16bit_state_dict()


def test_load_checkpoint_refuses_custom_load_fn(tmp_path):
    engine = make_engine()
    with pytest.raises(ValueError, match="custom_load_fn"):
        engine.load_checkpoint(str(tmp_path), custom_load_fn=lambda *a: None)


def test_in_place_scaling_of_the_output_scales_the_gradient():
    """The Trainer scales its loss in place (`loss *= world_size`, compute_loss) before
    backward: the gradient must be that of the scaled loss, as on a plain module."""
    engine = make_engine({**CONFIG, "zero_optimization": {"stage": 0}})
    torch.manual_seed(0)
    reference = TwoLayer()
    x = torch.randn(2, 4)
    loss = engine(x)
    loss *= 3.0
    loss.backward()
    ref_loss = reference(x)
    ref_loss *= 3.0
    ref_loss.backward()
    assert float(loss.detach()) == float(ref_loss.detach())
    for (name, p), q in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
        # the engine reduces over a world of 1 and divides by 1: the same gradient, bit for bit
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
