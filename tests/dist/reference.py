"""The small test model, its data, and a single-process fp32 reference trainer.

Written with plain torch only, independently of the engine: the engine's results are
compared with what this file computes (docs/design.md section 5, "reference equivalence").

The model (`TinyModel`, 1,244 parameters) carries every shape that has broken a ZeRO
implementation before:

- a token embedding tied to the output head (one parameter used in two places);
- LayerNorms (a weight and a bias that are not in a Linear);
- `gain`, a 0-d parameter (DeepSpeed crashed on it at start-up);
- `odd`, a Linear(7, 5): odd sizes, so shards need padding;
- `unused`, a Linear that forward never calls: its gradient is zero, its unit must still
  complete;
- repeated `Block`s in an `nn.ModuleList`: each becomes a unit (docs/design.md section 3).

Root unit: embed (208) + odd (40) + unused (51) + norm (32) + gain (1) = 332 elements;
each block: LayerNorm (32) + Linear(16, 16) (272) = 304 elements.

Data: `global_batches` makes, for every optimizer step, one global batch of W*b*k rows of
token ids and targets. Rank r's micro-step j reads rows [(j*W + r)*b, (j*W + r + 1)*b), so
every split (W, b, k) of the same global batch covers the same rows.

The reference trains on the whole global batch in one process (loss = mean over the global
batch), clips with `torch.nn.utils.clip_grad_norm_` and steps `torch.optim.AdamW`. For the
low-precision modes it applies the casts by hand (see `reference_train`).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 13
DIM = 16
SEQ = 6
N_BLOCKS = 3
ODD_IN, ODD_OUT = 7, 5

# Element counts of the model's units (see the module docstring); comm tests derive their
# expected byte counts from these.
ROOT_UNIT_NUMEL = VOCAB * DIM + (ODD_IN * ODD_OUT + ODD_OUT) + (DIM * 3 + 3) + 2 * DIM + 1
BLOCK_NUMEL = 2 * DIM + DIM * DIM + DIM
# Numel of the Linear weights and biases in a block (the autocast "safe" group), and of the
# rest of a block (its LayerNorm).
BLOCK_LINEAR_NUMEL = DIM * DIM + DIM
ROOT_LINEAR_NUMEL = (ODD_IN * ODD_OUT + ODD_OUT) + (DIM * 3 + 3)  # odd + unused, not the tied head

# The precision combinations DeepSpeed accepts that narrow a dtype on purpose (issue 19 item 4)
# and bf16 with torch_autocast. Each runs the reference of the mode it narrows: the rounding
# it adds is what its tolerance allows.
LOSSY_MODES = (
    "bf16_autocast",  # bf16 parameters, forward under torch.autocast(bf16) (not lossy)
    "fp32_accum_bf16",  # fp32 gradients accumulated in bf16
    "fp32_comm_bf16",  # fp32, communication_data_type bf16
    "fp32_comm_fp16",  # fp32, communication_data_type fp16
    "bf16_accum_fp16",  # bf16 gradients accumulated in fp16
    "fp16_accum_bf16",  # fp16 gradients accumulated in bf16
    "autocast_comm_bf16",  # torch_autocast(bf16), communication_data_type bf16 for every group
)
MODES = ("fp32", "bf16", "bf16_accum_bf16", "fp16", "autocast_bf16", *LOSSY_MODES)
LOW_DTYPE = {
    "bf16": torch.bfloat16, "bf16_accum_bf16": torch.bfloat16, "fp16": torch.float16,
    "bf16_autocast": torch.bfloat16, "bf16_accum_fp16": torch.bfloat16, "fp16_accum_bf16": torch.float16,
}
FP16_MODES = ("fp16", "fp16_accum_bf16")  # the loss is scaled by 2**FP16_INITIAL_SCALE_POWER
AUTOCAST_MODES = ("autocast_bf16", "bf16_autocast", "autocast_comm_bf16")  # forward under autocast(bf16)
# fp16 runs start at this loss scale (2**8): high enough that no gradient of this model
# underflows, low enough that nothing overflows (2**16, DeepSpeed's default, overflows on
# purpose in the first steps and would make every comparison a comparison of skipped steps).
FP16_INITIAL_SCALE_POWER = 8


class Block(nn.Module):
    """x + tanh(Linear(LayerNorm(x))): one unit."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class TiledHeadLoss(torch.autograd.Function):
    """The head's cross-entropy computed chunk by chunk, with backward run inside forward.

    This is the "tiled loss" pattern (DeepSpeed's TiledFusedLogitsLoss, Liger's fused
    linear cross-entropy): the full logits never exist at once. Each chunk's loss is
    differentiated inside forward with `torch.autograd.backward`, which accumulates the
    head weight's and the gain's gradients into their `.grad` right then (firing their
    post-accumulate-grad hooks while forward is still running) and stores the gradient
    with respect to the hidden states for the real backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, gain, targets, n_chunks):  # noqa: D102
        hidden_leaf = hidden.detach().requires_grad_()
        total_rows = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.enable_grad():
            for rows in torch.arange(total_rows, device=hidden.device).chunk(n_chunks):
                logits = (hidden_leaf[rows] @ weight.t()) * gain
                chunk_loss = F.cross_entropy(logits.float(), targets[rows], reduction="sum") / total_rows
                torch.autograd.backward(chunk_loss)
                loss += chunk_loss.detach()
        ctx.save_for_backward(hidden_leaf.grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: D102
        (grad_hidden,) = ctx.saved_tensors
        # The weight and gain gradients were accumulated in forward (for an incoming
        # gradient of 1, which is what the engine and plain backward of a loss give).
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None


class TinyModel(nn.Module):
    """See the module docstring.

    Args:
        checkpointing: None, "reentrant" or "non_reentrant": activation checkpointing of
            each block with `torch.utils.checkpoint.checkpoint`.
        tiled_loss_chunks: if > 0, the loss is computed by `TiledHeadLoss` in this many
            chunks (an autograd call inside forward).
    """

    def __init__(self, checkpointing: str | None = None, tiled_loss_chunks: int = 0) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.tiled_loss_chunks = tiled_loss_chunks
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(N_BLOCKS))
        self.odd = nn.Linear(ODD_IN, ODD_OUT)
        self.unused = nn.Linear(DIM, 3)
        self.norm = nn.LayerNorm(DIM)
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            # N(0, 1) embeddings against unit-variance hidden states would make logits of
            # size 4 and a saturated softmax; 0.3 keeps every gradient alive.
            self.embed.weight.normal_(0.0, 0.3)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, DIM) hidden states before the head."""
        h = self.embed(tokens)
        for block in self.blocks:
            if self.checkpointing is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.checkpointing == "reentrant")
        h = self.norm(h)
        side = self.odd(h[..., :ODD_IN])
        return h + F.pad(side, (0, DIM - ODD_OUT))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, VOCAB) without targets; the mean cross-entropy (0-d, fp32) with them."""
        h = self.hidden(tokens)
        if targets is not None and self.tiled_loss_chunks:
            flat_h = h.reshape(-1, DIM)
            return TiledHeadLoss.apply(flat_h, self.head.weight, self.gain, targets.reshape(-1), self.tiled_loss_chunks)
        logits = self.head(h) * self.gain
        if targets is None:
            return logits
        return mean_cross_entropy(logits, targets)


class ProbeModel(nn.Module):
    """loss = sum(w * x): the gradient of `w` is exactly the input `x`.

    For tests that must know every gradient to the last bit (accumulation dtypes): with
    inputs that bf16 represents exactly, each micro-batch's gradient is exact in any
    precision, and only accumulation and reduction can round.
    """

    def __init__(self, size: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The model's loss from its logits: mean over every token, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def build_model(seed: int = 0, **kwargs) -> TinyModel:
    """A TinyModel with weights drawn from `seed` (identical in every process)."""
    torch.manual_seed(seed)
    return TinyModel(**kwargs)


def global_batches(seed: int, steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of `rows` rows: (tokens, targets), each (rows, SEQ) int64."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return [
        (torch.randint(0, VOCAB, (rows, SEQ), generator=gen), torch.randint(0, VOCAB, (rows, SEQ), generator=gen))
        for _ in range(steps)
    ]


def micro_batch(
    batch: tuple[torch.Tensor, torch.Tensor], rank: int, micro_step: int, world_size: int, micro: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows of micro-step `micro_step` (see the module docstring)."""
    start = (micro_step * world_size + rank) * micro
    tokens, targets = batch
    return tokens[start : start + micro], targets[start : start + micro]


@dataclass(frozen=True)
class TrainSettings:
    """Optimizer and clipping settings shared by the engine config and the reference.

    `optimizer` is "AdamW" (betas, eps used) or "SGD" (momentum used). The default clip of
    1.0 (DeepSpeed's default) is below this model's gradient norms (about 1.3 to 4.3), so
    clipping is active in every run that keeps it.
    """

    optimizer: str = "AdamW"
    lr: float = 1e-2
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.9
    clip: float = 1.0

    def optimizer_config(self) -> dict:
        if self.optimizer == "SGD":
            params = {"lr": self.lr, "weight_decay": self.weight_decay, "momentum": self.momentum}
        else:
            params = {"lr": self.lr, "weight_decay": self.weight_decay, "betas": list(self.betas), "eps": self.eps}
        return {"type": self.optimizer, "params": params}

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        """The same optimizer in plain torch (what the config above builds in the engine)."""
        if self.optimizer == "SGD":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


@dataclass
class ReferenceResult:
    """What the reference computed.

    Attributes:
        initial: fp32 parameters before the first step (after the mode's rounding).
        params: fp32 (master) parameters after each step, by name.
        losses: the global-batch mean loss of each step, before its update.
        grad_norms: the pre-clip norm of each step's full gradient.
        grads: each step's full (unclipped) gradient, by name.
    """

    initial: dict[str, torch.Tensor]
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


def _named_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone().cpu() for name, p in model.named_parameters()}


def reference_train(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    mode: str = "fp32",
    settings: TrainSettings | None = None,
    model_seed: int = 0,
    loss_terms: int = 1,
    device: str = "cpu",
) -> ReferenceResult:
    """Train `TinyModel` on each global batch in one process; one optimizer step per batch.

    Args:
        batches: from `global_batches`.
        mode: one of MODES. "fp32": plain fp32 training. "bf16", "bf16_accum_bf16",
            "fp16": fp32 master weights (starting from the initial weights rounded to the
            low dtype, as the engine's do), a low-precision copy of the model computes the
            forward and backward on the whole global batch, its gradient is cast to fp32
            (and divided by the loss scale, for fp16, where the loss is multiplied by
            2**FP16_INITIAL_SCALE_POWER before backward), and AdamW steps on the fp32
            masters. The two bf16 modes have the same reference: the accumulation dtype
            is what the engine varies. "autocast_bf16": fp32 model, forward under
            `torch.autocast("cpu", torch.bfloat16)`.
        settings: optimizer and clipping.
        model_seed: the seed of `build_model`.
        loss_terms: the rows of each global batch are split into this many equal parts and
            the loss is the *sum* of the parts' means: the update of several backward
            calls before one step with gradient_accumulation_steps=1 (docs/design.md section 4).
        device: where the model trains ("cpu" or e.g. "cuda:0"). The weights are drawn on the
            CPU either way (the same initial weights); the result is on the CPU. The GPU check
            runs the reference on the engine's device, so both use the same kernels and the
            CPU tolerances hold (a CPU and a GPU fp16 kernel may round a loss differently by
            more than `first_loss`).

    Parameters with no gradient (the unused Linear) get a zero gradient before the step, as
    the engine gives them (docs/design.md section 4): AdamW then still applies weight decay to them.
    """
    settings = settings or TrainSettings()
    # One thread: this model's matmuls are tiny, and on a busy 2-core machine a second
    # OpenMP thread waiting for a core makes each of them 10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_train(batches, mode, settings, model_seed, loss_terms, torch.device(device))
    finally:
        torch.set_num_threads(threads)


@functools.cache
def cached_reference(
    seed: int, steps: int, rows: int, mode: str, settings: TrainSettings, loss_terms: int = 1, device: str = "cpu"
) -> ReferenceResult:
    """`reference_train` on `global_batches(seed, steps, rows)`, computed once per argument set,
    the device included (several tests compare with the same reference). Treat the result as
    read-only."""
    return reference_train(global_batches(seed, steps, rows), mode, settings, seed, loss_terms, device)


def _reference_train(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    mode: str,
    settings: TrainSettings,
    model_seed: int,
    loss_terms: int,
    device: torch.device,
) -> ReferenceResult:
    master = build_model(model_seed).to(device)
    low_dtype = LOW_DTYPE.get(mode)
    if low_dtype is not None:
        with torch.no_grad():
            for p in master.parameters():
                p.copy_(p.to(low_dtype))
        compute = copy.deepcopy(master).to(low_dtype)
    else:
        compute = master
    loss_scale = 2.0**FP16_INITIAL_SCALE_POWER if mode in FP16_MODES else 1.0
    optimizer = settings.make_optimizer(master.parameters())
    result = ReferenceResult(initial=_named_copy(master))
    master_params = list(master.parameters())
    compute_params = list(compute.parameters())
    for tokens, targets in batches:
        tokens, targets = tokens.to(device), targets.to(device)
        if compute is not master:
            with torch.no_grad():
                for c, m in zip(compute_params, master_params, strict=True):
                    c.copy_(m)
        compute.zero_grad(set_to_none=True)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode in AUTOCAST_MODES)
        loss = torch.zeros((), dtype=torch.float32, device=device)
        for part_tokens, part_targets in zip(tokens.chunk(loss_terms), targets.chunk(loss_terms), strict=True):
            with autocast:
                loss = loss + compute(part_tokens, part_targets)
        (loss * loss_scale).backward()
        result.losses.append(float(loss.detach()) / loss_terms)
        for c, m in zip(compute_params, master_params, strict=True):
            grad = c.grad if c.grad is not None else torch.zeros_like(c)
            m.grad = grad.float() / loss_scale
        result.grads.append({name: p.grad.clone().cpu() for name, p in master.named_parameters()})
        norm = torch.nn.utils.clip_grad_norm_(master_params, settings.clip if settings.clip > 0 else float("inf"))
        result.grad_norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.params.append(_named_copy(master))
    return result


# ---------------------------------------------------------------------------------------------
# Tolerances: how far the engine may be from the reference, per precision mode, and why.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """How closely a mode's engine run must follow the reference (see `TOLERANCES`).

    Attributes:
        grad: max |g_engine - g_ref| over the first step's full gradient, as a fraction of
            max |g_ref| (the scale of the largest terms every element is summed from).
        first_loss: relative error of the first step's loss (same weights on both sides).
        loss: relative error of later steps' losses.
        first_norm, norm: relative error of the pre-clip gradient norm, first / later steps.
        sure_sign: after the first AdamW step, every element whose reference gradient
            exceeds `sure_sign * max|g_ref|` (so its sign is certain despite the rounding
            noise `grad` allows) must match the reference to `first_param_atol`; the
            others may differ by up to 2 * lr (AdamW's first update is lr * sign(g)).
        first_param_atol: see `sure_sign`.
        param_atol, param_rtol: per-element tolerance for every step (fp32 only; None for
            the low-precision modes, which use `flip_fraction` instead).
        flip_fraction: low-precision modes, steps after the first: at most this fraction
            of elements may differ from the reference by more than lr / 10, and none by more
            than 2 * lr per step taken.
    """

    grad: float
    first_loss: float
    loss: float
    first_norm: float
    norm: float
    sure_sign: float
    first_param_atol: float
    param_atol: float | None = None
    param_rtol: float | None = None
    flip_fraction: float | None = None


# fp32: the engine adds the same numbers in another order (a mean per micro-batch, divided
# by W*k before the cross-rank sum, instead of one mean over the global batch), so
# gradients, losses and norms differ by a few fp32 ulps (measured: <= 2e-7 relative).
# AdamW maps a relative gradient error d to a parameter error of about lr * d per step,
# and parameters of size ~1 carry ulps of 1.2e-7: measured <= 1.2e-7 after 3 steps at
# lr 1e-2; 1e-6 absolute leaves 8x room and still fails on any real difference (a dropped
# micro-batch or a wrong clip coefficient moves parameters by ~1e-3).
_FP32 = Tolerance(
    grad=1e-6,
    first_loss=1e-6,
    loss=1e-6,
    first_norm=2e-6,
    norm=2e-6,
    sure_sign=0.0,
    first_param_atol=1e-6,
    param_atol=1e-6,
    param_rtol=1e-5,
)
# bf16 (parameters, compute and gradients in bf16: 8 significant bits, ulp 2^-7 relative):
# every micro-batch gradient element carries rounding of up to about 2^-8 of the largest
# terms it sums (different micro-batch sizes round differently from the reference's one
# global batch). Measured first-step gradient error <= 5.6e-3 * max|g| over stages 0-3, W 2
# and 3, k 1 and 4; 2^-6 = 1.6e-2 allows 2.8x. Elements whose reference gradient is above
# that bound have a certain sign, so their first AdamW update (lr * sign(g), bias
# corrections cancel) equals the reference's to fp32 rounding (measured <= 1.2e-7). Below
# it the sign may flip (+-2 lr). Later steps: measured <= 1% of elements off by more than
# lr/10 (flipped signs, then AdamW's state keeps them apart), losses <= 1e-3 and norms
# <= 4e-3 relative; the bounds below allow 3x and 2.5x.
_BF16 = Tolerance(
    grad=2**-6,
    first_loss=1e-5,
    loss=5e-3,
    first_norm=2**-7,
    norm=1e-2,
    sure_sign=2**-6,
    first_param_atol=1e-6,
    flip_fraction=0.03,
)
# fp16 (11 significant bits): the same argument with 8x less rounding. Measured first-step
# gradient error <= 7.5e-4 * max|g| (2^-9 allows 2.6x) and first-step norm error <= 1.2e-4.
# Later steps drift like bf16 (a flipped sign at step 1 carries on), so the same bounds.
_FP16 = Tolerance(
    grad=2**-9,
    first_loss=1e-5,
    loss=5e-3,
    first_norm=1e-3,
    norm=1e-2,
    sure_sign=2**-8,
    first_param_atol=1e-6,
    flip_fraction=0.03,
)
TOLERANCES: dict[str, Tolerance] = {
    "fp32": _FP32,
    "bf16": _BF16,
    # bf16 accumulation adds rounding per micro-step and per rank: measured <= 5.6e-3 too.
    "bf16_accum_bf16": _BF16,
    "fp16": _FP16,
    # torch_autocast(bf16): Linear layers compute in bf16, the rest in fp32; measured
    # gradient error <= 2.6e-3 * max|g|, so the bf16 bounds hold with more room.
    "autocast_bf16": _BF16,
    # The lossy combinations (and bf16 with autocast). Each rounds every gradient element once
    # per micro-step (narrower accumulation) or once per reduction (narrower wire) to 8 (bf16)
    # or 11 (fp16) significant bits: at most 2^-9 (bf16) or 2^-12 (fp16) of max|g| per rounding,
    # a few roundings per step, on top of its reference's own rounding. Each takes the bounds of
    # the widest rounding involved: bf16's where a bf16 rounding is added or bf16 compute is the
    # reference, fp16's for fp32 training with an fp16 wire. Measured (stages 0-3, k 1 and 4,
    # W 2 and 3; first-step gradient error / max|g|, first-norm, later loss, later norm, flipped
    # fraction): bf16_autocast 6.8e-3, 1.3e-3, 8.4e-4, 3.7e-3, 0.8%; fp32_accum_bf16 4.0e-3,
    # 1.1e-3, 2.3e-4, 3.0e-3, 0.2%; fp32_comm_bf16 3.2e-3, 8.2e-4, 1.5e-4, 2.0e-3, 0.6%;
    # fp32_comm_fp16 7.5e-4, 1.3e-4, 1.5e-6, 8.5e-5, 0%; bf16_accum_fp16 6.9e-3, 1.4e-3, 8.4e-4,
    # 3.8e-3, 0.8%; fp16_accum_bf16 4.3e-3, 1.0e-3, 2.8e-4, 2.7e-3, 0.2%; autocast_comm_bf16
    # 2.8e-3, 9.6e-4, 8.0e-4, 3.4e-3, 1.0%. The bounds leave >= 2.3x (gradient) and >= 2.6x
    # (the rest) of room.
    "bf16_autocast": _BF16,
    "fp32_accum_bf16": _BF16,
    "fp32_comm_bf16": _BF16,
    "fp32_comm_fp16": _FP16,
    "bf16_accum_fp16": _BF16,
    "fp16_accum_bf16": _BF16,
    "autocast_comm_bf16": _BF16,
}


def flat_cat(named: dict[str, torch.Tensor]) -> torch.Tensor:
    """All tensors of a name -> tensor dict, flattened and concatenated in name order."""
    return torch.cat([named[name].detach().float().reshape(-1) for name in sorted(named)])


def relative_error(value: float, expected: float) -> float:
    return abs(value - expected) / abs(expected)


def check_against_reference(
    result: dict,
    ref: ReferenceResult,
    mode: str,
    settings: TrainSettings,
    world_losses: list[float],
    label: str,
) -> None:
    """Assert that an engine run (rank 0's result dict from `train`) follows the reference.

    Args:
        result: what `tests.dist.scenarios.common.train` returned on one rank.
        ref: the reference run on the same global batches.
        mode: the precision mode (selects the `Tolerance`).
        settings: the optimizer settings (for lr).
        world_losses: per step, the mean of every rank's micro-batch losses.
        label: names the case in failure messages.
    """
    tol = TOLERANCES[mode]
    lr = settings.lr
    # Losses and norms, every step.
    for step, (loss, ref_loss) in enumerate(zip(world_losses, ref.losses, strict=True)):
        bound = tol.first_loss if step == 0 else tol.loss
        err = relative_error(loss, ref_loss)
        assert err <= bound, f"{label}: step {step + 1} loss {loss} vs reference {ref_loss} (rel {err:.2e} > {bound})"
    for step, (norm, ref_norm) in enumerate(zip(result["grad_norms"], ref.grad_norms, strict=True)):
        assert norm is not None, f"{label}: get_global_grad_norm() is None after step {step + 1}"
        bound = tol.first_norm if step == 0 else tol.norm
        err = relative_error(norm, ref_norm)
        assert err <= bound, (
            f"{label}: step {step + 1} grad norm {norm} vs reference {ref_norm} (rel {err:.2e} > {bound})"
        )

    # The first step's gradient.
    if "grad0" in result:
        g_ref = flat_cat(ref.grads[0])
        g = flat_cat(result["grad0"])
        bound = tol.grad * float(g_ref.abs().max())
        err = float((g - g_ref).abs().max())
        assert err <= bound, f"{label}: first-step gradient off by {err:.3e} (> {bound:.3e})"

    # Parameters: the same start, then every step.
    assert torch.equal(flat_cat(result["initial_master"]), flat_cat(ref.initial)), (
        f"{label}: the engine did not start from the reference's initial weights"
    )
    for step, (engine_params, ref_params) in enumerate(zip(result["master"], ref.params, strict=True)):
        p, p_ref = flat_cat(engine_params), flat_cat(ref_params)
        if tol.param_atol is not None:
            torch.testing.assert_close(
                p,
                p_ref,
                atol=tol.param_atol,
                rtol=tol.param_rtol,
                msg=lambda m, s=step: f"{label}: parameters after step {s + 1}: {m}",
            )
            continue
        diff = (p - p_ref).abs()
        if step == 0:
            g_ref = flat_cat(ref.grads[0])
            sure = g_ref.abs() > tol.sure_sign * float(g_ref.abs().max())
            worst_sure = float(diff[sure].max())
            assert worst_sure <= tol.first_param_atol, (
                f"{label}: first step, elements with a clear gradient sign differ by {worst_sure:.3e} "
                f"(> {tol.first_param_atol}): the first AdamW update must equal the reference's"
            )
        worst = float(diff.max())
        assert worst <= 2 * lr * (step + 1) + 1e-6, f"{label}: step {step + 1}: an element is {worst:.3e} off"
        if step > 0:
            fraction = float((diff > lr / 10).float().mean())
            assert fraction <= tol.flip_fraction, (
                f"{label}: step {step + 1}: {fraction:.2%} of elements are more than lr/10 off "
                f"(> {tol.flip_fraction:.0%})"
            )


# ---------------------------------------------------------------------------------------------
# Comparing runs (parent side).
# ---------------------------------------------------------------------------------------------


def world_losses(per_rank: list[list[dict]], index: int) -> list[float]:
    """Per step, the mean of every rank's micro-batch losses of case `index` (equal-sized
    micro-batches, so this is the mean over the global batch, as the reference reports)."""
    steps = len(per_rank[0][index]["losses"])
    means = []
    for step in range(steps):
        losses = [loss for rank in per_rank for loss in rank[index]["losses"][step]]
        means.append(sum(losses) / len(losses))
    return means


def reference_for(case, world_size: int, loss_terms: int = 1, device: str = "cpu") -> ReferenceResult:
    """The reference run for a `tests.dist.scenarios.common.Case` on `world_size` ranks, trained
    on `device` (the engine's device: see `reference_train`)."""
    rows = world_size * case.micro * case.ga * loss_terms
    return cached_reference(case.seed, case.steps, rows, case.mode, case.settings, loss_terms, str(device))


def run_all(checks) -> None:
    """Run every (label, check) and report all failures together, not just the first."""
    failures = []
    for label, check in checks:
        try:
            check()
        except AssertionError as error:
            failures.append(f"{label}: {error}")
    assert not failures, f"{len(failures)} case(s) failed:\n" + "\n".join(failures)
