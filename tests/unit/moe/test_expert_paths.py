"""The three expert paths (zeroshard/moe/autoep/expert_paths.py) against a float64 reference
written here: each expert's SwiGLU on its own rows, forward and the gradients of x, w1, w2, w3.

Tolerances: float64 paths 1e-12 absolute on values of order 1-10 (bmm and the loop add the
same products in another order: a few ulps, ~1e-15 each). fp32 torch._grouped_mm against the
float64 reference: 1e-4 absolute (dot products of length 32 and 24 of values ~1 in fp32:
rounding ~1e-6 each, grown through three matmuls and SiLU; measured ~1e-6).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.moe.autoep.expert_paths import (
    BMM_MAX_PADDING,
    choose_path,
    grouped_mm_available,
    padding_fraction,
    run_experts,
    weighted_combine,
)

HIDDEN, FFN = 32, 24

COUNTS = {
    "uneven": [5, 0, 17, 1],
    "empty_ends": [0, 0, 9, 0],
    "one_expert": [7],
    "all_empty": [0, 0, 0],
}


def _problem(counts: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, experts = sum(counts), len(counts)
    x = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)
    w1 = torch.randn(experts, FFN, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, FFN, generator=g, dtype=torch.float64) / FFN**0.5
    w3 = torch.randn(experts, FFN, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5
    upstream = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)
    leaves = [t.to(dtype).requires_grad_() for t in (x, w1, w2, w3)]
    return leaves, upstream.to(dtype)


def _reference(counts: list[int], x, w1, w2, w3, upstream):
    """float64 value and gradients, one expert at a time with plain matmuls."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w1, w2, w3)]
    x64, a, b, c = leaves
    rows, start = [], 0
    for j, n in enumerate(counts):
        chunk = x64[start:start + n]
        start += n
        gate = chunk @ a[j].T
        rows.append((gate * torch.sigmoid(gate) * (chunk @ c[j].T)) @ b[j].T)
    out = torch.cat(rows)
    out.backward(upstream.double())
    return out.detach(), [t.grad for t in leaves]


def _run(path: str, counts: list[int], dtype: torch.dtype):
    (x, w1, w2, w3), upstream = _problem(counts, dtype)
    out = run_experts(path, x, counts, w1, w2, w3, nn.SiLU())
    out.backward(upstream)
    expected, expected_grads = _reference(counts, x, w1, w2, w3, upstream)
    return out.detach(), [t.grad for t in (x, w1, w2, w3)], expected, expected_grads


@pytest.mark.parametrize("path", ["loop", "bmm"])
@pytest.mark.parametrize("case", list(COUNTS))
def test_path_equals_reference_float64(path, case) -> None:
    out, grads, expected, expected_grads = _run(path, COUNTS[case], torch.float64)
    assert out.shape == (sum(COUNTS[case]), HIDDEN)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    for name, got, want in zip(("x", "w1", "w2", "w3"), grads, expected_grads, strict=True):
        assert got is not None, name  # every expert's slice gets a gradient, zeros when empty
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_empty_expert_gets_zero_weight_gradients() -> None:
    _, grads, _, _ = _run("bmm", COUNTS["uneven"], torch.float64)
    for g in grads[1:]:
        assert torch.count_nonzero(g[1]) == 0 and torch.count_nonzero(g[0]) > 0


def _grouped_mm_runs_on_cpu() -> bool:
    probe = torch.zeros(1, dtype=torch.float32)
    return grouped_mm_available(probe, torch.zeros(2, FFN, HIDDEN))


@pytest.mark.skipif(not _grouped_mm_runs_on_cpu(), reason="this torch build has no CPU fp32 torch._grouped_mm")
@pytest.mark.parametrize("case", ["uneven", "empty_ends", "one_expert"])
def test_grouped_mm_equals_reference_cpu_fp32(case) -> None:
    out, grads, expected, expected_grads = _run("grouped_mm", COUNTS[case], torch.float32)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=0)
    for name, got, want in zip(("x", "w1", "w2", "w3"), grads, expected_grads, strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _fast_grouped_mm_device() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not _fast_grouped_mm_device(), reason="torch._grouped_mm's fast path needs CUDA at compute "
                    "capability 9.0+ (exercised by the GPU check)")
def test_grouped_mm_is_chosen_and_matches_on_cuda_bf16() -> None:
    counts = [40, 0, 72, 8, 16, 24, 0, 96]
    (x, w1, w2, w3), upstream = _problem(counts, torch.bfloat16)
    leaves = [t.detach().cuda().requires_grad_() for t in (x, w1, w2, w3)]
    x_c, a, b, c = leaves
    assert choose_path(x_c, counts, a, use_grouped_mm=True, force_native_grouped_mm=False) == "grouped_mm"
    out = run_experts("grouped_mm", x_c, counts, a, b, c, nn.SiLU())
    out.backward(upstream.cuda())
    expected, expected_grads = _reference(counts, x, w1, w2, w3, upstream)
    # bf16 inputs (8-bit mantissa), fp32 accumulation, three roundings of the intermediates
    # to bf16: relative error ~1e-2 of each value's scale.
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double().cpu(), expected, atol=3e-2 * scale, rtol=0)
    for name, got, want in zip(("x", "w1", "w2", "w3"), (t.grad for t in leaves), expected_grads, strict=True):
        torch.testing.assert_close(got.double().cpu(), want, atol=3e-2 * want.abs().max().item(), rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_padding_fraction() -> None:
    assert padding_fraction([4, 4, 4]) == 0.0
    assert padding_fraction([8, 0, 0, 0]) == pytest.approx(0.75)
    assert padding_fraction([0, 0]) == 0.0


def test_choose_path_rule_cpu() -> None:
    x64 = torch.zeros(1, HIDDEN, dtype=torch.float64)
    w64 = torch.zeros(4, FFN, HIDDEN, dtype=torch.float64)
    even, skewed = [10, 10, 9, 10], [40, 1, 1, 1]
    assert padding_fraction(even) <= BMM_MAX_PADDING < padding_fraction(skewed)
    assert choose_path(x64, even, w64, use_grouped_mm=False, force_native_grouped_mm=False) == "loop"
    assert choose_path(x64, even, w64, use_grouped_mm=True, force_native_grouped_mm=False) == "bmm"
    assert choose_path(x64, skewed, w64, use_grouped_mm=True, force_native_grouped_mm=False) == "loop"
    assert choose_path(x64, [7], w64[:1], use_grouped_mm=True, force_native_grouped_mm=False) == "loop"
    assert choose_path(x64, [0, 0, 0, 0], w64, use_grouped_mm=True, force_native_grouped_mm=True) == "loop"
    # float64 has no torch._grouped_mm: forcing it falls back to the rule.
    assert choose_path(x64, even, w64, use_grouped_mm=True, force_native_grouped_mm=True) == "bmm"
    # On CPU the automatic choice never takes torch._grouped_mm (not its fast device).
    x32, w32 = x64.float(), w64.float()
    assert choose_path(x32, even, w32, use_grouped_mm=True, force_native_grouped_mm=False) == "bmm"
    if _grouped_mm_runs_on_cpu():
        assert choose_path(x32, skewed, w32, use_grouped_mm=True, force_native_grouped_mm=True) == "grouped_mm"
        assert choose_path(x32, skewed, w32, use_grouped_mm=False, force_native_grouped_mm=True) == "loop"


def test_grouped_mm_needs_aligned_sizes() -> None:
    # 16-byte rows: fp32 sizes must be multiples of 4; 30 is not.
    assert not grouped_mm_available(torch.zeros(1, 30), torch.zeros(2, FFN, 30))


@pytest.mark.parametrize("weights_dtype", [torch.float64, torch.float32])
def test_combines_equal_a_float64_sum(weights_dtype) -> None:
    g = torch.Generator().manual_seed(3)
    per_route = torch.randn(11, 6, HIDDEN, generator=g, dtype=torch.float64)
    weights = torch.rand(11, 6, generator=g, dtype=torch.float64)
    expected = torch.einsum("tkh,tk->th", per_route, weights.to(weights_dtype).double())
    pr, w = per_route.to(weights_dtype), weights.to(weights_dtype)
    # weighted_sum in the inputs' dtype: float64 sums of 6 terms reordered, 1e-12; fp32, 6
    # rounded products of values ~1 summed, 1e-5. legacy_bmm multiplies in fp32 for either
    # dtype (DeepSpeed's form), so 1e-5 for both; it must still return the inputs' dtype.
    got = weighted_combine(pr, w, "weighted_sum")
    tol = 1e-12 if weights_dtype == torch.float64 else 1e-5
    assert got.dtype == weights_dtype
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=0)
    legacy = weighted_combine(pr, w, "legacy_bmm")
    assert legacy.dtype == weights_dtype
    torch.testing.assert_close(legacy.double(), expected, atol=1e-5, rtol=0)
