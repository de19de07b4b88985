"""Newton-Schulz orthogonalization: what it computes, how the two forms agree, what they cost."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.dist.ns_reference import reference_newton_schulz
from zeroshard.optim.muon.newton_schulz import (
    gram_cost,
    gram_is_cheaper,
    ns_input_dtype,
    orthogonalize,
    resolve_ns_dtype,
    standard_cost,
)

# Several aspect ratios: square, wide, tall, mildly wide, and a batch of wide matrices.
SHAPES = [(8, 8), (16, 64), (64, 16), (32, 48), (3, 5, 20)]
# The quintic's coefficients are tuned to push every singular value into about [0.68, 1.2]
# in five steps, not to converge to 1; random Gaussian matrices of these sizes are
# conditioned well enough (sigma_min / sigma_max > 0.01) to get there.
SV_LOW, SV_HIGH = 0.6, 1.25


def _conditioned(rows: int, cols: int, condition: float, seed: int) -> torch.Tensor:
    """A float64 matrix with singular values spread log-uniformly over [1/condition, 1]."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), k, dtype=torch.float64)
    return u @ torch.diag(s) @ v.T


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", SHAPES)
def test_singular_values_near_one(shape, method):
    torch.manual_seed(0)
    out = orthogonalize(torch.randn(*shape), method=method)
    assert out.shape == shape and out.dtype == torch.float32
    sv = torch.linalg.svdvals(out)
    assert sv.min() > SV_LOW and sv.max() < SV_HIGH, sv


@pytest.mark.parametrize("shape", SHAPES)
def test_gram_equals_standard_in_float64(shape):
    # Same polynomial, other association: only float64 rounding (~1e-16) separates them.
    torch.manual_seed(1)
    g = torch.randn(*shape, dtype=torch.float64)
    gram, standard = orthogonalize(g, method="gram"), orthogonalize(g, method="standard")
    assert gram.dtype == torch.float64
    torch.testing.assert_close(gram, standard, rtol=0, atol=1e-12)


@pytest.mark.parametrize("condition", [1.0, 1e2, 1e4, 1e6])
@pytest.mark.parametrize("rows,cols", [(6, 12), (16, 64), (64, 16)])
def test_both_forms_match_float64_in_fp32(rows, cols, condition):
    """fp32 against the float64 result, for inputs as ill-conditioned as gradients are.

    Measured worst case here: 4.7e-6 (standard), 5.6e-6 (Gram, thanks to its restart;
    3.6e-4 without it). Tolerance 2e-5 on entries of size ~0.3.
    """
    g = _conditioned(rows, cols, condition, seed=rows + cols)
    exact = orthogonalize(g, method="standard")
    for method in ("gram", "standard"):
        torch.testing.assert_close(orthogonalize(g.float(), method=method).double(), exact, rtol=0, atol=2e-5)


def _relative_error(dtype: str, method: str, g: torch.Tensor) -> float:
    out = orthogonalize(g.float(), method=method, dtype=dtype)
    assert out.dtype == resolve_ns_dtype(dtype, "cpu", method)
    exact = orthogonalize(g, method="standard")
    return float((out.double() - exact).norm() / exact.norm())


def test_half_precision_stays_close():
    """Relative (Frobenius) error against float64 for condition number 1e2.

    Each product rounds to 11 (fp16) or 8 (bf16) mantissa bits, ~5e-4 and ~4e-3 relative;
    the small singular directions amplify it. Seen: fp16 Gram 4.2e-3, bf16 standard 3.1e-2,
    bf16 Gram 4.0e-2: bounds 1e-2 and 8e-2. fp16 Gram is the more accurate of the two GPU
    defaults at lower cost, which is why "auto" picks it for ns_method "gram".
    """
    g = _conditioned(16, 64, 1e2, seed=3)
    fp16_gram = _relative_error("fp16", "gram", g)
    bf16_standard = _relative_error("bf16", "standard", g)
    assert fp16_gram < 1e-2
    assert bf16_standard < 8e-2
    assert _relative_error("bf16", "gram", g) < 8e-2
    assert fp16_gram < bf16_standard


@pytest.mark.parametrize("method", ["gram", "standard"])
def test_batch_is_per_matrix(method):
    """Stacked expert weights [E, n, m]: each expert is orthogonalized on its own."""
    torch.manual_seed(2)
    experts = torch.randn(4, 8, 24)
    batched = orthogonalize(experts, method=method)
    for e in range(4):
        torch.testing.assert_close(batched[e], orthogonalize(experts[e], method=method), rtol=0, atol=1e-6)
    # A leading batch of any rank.
    torch.testing.assert_close(orthogonalize(experts.view(2, 2, 8, 24), method=method).view(4, 8, 24), batched)


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("rows,cols", [(6, 24), (24, 6), (8, 8), (12, 20)])
def test_expert_stack_equals_each_expert_alone_in_float64(rows, cols, method):
    """A stack [E, rows, cols] (AutoEP's experts.w1/w2/w3) in one batched fp32 call equals
    the float64 formula applied to each expert matrix alone: wide (Gram where cheaper), tall
    (transposed per slice), square. The experts' scales differ by 1e8 and their conditioning
    by 1e4: an expert normalised by the stack's norm instead of its own would come out
    ~1e-4 times too small (or NS would not converge for it), far outside the tolerance.
    Tolerance 2e-5 on entries ~0.3: fp32 against float64 for condition numbers up to 1e4, as
    in test_both_forms_match_float64_in_fp32."""
    scales = (1e-4, 1.0, 1e4, 3e-2)
    conditions = (1.0, 1e2, 1e4, 10.0)
    stack = torch.stack([
        _conditioned(rows, cols, cond, seed=10 * e + rows) * scale
        for e, (scale, cond) in enumerate(zip(scales, conditions, strict=True))
    ])
    batched = orthogonalize(stack.float(), method=method)
    assert batched.shape == stack.shape and batched.dtype == torch.float32
    for e in range(len(scales)):
        expected = reference_newton_schulz(stack[e])
        torch.testing.assert_close(batched[e].double(), expected, rtol=0, atol=2e-5,
                                   msg=lambda m, e=e: f"expert {e}: {m}")


def test_tall_matrices_are_transposed():
    torch.manual_seed(3)
    g = torch.randn(40, 10)
    assert torch.equal(orthogonalize(g), orthogonalize(g.T.contiguous()).T)


def test_zero_matrix_stays_zero():
    assert torch.equal(orthogonalize(torch.zeros(4, 12)), torch.zeros(4, 12))


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("rows,cols", [(8, 32), (8, 8), (6, 12), (32, 8)])
def test_cost_model_counts_what_runs(method, rows, cols):
    """The FLOP counter sees exactly the cost model of the path taken (2 FLOPs per multiply-add)."""
    n, m = min(rows, cols), max(rows, cols)
    with FlopCounterMode(display=False) as counter:
        orthogonalize(torch.randn(rows, cols), steps=5, method=method)
    uses_gram = method == "gram" and gram_is_cheaper(rows, cols, 5)
    expected = gram_cost(n, m, 5) if uses_gram else standard_cost(n, m, 5)
    assert counter.get_total_flops() == 2 * expected


def test_gram_only_where_cheaper():
    # Five steps with the restart: 4 n^2 m + 14 n^3 against 10 n^2 m + 5 n^3, even at m = 1.5 n.
    assert gram_cost(10, 15, 5) == standard_cost(10, 15, 5) == 20_000
    assert not gram_is_cheaper(10, 10, 5)  # square matrices use the standard iteration
    assert not gram_is_cheaper(10, 15, 5)
    assert gram_is_cheaper(10, 16, 5) and gram_is_cheaper(16, 10, 5)
    assert gram_cost(1024, 4096, 5) < 0.7 * standard_cost(1024, 4096, 5)


def test_compute_dtype_defaults():
    assert resolve_ns_dtype("auto", "cpu", "gram") == torch.float32
    assert resolve_ns_dtype("auto", "cpu", "standard") == torch.float32
    assert resolve_ns_dtype("auto", torch.device("cuda"), "gram") == torch.float16
    assert resolve_ns_dtype("auto", torch.device("cuda"), "standard") == torch.bfloat16
    assert resolve_ns_dtype("bf16", "cpu", "gram") == torch.bfloat16


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        orthogonalize(torch.randn(5))
    with pytest.raises(ValueError, match="ns_method='newton'"):
        orthogonalize(torch.randn(3, 3), method="newton")
    with pytest.raises(ValueError, match="ns_steps=0"):
        orthogonalize(torch.randn(3, 3), steps=0)
    with pytest.raises(ValueError, match="ns_dtype='fp8'"):
        orthogonalize(torch.randn(3, 3), dtype="fp8")


# Relative (Frobenius) error bounds against float64 for the condition-1e2 test matrix, the
# same as at unit scale (`test_half_precision_stays_close`): the scale of the input must not
# matter, since Newton-Schulz divides it out.
HALF_BOUNDS = {"fp16": 1e-2, "bf16": 8e-2}


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("rms", [1e-6, 3e-6, 1e-5, 3e-5, 1e-4])
def test_small_inputs_keep_half_precision_accuracy(rms, dtype, method):
    """Inputs of element RMS 1e-6..1e-4 (clipped gradients at 1B scale) in fp32, orthogonalized
    in fp16 and bf16, against the float64 result of the same input.

    Casting to fp16 before normalising put these entries into fp16's subnormals (below
    6.1e-5, ~4 mantissa bits at 1e-6): the old code's fp16 error here was 0.185 at RMS 1e-6,
    0.066 at 3e-6 and 0.021 at 1e-5 (this test failed). Normalising in fp32 first leaves what
    unit-scale inputs have (seen: fp16 <= 5.9e-3, bf16 <= 5.2e-2 over every case); the
    bounds are those of `test_half_precision_stays_close`.
    """
    g = _conditioned(16, 64, 1e2, seed=3)
    g = g * (rms / g.pow(2).mean().sqrt())
    error = _relative_error(dtype, method, g)
    assert error < HALF_BOUNDS[dtype], f"rms {rms:g} {dtype} {method}: relative error {error:.3g}"


def test_ns_input_dtype_never_narrows_to_fp16():
    """What may carry an un-normalised input (Muon's all-gather of u): bf16 keeps fp32's
    exponent range, fp16 does not."""
    assert ns_input_dtype(torch.float16, torch.float32) == torch.float32
    assert ns_input_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    assert ns_input_dtype(torch.float32, torch.float32) == torch.float32
    assert ns_input_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert ns_input_dtype(torch.float16, torch.float64) == torch.float64
    assert ns_input_dtype(torch.bfloat16, torch.float64) == torch.float64
