"""The migration guide's table of deliberate differences from DeepSpeed 0.19.8 stays true (issue 42
item 4): every row has a check, every check a row, and each check exercises the row's zeroshard
behaviour, in one process on tiny models. Rows that need several ranks or DeepSpeed's own recording
name the test that exercises them (ELSEWHERE), which must exist.

Tolerances: the gradient comparisons are bitwise, against plain torch on the same machine (the
same ops in the same order: an fp32 sum of two bf16 gradients, a power-of-two loss scale).
"""

from __future__ import annotations

import re
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.config.error import ConfigError, DeepSpeedConfigError
from zeroshard.resolve import resolve_config

ROOT = Path(__file__).resolve().parents[3]
GUIDE = ROOT / "docs" / "migrating-from-deepspeed.md"

# Rows exercised by another test (several ranks, DeepSpeed's recorded numbers, a whole model).
ELSEWHERE = {
    "fp16-unscaled-by-the-backwards-scale":
        "tests/unit/precision/test_fp16_vs_deepspeed.py::test_deepspeed_unscales_by_the_grown_scale",
    "aux-loss-free-coefficient": "tests/unit/moe/test_autoep_figures.py::test_autoep_load_and_bias_norm",
    "autoep-constructors-refuse":
        "tests/unit/moe/test_autoep_deepspeed_api.py::test_unsupported_or_wrong_spec_is_refused",
    "different-tags-one-checkpoint": "tests/dist/checkpoint/test_checkpoint_tags.py::test_ranks_agree_on_tags",
    "monitor-that-cannot-start":
        "tests/dist/monitor/test_monitors.py::test_a_folder_that_cannot_be_created_is_refused_on_every_rank",
    "zero3-parameter-attributes":
        "tests/dist/zero/test_param_attributes.py::test_stage3_parameters_carry_deepspeeds_attributes",
    "uneven-heads": "tests/dist/sequence/test_sequence_hf.py::test_uneven_heads_equal_whole_attention",
    "autosp-class-list": "tests/dist/sequence/test_autosp_models.py::test_autosp_pipelines_equal_the_unsharded_models",
}


def _rows() -> list[str]:
    text = GUIDE.read_text(encoding="utf-8")
    table = text.split("<!-- differences -->", 1)[1].split("<!-- /differences -->", 1)[0]
    return re.findall(r"^\| `([a-z0-9-]+)` \|", table, re.M)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
        self.register_buffer("offset", torch.full((2,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.tanh(self.a(x))) + self.offset).float().pow(2).mean()


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(2, 4, generator=g) for _ in range(n)]


def _config(stage: int = 1, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}}
    config.update(extra)
    return config


def _engine(config: dict, model: nn.Module | None = None, **kwargs):
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=model or Tiny(), config=config, **kwargs)
    return engine


def _grads(engine) -> dict[str, torch.Tensor]:
    return {n: zeroshard.safe_get_full_grad(p).float() for n, p in engine.module.named_parameters()}


def _plain_grads(dtype: torch.dtype, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Plain autograd on the tiny model in `dtype` (its fp32 buffer kept): the gradients of one
    micro-batch, in `dtype`."""
    torch.manual_seed(0)
    model = Tiny()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    (model(x.to(dtype)) * scale).backward()
    return {n: p.grad for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------ the checks


def fp32_accumulation() -> None:
    """Two bf16 micro-batches: the default sums their gradients in fp32, bitwise (g0 + g1) / 2 in
    fp32; bf16 accumulation, DeepSpeed's, sums them in bf16, which differs in the last bits."""
    x0, x1 = _batches(2)
    g0, g1 = _plain_grads(torch.bfloat16, x0), _plain_grads(torch.bfloat16, x1)
    got = {}
    for accum in (None, "bf16"):
        extra = {"data_types": {"grad_accum_dtype": accum}} if accum else {}
        engine = _engine(_config(bf16={"enabled": True}, gradient_accumulation_steps=2, **extra))
        engine.backward(engine(x0))
        engine.step()  # not the boundary: counts the micro-step
        engine.backward(engine(x1))  # the boundary backward: the window's gradient is readable
        got[accum] = _grads(engine)
    for name, grad in got[None].items():
        assert torch.equal(grad, (g0[name].float() + g1[name].float()) / 2), name
        assert torch.equal(got["bf16"][name], ((g0[name] + g1[name]) / 2).float()), name
    assert any(not torch.equal(got[None][n], got["bf16"][n]) for n in got[None])


def _fp16_engine():
    return _engine(_config(fp16={"enabled": True, "loss_scale": 256.0}))


def fp16_plain_backward() -> None:
    """A plain loss.backward() under fp16 gives engine.backward's gradients (DeepSpeed raises)."""
    (x,) = _batches(1)
    engine = _fp16_engine()
    engine.backward(engine(x))
    through_engine = _grads(engine)
    engine.zero_grad()
    engine(x).backward()
    assert all(torch.equal(g, through_engine[n]) for n, g in _grads(engine).items())


def fp16_gradient_reads_are_unscaled() -> None:
    """Between backward and step the fp16 gradient reads unscaled: plain fp16 autograd's, not 256
    times it (power-of-two scaling is exact, so bitwise)."""
    (x,) = _batches(1)
    engine = _fp16_engine()
    engine.backward(engine(x))
    reference = _plain_grads(torch.float16, x, scale=256.0)
    for name, grad in _grads(engine).items():
        assert torch.equal(grad, reference[name].float() / 256.0), name


def precision_pairs_deepspeed_refuses() -> None:
    """Stage 0 with an accumulation dtype other than the parameters' trains (DeepSpeed:
    NotImplementedError 'unsupported mix of model_dtype and grad_accum_dtype')."""
    for extra in ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
                  {"data_types": {"grad_accum_dtype": "bf16"}}):
        engine = _engine(_config(stage=0, **extra))
        before = [p.detach().clone() for p in engine.module.parameters()]
        (x,) = _batches(1)
        engine.backward(engine(x))
        engine.step()
        assert all(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters(), strict=True)), extra


class _MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.moe = zeroshard.moe.layer.MoE(8, nn.Linear(8, 8), num_experts=2, ep_size=1, k=1, min_capacity=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(self.inp(x).unsqueeze(0))
        return out.pow(2).mean() + 0.01 * l_aux


def native_moe_at_zero3() -> None:
    """zeroshard's native MoE layer trains at ZeRO-3 (DeepSpeed asserts)."""
    engine = _engine(_config(stage=3), model=_MoEModel())
    experts = [p for n, p in engine.module.named_parameters() if "experts" in n]
    with zeroshard.zero.GatheredParameters(experts):
        before = [p.detach().clone() for p in experts]
    (x,) = _batches(1)
    engine.backward(engine(x))
    engine.step()
    with zeroshard.zero.GatheredParameters(experts):
        assert any(not torch.equal(a, p) for a, p in zip(before, experts, strict=True))


def exception_types() -> None:
    """A batch-size triangle that does not add up is a DeepSpeedConfigError, a ValueError
    (DeepSpeed: AssertionError)."""
    with pytest.raises(DeepSpeedConfigError) as info:
        resolve_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1})
    assert isinstance(info.value, ValueError) and not isinstance(info.value, AssertionError)
    assert "train_batch_size=8" in str(info.value)


def unmanaged_accumulation() -> None:
    engine = _engine(_config(managed_gradient_accumulation=False))
    with pytest.raises(RuntimeError, match="with managed_gradient_accumulation false, every engine.step"):
        engine.set_gradient_accumulation_boundary(True)


def strict_config_reading() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "2"}})
    message = str(info.value)
    assert "zero_optimization.stage" in message and "train_micro_batch_size_per_gpu" in message, message


def outer_autocast_overridden() -> None:
    engine = _engine(_config())
    (x,) = _batches(1)
    with pytest.warns(UserWarning, match="torch_autocast"), torch.autocast("cpu", dtype=torch.bfloat16):
        inner = engine.module.a(x)  # outside the engine: the user's autocast applies
        engine(x)
    assert inner.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert engine.module.a.weight.dtype == torch.float32
        assert engine(x).dtype == torch.float32


def fp16_with_torch_autocast() -> None:
    with pytest.raises(ConfigError, match="torch_autocast"):
        resolve_config({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
                        "torch_autocast": {"enabled": True, "dtype": "float16"}})


def stage3_max_reuse_distance() -> None:
    assert resolve_config({"train_micro_batch_size_per_gpu": 1}).zero_optimization.stage3_max_reuse_distance == 0
    written = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage3_max_reuse_distance": 1e9}}
    assert resolve_config(written).zero_optimization.stage3_max_reuse_distance == 1e9


def llava_placeholders_one_for_one() -> None:
    from zeroshard.sequence.autosp_fusion import LlavaFusionAdapter

    ids = torch.tensor([[1, 5, 5, 5, 2]])
    adapter = LlavaFusionAdapter(None, zeroshard.comm.collectives.world_group(), image_token_id=5)  # one rank
    with pytest.raises(ValueError, match="2 visual feature rows for 3 visual positions"):
        adapter(torch.zeros(2, 8), torch.zeros(1, 5, 8), ids)


def lrrangetest_refused() -> None:
    with pytest.raises(ConfigError, match="LRRangeTest"):
        resolve_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                        "scheduler": {"type": "LRRangeTest", "params": {}}})


def load_module_only_client_state(tmp_path: Path) -> None:
    engine = _engine(_config())
    engine.save_checkpoint(tmp_path, client_state={"epoch": 3})
    assert engine.load_checkpoint(tmp_path, load_module_only=True)[1] == {}
    assert engine.load_checkpoint(tmp_path)[1] == {"epoch": 3}


def allow_pickle(tmp_path: Path) -> None:
    from zeroshard.checkpoint import CheckpointError

    engine = _engine(_config())
    engine.save_checkpoint(tmp_path, client_state={"share": Fraction(1, 3)})
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        engine.load_checkpoint(tmp_path)
    assert engine.load_checkpoint(tmp_path, allow_pickle=True)[1] == {"share": Fraction(1, 3)}


def buffers_keep_their_dtype() -> None:
    engine = _engine(_config(bf16={"enabled": True}))
    assert engine.module.a.weight.dtype == torch.bfloat16 and engine.module.offset.dtype == torch.float32


def param_grad_views() -> None:
    (x,) = _batches(1)
    for stage, present in ((1, True), (2, False)):
        engine = _engine(_config(stage=stage))
        engine.backward(engine(x))
        for name, p in engine.module.named_parameters():
            assert (p.grad is not None) == present, (stage, name)
            if present:
                assert torch.equal(p.grad, zeroshard.safe_get_full_grad(p)), name


def untested_optimizer() -> None:
    model = Tiny()
    with pytest.raises(ValueError, match="zero_allow_untested_optimizer"):
        zeroshard.initialize(model=model, optimizer=torch.optim.Adafactor(model.parameters()),
                             config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}})
    model = Tiny()
    zeroshard.initialize(model=model, optimizer=torch.optim.Adafactor(model.parameters()),
                         config={"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True})


def engine_without_optimizer() -> None:
    engine = _engine({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})
    (x,) = _batches(1)
    engine.backward(engine(x))
    assert all(g.abs().sum() > 0 for g in _grads(engine).values())
    with pytest.raises(RuntimeError, match="no optimizer"):
        engine.step()


def one_parameter_dtype() -> None:
    model = Tiny().to(torch.bfloat16)
    model.b.float()  # a fp32 "adapter" on a bf16 base
    engine = _engine(_config(bf16={"enabled": True}), model=model)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}


def micro_steps_after_load(tmp_path: Path) -> None:
    """Two steps of accumulation 2, saved and loaded into a fresh engine: micro_steps 4, the
    windows done times the accumulation (DeepSpeed: 0), and the next step is at a boundary."""
    config = _config(gradient_accumulation_steps=2)
    engine = _engine(config)
    for x in _batches(4):
        engine.backward(engine(x))
        engine.step()
    engine.save_checkpoint(tmp_path)
    resumed = _engine(config)
    resumed.load_checkpoint(tmp_path)
    assert (resumed.global_steps, resumed.micro_steps) == (2, 4)
    assert not resumed.is_gradient_accumulation_boundary()


CHECKS = {
    "fp32-accumulation": fp32_accumulation,
    "fp16-plain-backward": fp16_plain_backward,
    "fp16-gradient-reads-are-unscaled": fp16_gradient_reads_are_unscaled,
    "precision-pairs-deepspeed-refuses": precision_pairs_deepspeed_refuses,
    "native-moe-at-zero3": native_moe_at_zero3,
    "exception-types": exception_types,
    "unmanaged-accumulation": unmanaged_accumulation,
    "strict-config-reading": strict_config_reading,
    "outer-autocast-overridden": outer_autocast_overridden,
    "fp16-with-torch-autocast": fp16_with_torch_autocast,
    "stage3-max-reuse-distance": stage3_max_reuse_distance,
    "llava-placeholders-one-for-one": llava_placeholders_one_for_one,
    "lrrangetest-refused": lrrangetest_refused,
    "load-module-only-client-state": load_module_only_client_state,
    "allow-pickle": allow_pickle,
    "buffers-keep-their-dtype": buffers_keep_their_dtype,
    "param-grad-views": param_grad_views,
    "untested-optimizer": untested_optimizer,
    "engine-without-optimizer": engine_without_optimizer,
    "one-parameter-dtype": one_parameter_dtype,
    "micro-steps-after-load": micro_steps_after_load,
}


def test_every_row_has_a_check_and_every_check_a_row() -> None:
    rows = _rows()
    assert len(rows) == len(set(rows)), f"a row name twice: {rows}"
    assert set(rows) == set(CHECKS) | set(ELSEWHERE), (set(rows) ^ (set(CHECKS) | set(ELSEWHERE)))
    assert not set(CHECKS) & set(ELSEWHERE)
    for row, node in ELSEWHERE.items():
        path, _, name = node.partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), (row, node)


@pytest.mark.filterwarnings("ignore:zeroshard. re-pointed your Adafactor")
@pytest.mark.parametrize("row", sorted(CHECKS))
def test_the_row_holds(row: str, tmp_path: Path) -> None:
    check = CHECKS[row]
    check(tmp_path) if "tmp_path" in check.__code__.co_varnames[: check.__code__.co_argcount] else check()
