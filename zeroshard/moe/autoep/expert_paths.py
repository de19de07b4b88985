"""Three ways to run a rank's SwiGLU experts over rows grouped by expert, and the rule that
picks one (`choose_path`). Each computes, for local expert j and its `counts[j]` rows x,
`w2[j] (act(w1[j] x) * w3[j] x)`; they differ only in how the matmuls are batched.

- "loop": one `F.linear` per expert (the reference; always available).
- "bmm": the groups zero-padded to the largest one, [L, M, hidden], and one `torch.bmm` per
  projection. Padded rows are zero and their output is dropped, so they add nothing to any
  gradient; the cost is the padding (L * M rows computed for N real ones).
- "grouped_mm": `torch._grouped_mm` with the groups' end offsets (no padding). Used only
  where torch provides it for the device and dtype (probed once, not by torch version).

On CPU the choice between bmm and the loop is measured (`BMM_MAX_PADDING` below);
torch._grouped_mm is taken automatically only where it is the fast kernel (`grouped_mm_is_fast`).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BMM_MAX_PADDING", "ExpertPath", "choose_path", "grouped_mm_available", "grouped_mm_is_fast", "padding_fraction",
    "run_experts", "weighted_combine",
]

ExpertPath = Literal["loop", "bmm", "grouped_mm"]

# bmm is chosen while padded rows are at most this fraction of the rows it computes (L * M).
# Measured on a shared 2-core CPU, fp32, forward + backward, hidden 256, ffn 176
# (benchmarks/moe_expert_padding.py --threads 1; docs/moe.md): bmm / loop time 0.92-1.15 at
# padding 0.09-0.33, 0.94-1.73 at 0.54-0.63 (64 and 8 experts, 16 and 96 rows each): bmm
# loses most where groups are large and padded. With torch's 2 threads the whole layer
# (benchmarks/moe_experts.py, padding 0.22) ran bmm in 0.42-0.57 s and the loop in 2.0 s:
# the loop's many small matmuls suffer most from threads on a busy machine. The bound keeps
# bmm where it was never more than 15% slower single-threaded.
BMM_MAX_PADDING = 0.3


def _loop(x: Tensor, counts: list[int], w1: Tensor, w2: Tensor, w3: Tensor, act: nn.Module) -> Tensor:
    # unbind, not w[j]: the backward of L separate w[j] views adds L full-size [L, ...]
    # gradients (quadratic in L); unbind's backward stacks the L slices once.
    outs = []
    for chunk, a, b, c in zip(torch.split(x, counts), w1.unbind(0), w2.unbind(0), w3.unbind(0), strict=True):
        h = act(F.linear(chunk, a)) * F.linear(chunk, c)
        outs.append(F.linear(h, b))
    return torch.cat(outs)


def _padded_rows(counts: list[int], device: torch.device) -> tuple[Tensor, int]:
    """Each real row's index in the padded [L * M] layout, and M (the largest group)."""
    longest = max(counts)
    sizes = torch.tensor(counts, device=device)
    starts = torch.cumsum(sizes, 0) - sizes
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes)
    within = torch.arange(int(sizes.sum()), device=device) - starts[expert]
    return expert * longest + within, longest


def _bmm(x: Tensor, counts: list[int], w1: Tensor, w2: Tensor, w3: Tensor, act: nn.Module) -> Tensor:
    if x.shape[0] == 0:
        return _loop(x, counts, w1, w2, w3, act)
    rows, longest = _padded_rows(counts, x.device)
    padded = x.new_zeros(len(counts) * longest, x.shape[1]).index_copy(0, rows, x)
    padded = padded.view(len(counts), longest, x.shape[1])
    h = act(torch.bmm(padded, w1.transpose(1, 2))) * torch.bmm(padded, w3.transpose(1, 2))
    out = torch.bmm(h, w2.transpose(1, 2))
    return out.reshape(-1, out.shape[-1]).index_select(0, rows)


def _grouped_mm(x: Tensor, counts: list[int], w1: Tensor, w2: Tensor, w3: Tensor, act: nn.Module) -> Tensor:
    # End offset of each group along x's rows; an empty expert repeats the previous offset.
    offs = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    # w.transpose gives the column-major right operand the kernel asks for, without a copy.
    h = act(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
        x, w3.transpose(-2, -1), offs=offs
    )
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


_PATHS = {"loop": _loop, "bmm": _bmm, "grouped_mm": _grouped_mm}


def run_experts(
    path: ExpertPath, x: Tensor, counts: list[int], w1: Tensor, w2: Tensor, w3: Tensor, act: nn.Module
) -> Tensor:
    """x [N, hidden] grouped by local expert (`counts` rows each) -> [N, hidden]."""
    return _PATHS[path](x, counts, w1, w2, w3, act)


@functools.cache
def _grouped_mm_runs(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether this torch build runs `_grouped_mm` forward and backward for the device and
    dtype: tried once on a tiny problem (torch 2.11 and 2.13 differ in what they provide)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        x = torch.ones(8, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        out.backward(torch.ones_like(out))
        return bool(torch.allclose(out.float(), torch.full((8, 16), 16.0, device=device)))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _aligned(*sizes: int, dtype: torch.dtype) -> bool:
    # The kernel wants 16-byte aligned row strides: hidden and ffn multiples of 16 bytes.
    per_16_bytes = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    return all(s % per_16_bytes == 0 for s in sizes)


def grouped_mm_available(x: Tensor, w1: Tensor) -> bool:
    """torch._grouped_mm can run these experts: present, working for the device and dtype,
    inputs and weights in one dtype, sizes aligned."""
    if x.dtype != w1.dtype or not _aligned(w1.shape[1], w1.shape[2], dtype=w1.dtype):
        return False
    return _grouped_mm_runs(x.device.type, x.device.index, x.dtype)


def grouped_mm_is_fast(x: Tensor) -> bool:
    """Where torch's grouped kernel is the fast one: CUDA, bf16, compute capability 9.0+
    (below it, and on CPU, torch runs the groups one after another)."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def padding_fraction(counts: list[int]) -> float:
    """Padded rows / rows computed when every group is padded to the largest one."""
    computed = len(counts) * max(counts, default=0)
    return 0.0 if computed == 0 else 1.0 - sum(counts) / computed


def choose_path(
    x: Tensor, counts: list[int], w1: Tensor, use_grouped_mm: bool, force_native_grouped_mm: bool
) -> ExpertPath:
    """The path for one forward.

    use_grouped_mm False: the loop. Otherwise torch._grouped_mm where it is the fast kernel
    (or anywhere torch runs it, with `force_native_grouped_mm`: DeepSpeed's
    disable_triton_grouped_mm), else bmm while the padding is under `BMM_MAX_PADDING`, else
    the loop.
    """
    if not use_grouped_mm or sum(counts) == 0:  # no rows: the loop's empty matmuls cost nothing
        return "loop"
    if (force_native_grouped_mm or grouped_mm_is_fast(x)) and grouped_mm_available(x, w1):
        return "grouped_mm"
    if len(counts) > 1 and padding_fraction(counts) <= BMM_MAX_PADDING:
        return "bmm"
    return "loop"


CombineImpl = Literal["weighted_sum", "legacy_bmm"]


def weighted_combine(per_route: Tensor, weights: Tensor, impl: CombineImpl) -> Tensor:
    """Sum of each token's k expert outputs [T, k, hidden] times its weights [T, k].

    "weighted_sum": elementwise product and sum, in the promoted dtype of the two (the
    weights' dtype, as the Hugging Face blocks apply them). "legacy_bmm": DeepSpeed's
    debugging form, one fp32 batched matmul [T, 1, k] x [T, k, hidden].
    """
    if impl == "legacy_bmm":
        out = torch.bmm(weights.float().unsqueeze(1), per_route.float()).squeeze(1)
        return out.to(torch.promote_types(per_route.dtype, weights.dtype))
    return (per_route * weights.unsqueeze(-1)).sum(dim=1)
