"""Tiled compute (zeroshard/sequence/tiled.py, ALST) equals the untiled computation.

Each case runs the same module on the same input twice, once plainly and once tiled, and
compares the output (or loss) and the gradients of the input and of every parameter; a
post-accumulate hook counts that each parameter receives its gradient once per backward.

Tolerance (fp32): atol 1e-6, rtol 1e-5. The tiled forward computes each position exactly as
the untiled one; parameter gradients are the sum of per-shard matmuls instead of one matmul
over all positions, which reorders the float additions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

TOL = {"atol": 1e-6, "rtol": 1e-5}


class MLP(nn.Module):
    def __init__(self, hidden: int = 16, inner: int = 40) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def mlp_forward(self: MLP, x: torch.Tensor) -> torch.Tensor:
    return MLP.forward(self, x)


def _count_accumulations(module: nn.Module) -> dict[str, int]:
    counts = {name: 0 for name, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: counts.__setitem__(n, counts[n] + 1))
    return counts


def _run(module: nn.Module, x: torch.Tensor, compute, grad_out: torch.Tensor | None = None):
    module.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_(True)
    out = compute(module, leaf)
    out.backward(grad_out if grad_out is not None else torch.ones_like(out))
    return out.detach(), leaf.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _assert_equal_runs(tiled, plain, label: str) -> None:
    torch.testing.assert_close(tiled[0], plain[0], **TOL, msg=lambda m: f"{label}: output: {m}")
    torch.testing.assert_close(tiled[1], plain[1], **TOL, msg=lambda m: f"{label}: input grad: {m}")
    for name in plain[2]:
        torch.testing.assert_close(tiled[2][name], plain[2][name], **TOL, msg=lambda m, n=name: f"{label}: {n}: {m}")


@pytest.mark.parametrize("shape", [(2, 10, 16), (11, 16)])
@pytest.mark.parametrize("shards", [1, 3, 4])
@pytest.mark.parametrize("with_params", [True, False])
def test_tiled_mlp_equals_untiled(shape, shards: int, with_params: bool) -> None:
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(shape)
    grad_out = torch.randn(shape)
    plain = _run(mlp, x, lambda m, t: m(t), grad_out)
    counts = _count_accumulations(mlp)
    params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight] if with_params else None
    tiled = _run(mlp, x, lambda m, t: TiledMLP.apply(mlp_forward, m, t, shards, params), grad_out)
    _assert_equal_runs(tiled, plain, f"TiledMLP {shape} shards={shards}")
    assert set(counts.values()) == {1}, f"each parameter must be accumulated once per backward: {counts}"


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
@pytest.mark.parametrize("shards", [2, 3])
def test_sequence_tiled_compute_equals_untiled(reduction, shards: int) -> None:
    """An MLP with a per-position scale passed unsharded and a bias sharded with the input;
    seqlen 10 in 3 shards is uneven (4, 4, 2)."""
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(2, 10, 16)
    offset = torch.randn(2, 10, 16)
    scale = torch.tensor(0.5)

    def fn(hidden_states, offset, scale):
        return mlp(hidden_states + offset) * scale

    def reduce(t):
        return t if reduction is None else (t.mean() if reduction == "mean" else t.sum())

    grad_out = torch.randn(2, 10, 16) if reduction is None else None
    plain = _run(mlp, x, lambda m, t: reduce(fn(t, offset, scale)), grad_out)
    counts = _count_accumulations(mlp)
    tiled = _run(mlp, x, lambda m, t: sequence_tiled_compute(
        fn, 10, shards, {"hidden_states": t, "offset": offset}, {"scale": scale}, "hidden_states",
        list(mlp.parameters()), 1, reduction,
    ), grad_out)
    _assert_equal_runs(tiled, plain, f"sequence_tiled_compute reduction={reduction} shards={shards}")
    assert set(counts.values()) == {1}, counts


def test_sequence_tiled_compute_one_loss_per_shard() -> None:
    """output_unshard_dimension=0: each shard returns a scalar; "sum" equals the summed loss."""
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(1, 12, 16)
    plain = _run(mlp, x, lambda m, t: m(t).square().sum())
    tiled = _run(mlp, x, lambda m, t: sequence_tiled_compute(
        lambda hidden_states: m(hidden_states).square().sum(), 12, 3, {"hidden_states": t}, {}, "hidden_states",
        None, 0, "sum",
    ))
    _assert_equal_runs(tiled, plain, "one loss per shard")


class Head(nn.Module):
    def __init__(self, hidden: int = 16, vocab: int = 30) -> None:
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


def summed_ce(self: Head, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    losses = nn.functional.cross_entropy(self.lm_head(x).float(), y, ignore_index=-100, reduction="none")
    if mask is not None:
        losses = losses * mask
    return losses.sum()


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("shards", [1, 3, 5])
def test_tiled_fused_logits_loss_equals_untiled(with_mask: bool, shards: int) -> None:
    """"sum" of per-shard summed cross entropy (-100 labels ignored) equals the untiled sum,
    also when the result is scaled before backward (the gradients follow the incoming one)."""
    torch.manual_seed(0)
    head = Head()
    x = torch.randn(2, 7, 16)
    y = torch.randint(0, 30, (2, 7))
    y[0, :3] = -100
    mask = (torch.rand(2, 7) > 0.3).float() if with_mask else None
    plain = _run(head, x, lambda m, t: summed_ce(m, t.reshape(-1, 16), y.reshape(-1),
                                                 None if mask is None else mask.reshape(-1)) * 0.25)
    counts = _count_accumulations(head)
    tiled = _run(head, x, lambda m, t: TiledFusedLogitsLoss.apply(
        summed_ce, m, t, y, mask, shards, [m.lm_head.weight], "sum") * 0.25)
    _assert_equal_runs(tiled, plain, f"TiledFusedLogitsLoss mask={with_mask} shards={shards}")
    assert counts == {"lm_head.weight": 1}, counts


def test_tiled_fused_logits_loss_mean_of_equal_shards() -> None:
    """"mean" averages the per-shard losses: with equal shards of a mean loss, the full mean."""
    torch.manual_seed(0)
    head = Head()
    x = torch.randn(2, 6, 16)
    y = torch.randint(0, 30, (2, 6))

    def mean_ce(self, x, y):
        return nn.functional.cross_entropy(self.lm_head(x), y)

    plain = _run(head, x, lambda m, t: mean_ce(m, t.reshape(-1, 16), y.reshape(-1)))
    tiled = _run(head, x, lambda m, t: TiledFusedLogitsLoss.apply(mean_ce, m, t, y, None, 4, None, "mean"))
    _assert_equal_runs(tiled, plain, "mean")


def test_bad_arguments_are_refused() -> None:
    head = Head()
    x = torch.randn(2, 6, 16)
    with pytest.raises(ValueError, match="output_reduction='avg': must be 'mean' or 'sum'"):
        TiledFusedLogitsLoss.apply(summed_ce, head, x, torch.zeros(2, 6, dtype=torch.long), None, 2, None, "avg")
    with pytest.raises(ValueError, match="must share their"):
        TiledFusedLogitsLoss.apply(summed_ce, head, x, torch.zeros(2, 5, dtype=torch.long), None, 2, None, "sum")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key='h': must be one of kwargs_to_shard"):
        sequence_tiled_compute(lambda x: x, 6, 2, {"x": x}, {}, "h")
