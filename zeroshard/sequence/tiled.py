"""Tiled compute along the sequence: the memory peaks sequence parallelism leaves (ALST).

With a long local sequence the MLP's intermediate activations and the logits dwarf the rest.
These autograd functions run a computation shard by shard along the sequence, keep only the
inputs, and recompute each shard in backward, so at most one shard's intermediates are alive
at a time. Values and gradients equal the untiled computation (up to the order of the
per-shard sums of parameter gradients).

Parameter gradients: each shard's parameter gradients are summed here and handed to each
parameter in ONE accumulation (`_accumulate_once`), so gradient hooks (ZeRO's gradient path)
see one gradient per parameter per backward, as untiled. That is what `compute_params` is
for (DeepSpeed's `ds_grad_is_ready` flags serve the same end). Without `compute_params`,
TiledMLP and TiledFusedLogitsLoss use the module's parameters that require gradients, and
`sequence_tiled_compute` lets autograd accumulate into `.grad` shard by shard.

Signatures are DeepSpeed's (deepspeed.runtime.sequence_parallel.ulysses_sp), reachable from
zeroshard.runtime.sequence_parallel.ulysses_sp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["TiledMLP", "SequenceTiledCompute", "sequence_tiled_compute", "TiledFusedLogitsLoss"]


def _params_requiring_grad(compute_params: Sequence[Tensor] | None, module: Any) -> list[Tensor]:
    if compute_params is None:
        compute_params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
    return [p for p in compute_params if p.requires_grad]


def _add(total: list[Tensor | None], grads: Sequence[Tensor | None]) -> None:
    for i, g in enumerate(grads):
        if g is not None:
            total[i] = g if total[i] is None else total[i] + g


def _accumulate_once(params: list[Tensor], grads: list[Tensor | None]) -> None:
    """Accumulate each summed gradient into its parameter through autograd (an identity view),
    so `.grad` and post-accumulate hooks behave as after an untiled backward."""
    pairs = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
    if pairs:
        with torch.enable_grad():
            torch.autograd.backward([p.view_as(p) for p, _ in pairs], [g for _, g in pairs])


def _leaf(t: Tensor, requires_grad: bool) -> Tensor:
    return t.detach().requires_grad_(requires_grad)


class TiledMLP(torch.autograd.Function):
    """`TiledMLP.apply(fn, self, x, num_shards, compute_params)`: `fn(self, x)` shard by shard
    along dim -2 of `x` ([batch, seq, hidden] or [seq, hidden]); recomputed in backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: Tensor, shards: int, compute_params: Any) -> Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, self, shards
        ctx.params = _params_requiring_grad(compute_params, self)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(self, piece) for piece in x.chunk(shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        params = ctx.params
        x_grads: list[Tensor] = []
        param_grads: list[Tensor | None] = [None] * len(params)
        for piece, grad_piece in zip(x.chunk(ctx.shards, dim=-2), grad.chunk(ctx.shards, dim=-2), strict=True):
            leaf = _leaf(piece, x.requires_grad)
            inputs = ([leaf] if x.requires_grad else []) + params
            with torch.enable_grad():
                out = ctx.fn(ctx.module, leaf)
            grads = torch.autograd.grad(out, inputs, grad_piece, allow_unused=True)
            if x.requires_grad:
                x_grads.append(grads[0])
                grads = grads[1:]
            _add(param_grads, grads)
        _accumulate_once(params, param_grads)
        return None, None, torch.cat(x_grads, dim=-2) if x.requires_grad else None, None, None


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind `sequence_tiled_compute` (tensors are positional here)."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable,
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        compute_params: Any,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *args: Any,
    ) -> Tensor:
        if output_reduction not in (None, "mean", "sum"):
            raise ValueError(f"output_reduction={output_reduction!r}: must be None, 'mean' or 'sum'")
        to_shard = dict(zip(keys_to_shard, args[: len(keys_to_shard)], strict=True))
        to_pass = dict(zip(keys_to_pass, args[len(keys_to_shard) :], strict=True))
        step = math.ceil(seqlen / shards)
        bounds = [(start, min(start + step, seqlen)) for start in range(0, seqlen, step)]
        ctx.fn, ctx.bounds, ctx.to_shard, ctx.to_pass = fn, bounds, to_shard, to_pass
        ctx.key, ctx.dim, ctx.reduction = grad_requiring_tensor_key, output_unshard_dimension, output_reduction
        ctx.params = None if compute_params is None else [p for p in compute_params if p.requires_grad]
        ctx.index = (list(keys_to_shard) + list(keys_to_pass)).index(grad_requiring_tensor_key)
        ctx.n_args = len(args)
        with torch.no_grad():
            outs = [fn(**{k: v[:, a:b] for k, v in to_shard.items()}, **to_pass) for a, b in bounds]
        if output_unshard_dimension == 0:  # one scalar per shard (a loss)
            unsharded = torch.stack(outs)
        else:
            unsharded = torch.cat(outs, dim=output_unshard_dimension)
        ctx.shard_sizes = [1 if output_unshard_dimension == 0 else o.shape[output_unshard_dimension] for o in outs]
        ctx.unsharded_shape = unsharded.shape
        if output_reduction == "mean":
            return unsharded.mean()
        if output_reduction == "sum":
            return unsharded.sum()
        return unsharded

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        if ctx.reduction is not None:  # d(mean)/d(each element) = 1/numel
            grad = grad.expand(ctx.unsharded_shape)
            if ctx.reduction == "mean":
                grad = grad / math.prod(ctx.unsharded_shape)
        grad_pieces = grad.split(ctx.shard_sizes, dim=ctx.dim)
        target = ctx.to_shard[ctx.key]
        params = ctx.params or []
        target_grads: list[Tensor] = []
        param_grads: list[Tensor | None] = [None] * len(params)
        for (a, b), grad_piece in zip(ctx.bounds, grad_pieces, strict=True):
            kwargs = {k: v[:, a:b] for k, v in ctx.to_shard.items()}
            leaf = kwargs[ctx.key] = _leaf(kwargs[ctx.key], True)
            with torch.enable_grad():
                out = ctx.fn(**kwargs, **ctx.to_pass)
            if ctx.dim == 0:
                grad_piece = grad_piece.reshape(out.shape)
            if ctx.params is None:  # autograd accumulates parameter gradients shard by shard
                torch.autograd.backward(out, grad_piece, inputs=None)
                target_grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
                continue
            grads = torch.autograd.grad(out, [leaf] + params, grad_piece, allow_unused=True)
            target_grads.append(grads[0] if grads[0] is not None else torch.zeros_like(leaf))
            _add(param_grads, grads[1:])
        _accumulate_once(params, param_grads)
        arg_grads: list[Any] = [None] * ctx.n_args
        if target.requires_grad:
            arg_grads[ctx.index] = torch.cat(target_grads, dim=1)
        return (None,) * 9 + tuple(arg_grads)


def sequence_tiled_compute(
    fn: Callable,
    seqlen: int,
    num_shards: int,
    kwargs_to_shard: dict[str, Any],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Sequence[Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = None,
) -> Tensor:
    """`fn(**kwargs_to_shard sharded on dim 1, **kwargs_to_pass)` over `num_shards` pieces of
    the sequence (`seqlen` long), outputs concatenated on `output_unshard_dimension` (0: one
    scalar per shard, stacked), then reduced (None, "mean" or "sum"). Only the tensor under
    `grad_requiring_tensor_key` (one of `kwargs_to_shard`) gets a gradient, plus
    `compute_params` (summed over shards, accumulated once)."""
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(
            f"grad_requiring_tensor_key={grad_requiring_tensor_key!r}: must be one of kwargs_to_shard "
            f"{sorted(kwargs_to_shard)}"
        )
    return SequenceTiledCompute.apply(
        fn, seqlen, num_shards, list(kwargs_to_shard), list(kwargs_to_pass), grad_requiring_tensor_key,
        compute_params, output_unshard_dimension, output_reduction,
        *kwargs_to_shard.values(), *kwargs_to_pass.values(),
    )


class TiledFusedLogitsLoss(torch.autograd.Function):
    """`TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)`:
    a loss `fn(self, x_shard, y_shard[, mask_shard])` over shards of the flattened
    [batch * seq] positions, so the full logits never exist. The gradients are computed in
    forward, shard by shard (the logits of one shard at a time), and applied in backward scaled
    by the incoming gradient. "mean" averages the per-shard losses (use "sum" with a summed
    `fn` when shards hold different numbers of counted tokens, and divide yourself)."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable,
        self: Any,
        x: Tensor,
        y: Tensor,
        mask: Tensor | None,
        shards: int,
        compute_params: Any,
        output_reduction: str,
    ) -> Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"output_reduction={output_reduction!r}: must be 'mean' or 'sum'")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must share their [batch, seq] dims")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"mask {tuple(mask.shape)} must be [batch, seq] = {tuple(x.shape[:2])}")
        params = _params_requiring_grad(compute_params, self)
        flat_x = x.detach().reshape(-1, *x.shape[2:])
        pieces = [flat_x.chunk(shards), y.reshape(-1, *y.shape[2:]).chunk(shards)]
        if mask is not None:
            pieces.append(mask.reshape(-1).chunk(shards))
        weight = 1.0 / len(pieces[0]) if output_reduction == "mean" else 1.0
        losses, x_grads = [], []
        param_grads: list[Tensor | None] = [None] * len(params)
        for x_piece, *rest in zip(*pieces, strict=True):
            leaf = _leaf(x_piece, x.requires_grad)
            with torch.enable_grad():
                loss = fn(self, leaf, *rest)
                inputs = ([leaf] if x.requires_grad else []) + params
                seed = torch.full_like(loss, weight)
                grads = torch.autograd.grad(loss, inputs, seed, allow_unused=True) if inputs else ()
            losses.append(loss.detach())
            if x.requires_grad:
                x_grads.append(grads[0] if grads[0] is not None else torch.zeros_like(leaf))
                grads = grads[1:]
            _add(param_grads, grads)
        ctx.params, ctx.param_grads = params, param_grads
        ctx.x_grad = torch.cat(x_grads).view(x.shape) if x.requires_grad else None
        total = torch.stack(losses)
        return total.mean() if output_reduction == "mean" else total.sum()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        _accumulate_once(ctx.params, [None if g is None else g * grad for g in ctx.param_grads])
        x_grad = None if ctx.x_grad is None else ctx.x_grad * grad
        ctx.param_grads = ctx.x_grad = None
        return None, None, x_grad, None, None, None, None, None
