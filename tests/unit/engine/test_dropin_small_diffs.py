"""Smaller config and engine behaviours DeepSpeed 0.19's own unit tests assert (issue 30 item 8),
in one process: each test names the DeepSpeed test it follows."""

import pytest
import torch

import zeroshard as deepspeed
from tests.unit.engine.test_engine_api_unit import SimpleModel  # DeepSpeed's unit-test model


class PlainSGD(torch.optim.Optimizer):
    """DeepSpeed's SimpleOptimizer (tests/unit/simple_model.py): a user class ZeRO has not tested."""

    def __init__(self, params, lr: float = 0.11072018) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def batch():
    torch.manual_seed(1)
    return torch.randn(2, 4), torch.tensor([0, 3])


# --- zero_allow_untested_optimizer: DeepSpeed tests/unit/runtime/half_precision/test_fp16.py
# TestZeroAllowUntestedOptimizer (initialize refuses a client optimizer outside its list).

@pytest.mark.parametrize("stage", [0, 1, 2, 3])  # stage 0 too: a deliberate difference (the guide says why)
def test_untested_client_optimizer_is_refused_without_the_permission(stage):
    model = SimpleModel()
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": False}
    with pytest.raises(ValueError, match=r"PlainSGD is untested with ZeRO.*\"zero_allow_untested_optimizer\": true"):
        deepspeed.initialize(model=model, optimizer=PlainSGD(model.parameters()), config=config,
                             dist_init_required=False)
    with pytest.raises(ValueError, match="PlainSGD is untested"):  # a factory's result too
        deepspeed.initialize(model=SimpleModel(), optimizer=PlainSGD, config=config, dist_init_required=False)


def test_untested_client_optimizer_with_the_permission_steps_like_the_unwrapped_model():
    torch.manual_seed(0)
    model = SimpleModel()
    reference = SimpleModel()
    reference.load_state_dict(model.state_dict())
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    with pytest.warns(UserWarning, match="re-pointed your PlainSGD"):
        engine, *_ = deepspeed.initialize(model=model, optimizer=PlainSGD(model.parameters()), config=config,
                                          dist_init_required=False)
    engine.backward(engine(*batch()))
    engine.step()
    ref_opt = PlainSGD(reference.parameters())
    reference(*batch()).backward()
    ref_opt.step()
    for (name, got), want in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
        # fp32 both ways, world 1: the same additions in the same order.
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=name)


# --- A config without a model or an optimizer: DeepSpeed tests/unit/runtime/test_ds_config_dict.py
# TestNoModel (refused) and TestInitNoOptimizer / test_ds_initialize.py TestNoOptim.

def test_initialize_without_a_model_is_refused():
    with pytest.raises(ValueError, match="model= is required"):
        deepspeed.initialize(model=None, config={"train_batch_size": 2}, dist_init_required=False)
    with pytest.raises(ValueError, match="model= is required"):  # DeepSpeed's first positional is args
        deepspeed.initialize(SimpleModel(), config={"train_batch_size": 2}, dist_init_required=False)


@pytest.mark.parametrize("stage", [0, 3])
def test_an_engine_without_an_optimizer_runs_forward_and_backward_and_refuses_step(stage):
    # Deliberate difference (the guide): DeepSpeed refuses backward at stage 0 and initialize
    # at stages 1-2; zeroshard computes the gradients and refuses only the step.
    torch.manual_seed(0)
    model = SimpleModel()
    reference = SimpleModel()
    reference.load_state_dict(model.state_dict())
    engine, optimizer, *_ = deepspeed.initialize(
        model=model, config={"train_batch_size": 2, "zero_optimization": {"stage": stage}}, dist_init_required=False
    )
    assert optimizer is None
    loss = engine(*batch())
    want = reference(*batch())
    torch.testing.assert_close(loss, want, rtol=0, atol=0)  # fp32, one process: the same ops
    engine.backward(loss)
    want.backward()
    for (name, param), ref in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(deepspeed.utils.safe_get_full_grad(param), ref.grad, rtol=0, atol=1e-7, msg=name)
    with pytest.raises(RuntimeError, match=r"engine.step\(\): no optimizer. Set 'optimizer' in the config"):
        engine.step()


# --- save_checkpoint into an empty directory name: DeepSpeed tests/unit/checkpoint/
# test_tag_validation.py TestSaveCheckpointInvalidDir (ValueError for None and "").

@pytest.mark.parametrize("save_dir", [None, ""])
def test_save_checkpoint_refuses_an_empty_directory_name(save_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # before: "" wrote the checkpoint into the working directory
    engine, *_ = deepspeed.initialize(model=SimpleModel(), config={
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4}}}, dist_init_required=False)
    with pytest.raises(ValueError, match=rf"save_dir={save_dir!r}: must be a non-empty path"):
        engine.save_checkpoint(save_dir=save_dir)
    assert list(tmp_path.iterdir()) == []


# --- Unmanaged accumulation refuses coalesce_grad_reduction: DeepSpeed tests/unit/v1/zero/
# test_zero_user_backward.py TestUnmanagedGradientAccumulationCoalesceValidation (stages 1, 2).

@pytest.mark.parametrize("stage", [1, 2])
def test_unmanaged_accumulation_refuses_coalesce_grad_reduction(stage):
    engine, *_ = deepspeed.initialize(model=SimpleModel(), config={
        "train_batch_size": 1, "managed_gradient_accumulation": False, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, dist_init_required=False)
    with pytest.raises(RuntimeError, match="coalesce_grad_reduction.*managed_gradient_accumulation false"):
        with engine.coalesce_grad_reduction():
            pass


# --- scale_wrt_gas with accumulation: DeepSpeed tests/unit/v1/zero/test_zero_user_backward.py
# test_grad_accumulation (plain loss.backward is divided by the steps) and
# test_grad_accumulation_scale_wrt_gas_false (engine.backward(loss, scale_wrt_gas=False) is not).

@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("how", ["plain", "scale_wrt_gas_false"])
def test_accumulated_gradient_at_the_boundary_matches_the_unwrapped_model(stage, how):
    steps = 4
    torch.manual_seed(0)
    model = SimpleModel()
    reference = SimpleModel()
    reference.load_state_dict(model.state_dict())
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": steps,
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        dist_init_required=False)
    torch.manual_seed(2)
    batches = [(torch.randn(2, 4), torch.randint(0, 4, (2,))) for _ in range(steps)]
    for i, (x, y) in enumerate(batches):
        loss = engine(x, y)
        if how == "plain":
            loss.backward()
            (reference(x, y) / steps).backward()
        else:
            engine.backward(loss, scale_wrt_gas=False)
            reference(x, y).backward()
        assert engine.is_gradient_accumulation_boundary() == (i == steps - 1)
        if i == steps - 1:
            for (name, param), ref in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
                # fp32 in both; the engine sums the micro-steps in its own buffer: a few ulps apart.
                got = deepspeed.utils.safe_get_full_grad(param)
                torch.testing.assert_close(got, ref.grad, rtol=1e-6, atol=1e-7, msg=name)
        engine.step()  # DeepSpeed's loop: step() after every micro-batch, a no-op until the boundary
    assert engine.global_steps == 1
