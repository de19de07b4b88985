"""The DeepSpeed fixtures' model trained by plain torch, here: the reference zeroshard must equal
bit for bit, and how far a number recorded on another machine may be from ours.

Why both. DeepSpeed 0.19.8 recorded its numbers once, on one CPU with its thread count. Another
CPU's vector kernels, or another number of threads (a matmul sums in other blocks), round the same
formulas differently: on an AMD EPYC (AVX2) the AdamW update came out one or two float32 ulps
away, and here `ATEN_CPU_CAPABILITY=default` (torch's generic kernels) gives 3 ulps after two
resumed fp32 steps. In a bf16 or fp16 run a master a few ulps away can round to the neighbouring
16-bit parameter, and the steps after it then move by a fraction of that parameter's own ulp
(one thread instead of two: 0.22 bf16 ulp after two resumed steps, 0.47 fp16 ulp after five).
Bitwise equality is a claim about two computations on one machine, so each test compares zeroshard
with this module's plain-torch run bit for bit, and DeepSpeed's recorded numbers within a stated
number of ulps of the run's parameter dtype (docs/design.md section 5):

| compared with the recording | fp32 run | bf16 / fp16 run |
|---|---|---|
| masters, moments (ulps at the tensor's largest value) | 8 (measured <= 3.1) | 1 (measured <= 0.47) |
| losses, gradient norms (ulps of the value) | 4 (measured <= 0.77) | 1/16 (measured <= 0.0024) |

measured over ATEN_CPU_CAPABILITY default / avx2 / AVX512 and 1 or 2 threads on this machine.

The plain-torch run is written out from the formulas both engines implement (DeepSpeed's config in
tests/fixtures/deepspeed/model.py): the module computes in the run's dtype from fp32 masters (the
persistent fp32 buffer keeps its dtype, as zeroshard keeps floating buffers), fp16 gradients come
from `loss x scale` and are divided by the scale in fp32, the gradient norm is the 2-norm of all
gradients in named_parameters order, clipping multiplies by clamp(max_norm / (norm + 1e-6), max=1),
AdamW is torch's single-tensor update, and WarmupLR (linear) gives min + (max - min) x i / n at
scheduler iteration i (min at i < 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tests.unit.checkpoint.deepspeed_fixtures import DTYPES, fixture_model

EPS32 = torch.finfo(torch.float32).eps
STATE_ULPS = {"fp32": 8.0, "bf16": 1.0, "fp16": 1.0}  # the table above, per precision mode
VALUE_ULPS = {"fp32": 4.0, "bf16": 1 / 16, "fp16": 1 / 16}


def _eps(precision: str) -> float:
    return torch.finfo(DTYPES[precision]).eps


def ulps_apart(got: torch.Tensor, want: torch.Tensor, precision: str = "fp32") -> float:
    """max |got - want| in ulps of the run's parameter dtype at want's largest magnitude (a
    tensor's elements near zero move with the update's scale, not their own)."""
    scale = _eps(precision) * float(want.abs().max().clamp_min(torch.finfo(torch.float32).tiny))
    return float((got.double() - want.double()).abs().max()) / scale


def assert_within_ulps(got: dict, want: dict, precision: str, kinds=("fp32", "exp_avg", "exp_avg_sq")) -> None:
    """Masters and moments against a recording, within STATE_ULPS[precision]."""
    bound = STATE_ULPS[precision]
    for kind in kinds:
        for name, value in want[kind].items():
            apart = ulps_apart(got[kind][name], value, precision)
            assert apart <= bound, f"{kind} of {name}: {apart:.3g} {precision} ulps from the recording (bound {bound})"


def assert_values_within_ulps(got: list[float], want: list[float], precision: str) -> None:
    """Losses or gradient norms against a recording, within VALUE_ULPS[precision] of each value."""
    bound = VALUE_ULPS[precision]
    assert len(got) == len(want), (got, want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        within = abs(a - b) <= bound * _eps(precision) * abs(b)
        assert within, f"value {i}: {a!r} vs recorded {b!r} (bound {bound} {precision} ulps)"


def assert_bitwise(got: dict, want: dict, kinds=("fp32", "exp_avg", "exp_avg_sq")) -> None:
    for kind in kinds:
        for name, value in want[kind].items():
            assert torch.equal(got[kind][name], value), f"{kind} of {name}: not bitwise the torch reference"


@dataclass
class TorchRun:
    """A plain-torch run's state: masters and AdamW moments by parameter name, per-step records."""

    fp32: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    adam_step: int  # AdamW's step count before the next step
    iteration: int  # WarmupLR's last_batch_iteration before the next step
    steps: list[dict] = field(default_factory=list)  # loss, grad_norm, scale per step

    def state(self) -> dict:
        return {"fp32": self.fp32, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


def from_recorded(at_save: dict) -> TorchRun:
    """Start from what DeepSpeed recorded at its save (bitwise what zeroshard loads)."""
    clone = {k: {n: t.clone() for n, t in at_save[k].items()} for k in ("fp32", "exp_avg", "exp_avg_sq")}
    iteration = int(at_save["lr_scheduler"]["last_batch_iteration"])
    return TorchRun(**clone, adam_step=int(at_save["step"]), iteration=iteration)


def from_scratch(precision: str) -> TorchRun:
    """The fixture model's initial weights as masters (rounded to the parameter dtype first, as a
    16-bit model's masters are made from its 16-bit parameters), zero moments."""
    dtype = DTYPES[precision]
    net = fixture_model().make_model()
    masters = {n: p.detach().to(dtype).float() for n, p in net.named_parameters()}
    zeros = {n: torch.zeros_like(t) for n, t in masters.items()}
    return TorchRun(masters, zeros, {n: t.clone() for n, t in zeros.items()}, adam_step=0, iteration=-1)


def _warmup_lr(iteration: int, params: dict) -> float:
    low, high, n = params["warmup_min_lr"], params["warmup_max_lr"], params["warmup_num_steps"]
    if iteration < 0:
        return low
    return low + (high - low) * min(iteration / n, 1.0)


def train(run: TorchRun, precision: str, steps: range, halve_loss_at: frozenset[int] = frozenset(),
          scale_for=lambda step: 1.0) -> TorchRun:
    """Optimizer steps `steps` of the fixture model (batch(step, 0, 1)), one micro-batch each, as
    ds_config(stage, precision, 1) configures them. `scale_for(step)`: the fp16 loss scale (a
    power of two: exact either way, kept to compute what the engines compute)."""
    M = fixture_model()
    config = M.ds_config(0, precision, 1)
    hyper, clip = config["optimizer"]["params"], config["gradient_clipping"]
    (beta1, beta2), eps, decay = hyper["betas"], hyper["eps"], hyper["weight_decay"]
    dtype = DTYPES[precision]
    net = M.make_model()
    names = [n for n, _ in net.named_parameters()]
    for p in net.parameters():  # parameters in the run's dtype; the buffer stays fp32
        p.data = p.data.to(dtype)
    for step in steps:
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(run.fp32[n].to(dtype))
        net.zero_grad(set_to_none=True)
        x, y = M.batch(step, 0, 1, dtype)
        loss = net(x, y)
        scale = scale_for(step)
        ((loss * 0.5 if step in halve_loss_at else loss) * scale).backward()
        grads = {n: p.grad.float() / scale for n, p in net.named_parameters()}
        norm = torch.cat([grads[n].reshape(-1) for n in names]).pow(2).sum().sqrt()
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        lr = _warmup_lr(run.iteration, config["scheduler"]["params"])
        run.adam_step += 1
        t = run.adam_step
        for n in names:
            grad, master, m, v = grads[n] * coef, run.fp32[n], run.exp_avg[n], run.exp_avg_sq[n]
            master.mul_(1 - lr * decay)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
            master.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        run.iteration += 1
        run.steps.append({"loss": float(loss.detach()), "grad_norm": float(norm), "scale": scale})
    return run
