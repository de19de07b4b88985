"""Newton-Schulz orthogonalization, the core of Muon: the standard quintic iteration and its
Gram form, both batched over leading dimensions.

[Note: Newton-Schulz]
For a matrix G (rows x cols) Muon wants the orthogonal factor U V^T of G = U S V^T. The
quintic Newton-Schulz iteration approximates it with matrix products only:

    X = G / (||G||_F + 1e-7)             (transposed first when rows > cols, so n <= m)
    repeat steps times:
        A = X X^T                        (n x n)
        B = b A + c A A
        X = a X + B X                    (n x m)
    (transposed back)

with (a, b, c) = (3.4445, -4.7750, 2.0315). The coefficients push every singular value into
roughly [0.7, 1.2] in five steps rather than converging to exactly 1 (Keller Jordan's
choice, which costs nothing in training quality).

Gram form. Every X_k is a polynomial in R_0 = X_0 X_0^T applied to X_0: X_k = Q_k X_0 with
Q_k (n x n). So the iteration can run on n x n matrices only,

    Z_k     = b R_k + c R_k R_k
    Q_{k+1} = (a I + Z_k) Q_k            (Q_0 = I)
    R_{k+1} = (a I + Z_k) R_k (a I + Z_k)

and X = Q_steps X_0 at the end. With five steps and the restart below it costs
4 n^2 m + 14 n^3 multiply-adds against the standard 10 n^2 m + 5 n^3, so it wins when the
matrix is far from square (m > 1.5 n) and loses for square ones, which use the standard
iteration (`gram_is_cheaper`). The two agree exactly in
exact arithmetic; in floating point they round differently (tests state the tolerance).

The R and Q products drift from the X they stand for, and the drift grows with the input's
condition number, so the Gram form restarts once, after two steps (as in Tri Dao's Gram
Newton-Schulz): X = Q X, R = X X^T, Q = I. Half precision needs it; fp32 does too. Measured
here on 6x12 to 64x256 matrices with condition number 1e4, fp32 against fp64: without the
restart the Gram result is off by up to 3.6e-4, with it by 6e-6, as the standard iteration
(5e-6). The restart costs 2 n^2 m and leaves the break-even at m = 1.5 n.

[Note: normalise before casting]
Momentum directions after gradient clipping are small: element RMS 1e-6..3e-5 is typical at
1B scale. fp16 has normal numbers only down to 6.1e-5; below that it keeps fewer and fewer
mantissa bits (about 4 at 1e-6), so casting G to fp16 first and dividing by its norm
afterwards lost 3-78% of the update (relative error against float64). The input is
therefore divided by its Frobenius norm in fp32 (or in the input's dtype when wider) and
only the result, whose entries are at most 1 and typically 1/sqrt(n m) ~ 1e-3..1e-1, is cast
to the compute dtype. For the same reason whoever moves G before Newton-Schulz must not
narrow it to fp16 (`ns_input_dtype`); bf16 has fp32's exponent range and may carry it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NORM_EPS = 1e-7
DEFAULT_NS_STEPS = 5
NS_METHODS = ("gram", "standard")
# The Gram form restarts before this step (see [Note: Newton-Schulz]).
GRAM_RESTARTS = (2,)

_DTYPE_NAMES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp64": torch.float64, "float64": torch.float64,
}
NS_DTYPE_NAMES = ("auto", *_DTYPE_NAMES)


def resolve_ns_dtype(
    name: str | torch.dtype, device: torch.device | str, method: str, input_dtype: torch.dtype = torch.float32
) -> torch.dtype:
    """The Newton-Schulz compute dtype for `name` on `device`.

    "auto" is fp32 on CPU (CPU half-precision matmuls are slow and gain nothing), and on a
    GPU bf16 for the standard iteration, fp16 for the Gram form (fp16's extra mantissa bits
    matter there, and the normalised values never approach its range limit). float64
    inputs stay float64 under "auto" (whoever keeps float64 weights wants the precision).
    """
    if isinstance(name, torch.dtype):
        return name
    key = name.lower()
    if key == "auto":
        if input_dtype == torch.float64:
            return torch.float64
        if torch.device(device).type == "cpu":
            return torch.float32
        return torch.float16 if method == "gram" else torch.bfloat16
    try:
        return _DTYPE_NAMES[key]
    except KeyError:
        raise ValueError(
            f"ns_dtype={name!r}: unknown dtype. Use one of {', '.join(NS_DTYPE_NAMES)}."
        ) from None


def ns_input_dtype(compute_dtype: torch.dtype, source_dtype: torch.dtype) -> torch.dtype:
    """The narrowest dtype that carries a Newton-Schulz input of `source_dtype` without loss
    that normalisation would not also cause (see [Note: normalise before casting]).

    The compute dtype when it is narrower than the source and has at least the source's
    exponent range (bf16 for fp32 inputs: rounding to 8 mantissa bits before the fp32
    normalisation costs what the cast after it costs); otherwise the source dtype (fp16
    would flush small un-normalised entries into its subnormals).
    """
    if compute_dtype.itemsize >= source_dtype.itemsize or not compute_dtype.is_floating_point:
        return source_dtype
    if torch.finfo(compute_dtype).tiny <= torch.finfo(source_dtype).tiny:
        return compute_dtype
    return source_dtype


def standard_cost(n: int, m: int, steps: int) -> int:
    """Multiply-adds of the standard iteration on an n x m matrix (n <= m)."""
    return steps * (2 * n * n * m + n**3)


def gram_cost(n: int, m: int, steps: int, restarts: tuple[int, ...] = GRAM_RESTARTS) -> int:
    """Multiply-adds of the Gram form on an n x m matrix (n <= m), counted as `_gram` runs."""
    restarts = tuple(r for r in restarts if 0 < r < steps)
    cost = 2 * n * n * m  # R_0 = X X^T and the final Q X
    q_started = False
    for i in range(steps):
        if i in restarts:
            cost += 2 * n * n * m  # X = Q X; R = X X^T
            q_started = False
        cost += n**3  # R R
        if q_started:
            cost += n**3  # Z Q
        q_started = True
        if i < steps - 1 and (i + 1) not in restarts:
            cost += 2 * n**3  # Z R, Z (R + Z R)
    return cost


def gram_is_cheaper(rows: int, cols: int, steps: int, restarts: tuple[int, ...] = GRAM_RESTARTS) -> bool:
    """Whether the Gram form does less arithmetic than the standard iteration."""
    n, m = min(rows, cols), max(rows, cols)
    return gram_cost(n, m, steps, restarts) < standard_cost(n, m, steps)


def orthogonalize(
    matrices: torch.Tensor,
    steps: int = DEFAULT_NS_STEPS,
    method: str = "gram",
    dtype: torch.dtype | str = "auto",
    *,
    iterations: NSIterations | None = None,
) -> torch.Tensor:
    """Newton-Schulz orthogonalization of every matrix in `matrices` (..., rows, cols).

    Leading dimensions are a batch: stacked expert weights [E, n, m] are orthogonalized per
    expert, in one call.

    Args:
        matrices: at least 2-D; the last two dimensions are the matrix.
        steps: Newton-Schulz iterations.
        method: "gram" (the Gram form where it is cheaper, the standard iteration for
            near-square matrices) or "standard".
        dtype: compute dtype, or "auto" (see `resolve_ns_dtype`).
        iterations: the two iterations to run (`compiled_iterations`); None: eager.

    Returns:
        The orthogonalized matrices, same shape, in the compute dtype.
    """
    if matrices.dim() < 2:
        raise ValueError(
            f"orthogonalize: expected a matrix or a batch of matrices, got shape {tuple(matrices.shape)}."
        )
    if method not in NS_METHODS:
        raise ValueError(f"ns_method={method!r}: must be one of {', '.join(NS_METHODS)}.")
    if steps < 1:
        raise ValueError(f"ns_steps={steps}: must be at least 1.")
    compute_dtype = resolve_ns_dtype(dtype, matrices.device, method, matrices.dtype)
    shape = matrices.shape
    rows, cols = shape[-2], shape[-1]
    transposed = rows > cols
    # Normalise in fp32 at least (or the input's wider dtype), then cast: see
    # [Note: normalise before casting].
    norm_dtype = torch.promote_types(torch.promote_types(compute_dtype, matrices.dtype), torch.float32)
    x = matrices.reshape(-1, rows, cols).to(norm_dtype)
    if transposed:
        x = x.mT
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = (x / (norms + NORM_EPS)).to(compute_dtype).contiguous()
    n, m = x.shape[-2], x.shape[-1]
    iterations = iterations or EAGER_ITERATIONS
    if method == "gram" and gram_is_cheaper(n, m, steps, GRAM_RESTARTS):
        x = iterations.gram(x, steps, GRAM_RESTARTS)
    else:
        x = iterations.standard(x, steps)
    if transposed:
        x = x.mT
    return x.reshape(shape)


def _standard(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The standard iteration on a batch x (B, n, m), n <= m, already normalised."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)  # A
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # B = b A + c A A
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + B X
    return x


def _gram(x: torch.Tensor, steps: int, restarts: tuple[int, ...]) -> torch.Tensor:
    """The Gram form on a batch x (B, n, m), n < m, already normalised."""
    a, b, c = NS_COEFFICIENTS
    r = torch.bmm(x, x.mT)
    q: torch.Tensor | None = None
    for i in range(steps):
        if i in restarts and q is not None:
            x = torch.bmm(q, x)
            r = torch.bmm(x, x.mT)
            q = None
        z = torch.baddbmm(r, r, r, beta=b, alpha=c)  # Z = b R + c R R
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)  # (a I + Z) I
        else:
            q = torch.baddbmm(q, z, q, beta=a)  # (a I + Z) Q
        if i < steps - 1 and (i + 1) not in restarts:
            rz = torch.baddbmm(r, z, r, beta=a)  # (a I + Z) R
            r = torch.baddbmm(rz, z, rz, beta=a)  # (a I + Z) R (a I + Z); Z and R commute
    assert q is not None
    return torch.bmm(q, x)


def update_scale(rows: int, cols: int) -> float:
    """Muon's shape factor sqrt(max(1, rows / cols)) for an update of a rows x cols matrix."""
    return math.sqrt(max(1.0, rows / cols))


@dataclass(frozen=True)
class NSIterations:
    """The standard iteration and the Gram form, as `orthogonalize` runs them."""

    standard: Callable[[torch.Tensor, int], torch.Tensor] = _standard
    gram: Callable[[torch.Tensor, int, tuple[int, ...]], torch.Tensor] = _gram


EAGER_ITERATIONS = NSIterations()


def compiled_iterations(backend: Any = "inductor", **options: Any) -> NSIterations:
    """Both iterations under torch.compile (`backend`, and torch.compile's `mode`/`options`).

    The iterations are what costs: five rounds of batched products, which a compiler fuses with
    their scalings. The normalisation, the transpose and the choice of form stay eager, so each
    compiled function sees one kind of input, (B, n, m) with n <= m in the compute dtype: a first
    shape compiles a static graph, a second one a graph with dynamic sizes that every later shape
    shares (dynamo's default, as DeepSpeed's compiled `muon_update`), far from dynamo's limit of 8
    per function. The same results as eager within the iterations' rounding (`aot_eager`: the same
    kernels, the same bits)."""
    return NSIterations(
        torch.compile(_standard, backend=backend, **options), torch.compile(_gram, backend=backend, **options)
    )


def compiled_orthogonalize(backend: Any = "inductor", **options: Any) -> Callable[..., torch.Tensor]:
    """`orthogonalize` with its iterations compiled (`compiled_iterations`)."""
    return functools.partial(orthogonalize, iterations=compiled_iterations(backend, **options))


class CompilableNewtonSchulz:
    """Mixed into the Muon optimizers: `self.orthogonalize` is the Newton-Schulz they call,
    eager until `compile_newton_schulz` (which `engine.compile()` calls)."""

    orthogonalize: Callable[..., torch.Tensor] = staticmethod(orthogonalize)

    def compile_newton_schulz(self, backend: Any = "inductor", **options: Any) -> None:
        """Run Newton-Schulz's iterations compiled from the next step on (`compiled_iterations`)."""
        self.orthogonalize = compiled_orthogonalize(backend, **options)
