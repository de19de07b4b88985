"""`engine.optimizer.parameter_offload` (zeroshard/engine/parameter_offload.py) in one process:
what TRL's `remove_hooks` / `add_hooks` do to it, done by hand. The 2-rank generation through
TRL itself is tests/dist/hf/test_trl_sft.py."""

import torch
from torch import nn

import zeroshard as deepspeed
from zeroshard.zero.param_status import ZeroParamStatus


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def make_engine(stage: int):
    torch.manual_seed(0)
    model = Blocks()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), dist_init_required=False,
                                      config=config)
    return engine


def test_only_stage3_engines_have_it():
    assert not hasattr(make_engine(2).optimizer, "parameter_offload")
    engine = make_engine(3)
    offload = engine.optimizer.parameter_offload
    assert offload.module is engine.module and offload.hooks_attached
    assert list(engine.module.ds_external_parameters()) == []
    assert all(p.ds_active_sub_modules == set() for p in engine.module.parameters())


def test_removed_hooks_leave_gathered_parameters_alone_and_come_back():
    engine = make_engine(3)
    x = torch.randn(2, 8)
    expected = engine(x).item()
    layer = engine.module.layers[1].weight
    assert layer.numel() == 0 and layer.ds_status is ZeroParamStatus.NOT_AVAILABLE
    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(list(engine.parameters())):
        for hook in offload.forward_hooks:  # TRL's remove_hooks
            hook.remove()
        offload.forward_hooks = []
        assert not offload.hooks_attached
        assert engine(x).item() == expected
        assert layer.numel() == 64 and layer.ds_status is ZeroParamStatus.AVAILABLE, "the forward freed nothing"
        if not offload.param_coordinator.is_invalid_trace():  # TRL's add_hooks
            offload.param_coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
    assert offload.hooks_attached and layer.numel() == 0
    assert engine(x).item() == expected
    assert layer.numel() == 0, "the schedule frees the unit again after its forward"
