"""zeroshard.fp8: the plan's fp8 role, which Linears compute in fp8 and why, the refusals, and
the fp8 Linear against torchao's own cast (zeroshard/precision/fp8.py's [Note: fp8 compute])."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from zeroshard.cli import main
from zeroshard.config.schema import ConfigError
from zeroshard.models.gpt import build_gpt
from zeroshard.precision.fp8 import Fp8Settings, fp8_linear_plan
from zeroshard.precision.plan import GROUP_ALL, GROUP_FP8, assign_param_groups
from zeroshard.resolve import resolve_config

F32, BF16, E4M3 = torch.float32, torch.bfloat16, torch.float8_e4m3fn


def plan_for(stage: int = 3, recipe: str = "tensorwise", **sections):
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "zeroshard": {"fp8": {"enabled": True, "recipe": recipe, "min_features": 16}}}
    config.update(sections)
    return resolve_config(config, world_size=2).precision_plan


def test_fp8_role_on_top_of_bf16_gathers_fp8_at_stage_3_only_with_tensorwise():
    plan = plan_for(bf16={"enabled": True})
    all_group, fp8 = plan.groups[GROUP_ALL], plan.groups[GROUP_FP8]
    assert plan.mode == "bf16" and fp8.compute == "fp8 e4m3 (tensorwise)" and all_group.compute == "bf16"
    for role in (all_group, fp8):  # bf16 parameters and gradients, fp32 accumulation, masters and state
        assert (role.param_dtype, role.grad_dtype, role.grad_accum_dtype, role.reduce_dtype) == (BF16, BF16, F32, F32)
        assert (role.master_dtype, role.optimizer_state_dtype) == (F32, F32)
    assert (all_group.gather_dtype, fp8.gather_dtype) == (BF16, E4M3)
    assert plan.as_dict()["groups"]["fp8"]["gather"] == "float8_e4m3fn"
    # Stages 0-2 publish in the parameter dtype; rowwise has two scalings of a weight: bf16 gathers.
    assert plan_for(stage=2, bf16={"enabled": True}).groups[GROUP_FP8].gather_dtype == BF16
    rowwise = plan_for(recipe="rowwise", bf16={"enabled": True})
    assert rowwise.groups[GROUP_FP8].gather_dtype == BF16
    assert any("rowwise" in note and "bf16" in note for note in rowwise.notes)


@pytest.mark.parametrize(
    ("sections", "fix"),
    [
        ({"fp16": {"enabled": True}}, "Set bf16.enabled=true and fp16.enabled=false"),
        ({}, "needs bf16.enabled=true"),
        ({"torch_autocast": {"enabled": True}}, "Set torch_autocast.enabled=false"),
        ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}}, "Set torch_autocast.enabled=false"),
    ],
)
def test_fp8_outside_bf16_is_refused_naming_the_keys(sections, fix):
    with pytest.raises(ConfigError) as info:
        plan_for(**sections)
    message = str(info.value)
    assert "zeroshard.fp8.enabled=true:" in message and fix in message


class _Custom(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 64)
        self.big = nn.Linear(64, 128)
        self.small = nn.Linear(8, 64)
        self.odd = nn.Linear(64, 72)
        self.custom = _Custom(64, 64)
        self.skipped = nn.Linear(64, 64)
        self.tied = nn.Linear(64, 10, bias=False)
        self.tied.weight = self.emb.weight
        self.head = nn.Linear(64, 32)


def test_which_linears_compute_in_fp8_and_why():
    settings = Fp8Settings("tensorwise", 16, True, ("skip*",))
    choices = {c.name: (c.fp8, c.reason) for c in fp8_linear_plan(_Net(), settings)}
    assert choices == {
        "big": (True, "64 x 128, tensorwise scaling"),
        "small": (False, "smaller than zeroshard.fp8.min_features=16"),
        "odd": (False, "in/out features not multiples of 16 (fp8 matmul kernels need it)"),
        "custom": (False, "_Custom is a subclass of nn.Linear with a forward of its own"),
        "skipped": (False, 'listed in zeroshard.fp8.exclude_modules ("skip*")'),
        "tied": (False, "weight shared with emb"),
        "head": (False, "the output layer (LM head)"),
    }


def test_the_plan_groups_the_fp8_weights_of_the_demo_gpt():
    plan = plan_for(bf16={"enabled": True})
    groups = assign_param_groups(plan, build_gpt("tiny"))
    fp8 = sorted(name for name, group in groups.items() if group == GROUP_FP8)
    # Every block's four Linear weights; biases, norms, embeddings and the tied LM head stay bf16.
    assert fp8 == sorted(f"blocks.{i}.{m}.weight" for i in range(4)
                         for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert groups["lm_head.weight" if "lm_head.weight" in groups else "wte.weight"] == GROUP_ALL


def test_explain_shows_the_fp8_linears(tmp_path, capsys):
    config = tmp_path / "fp8.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
        "zeroshard": {"fp8": {"enabled": True, "min_features": 128, "exclude_modules": ["blocks.0.*"]}},
    }))
    assert main(["explain", str(config), "--model", "small", "--world-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["precision"]["groups"]["fp8"]["gather"] == "float8_e4m3fn"
    rows = {row["module"]: row for row in data["model"]["fp8"]}
    assert rows["blocks.1.mlp.c_fc"]["fp8"] and not rows["blocks.0.mlp.c_fc"]["fp8"]
    assert rows["lm_head"]["why"] == "the output layer (LM head)"
    assert main(["explain", str(config), "--model", "small", "--world-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "FP8: which Linear layers compute in fp8" in text and "float8_e4m3fn" in text


def test_fp8_linear_from_gathered_bytes_equals_torchao_dynamic_cast():
    """The stage-3 path (weights gathered in fp8 with a precomputed scale) computes exactly what
    torchao's own Float8Linear computes from the bf16 weight: same output, same gradients."""
    from torchao.float8 import convert_to_float8_training

    from zeroshard.precision.fp8_linear import FP8_GATHERED, fp8_cast, fp8_scale, swap_to_fp8, torchao_config

    settings = Fp8Settings("tensorwise", 16, True, ())
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 16)).to(BF16)
    theirs = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 16)).to(BF16)
    theirs.load_state_dict(ours.state_dict())
    assert swap_to_fp8(ours, settings) == ["0", "2"]  # "3" is the output layer
    convert_to_float8_training(theirs, config=torchao_config(settings), module_filter_fn=lambda m, n: n in ("0", "2"))
    for name in ("0", "2"):
        weight = ours.get_submodule(name).weight
        scale = fp8_scale(weight.detach().abs().max())
        data = torch.empty(weight.shape, dtype=E4M3)
        fp8_cast(weight.detach(), scale, data)
        setattr(weight, FP8_GATHERED, (data, scale))
    x = torch.randn(8, 64, dtype=BF16)
    out_ours, out_theirs = ours(x), theirs(x)
    out_ours.float().square().sum().backward()
    out_theirs.float().square().sum().backward()
    assert torch.equal(out_ours, out_theirs)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    # Against bf16, fp8 compute is close but not equal (e4m3 keeps 3 mantissa bits).
    reference = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 16)).to(BF16)
    reference.load_state_dict({k: v for k, v in theirs.state_dict().items()})
    assert not torch.equal(reference(x), out_ours)


def test_a_device_without_fp8_matmuls_is_refused_unless_emulated():
    from zeroshard.precision.fp8_linear import fp8_device_problem

    problem = fp8_device_problem(torch.device("cpu"), Fp8Settings("tensorwise", 1024, False, ()))
    assert problem.startswith("zeroshard.fp8.emulate=false: the cpu device has no fp8 matmul")
    assert "Set zeroshard.fp8.emulate=true" in problem
    assert fp8_device_problem(torch.device("cpu"), Fp8Settings("tensorwise", 1024, True, ())) is None
