"""Loss scaling for fp16: no-op, static, DeepSpeed-style dynamic, and torch GradScaler-style.

The engine multiplies the loss by `scaler.scale` before backward, divides the gradients by
it before the optimizer step, and calls `scaler.update(overflow)` exactly once per optimizer
step (at the accumulation boundary), with `overflow` already agreed across ranks. A scaler
only decides the next scale; skipping the step on overflow is the engine's job.

`DynamicScaler` reproduces DeepSpeed's `DynamicLossScaler` (the scaler its ZeRO stages use)
step for step, so a DeepSpeed fp16 config gives the same scale trajectory:

- Overflow: while the hysteresis counter is above 1 it is decremented and the scale is kept;
  once it is 1 (or `hysteresis` itself is 1) the scale halves, clamped at `min_scale`. The
  counter is *not* refilled by a halving, so later overflows keep halving until it is.
  At `min_scale` with the counter exhausted there is nothing left to lower: DeepSpeed stops
  training with an error there, and so does this class unless `raise_at_min_scale=False`.
- Clean step: the scale doubles on the clean step whose distance from the last overflow,
  minus one, is a positive multiple of `window`. Counting from the start (as if an overflow
  happened at step -1) this is the `window + 1`-th clean step, then every `window` more.
  The doubling refills the hysteresis counter. With `consecutive_hysteresis` every clean
  step refills it instead, so only overflows in a row count towards a halving.

`AmpScaler` reproduces `torch.amp.GradScaler`'s update rule with its default arguments,
which is what DeepSpeed uses for `torch_autocast` with fp16: it doubles after
`growth_interval` clean steps in a row (the 2000th, not the 2001st), halves on every overflow
with no hysteresis and no floor.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AmpScaler",
    "DynamicScaler",
    "LossScaler",
    "MinLossScaleError",
    "NoOpScaler",
    "StaticScaler",
    "make_loss_scaler",
]

# torch.amp.GradScaler keeps its scale in a float32 tensor and refuses a growth that would
# make it infinite; reproducing that bound keeps the two trajectories identical.
_FLOAT32_MAX = 3.4028234663852886e38


@runtime_checkable
class LossScaler(Protocol):
    """What the engine needs from a loss scaler."""

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward (1.0 when not scaling)."""
        ...

    @property
    def dynamic(self) -> bool:
        """Whether `update` can change `scale`."""
        ...

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome; called once per step, on every rank alike."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The state that must survive a checkpoint (plain Python numbers)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        ...


class MinLossScaleError(RuntimeError):
    """Gradients overflowed while the loss scale was already at its floor."""


def _check_kind(state: dict[str, Any], expected: str) -> None:
    kind = state.get("kind")
    if kind != expected:
        raise ValueError(
            f"loss scaler state has kind={kind!r} but this run uses a {expected!r} loss scaler. "
            "The checkpoint was saved with another fp16 loss-scale setting: use the same "
            "fp16.loss_scale setting as the run that saved it."
        )


def _positive_finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: must be a number.")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a finite number greater than 0.")
    return float(value)


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an integer of at least 1.")
    return value


class NoOpScaler:
    """Scale 1, never changes: fp32, bf16 and autocast-bf16 runs."""

    dynamic = False

    @property
    def scale(self) -> float:
        return 1.0

    def update(self, overflow: bool) -> None:
        # Nothing to adjust; whether to skip the step on a non-finite gradient is the
        # engine's decision (bf16.check_grad_overflow), not the scaler's.
        del overflow

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "none"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, "none")

    def __repr__(self) -> str:
        return "NoOpScaler()"


class StaticScaler:
    """A fixed scale (fp16 with `fp16.loss_scale` > 0). Overflowed steps are still skipped."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        self._scale = _positive_finite("fp16.loss_scale", scale)

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        del overflow

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "static", "scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The configured scale wins over the saved one, as the config is what the user asked
        # for in this run; the saved value only has to be of the same kind.
        _check_kind(state, "static")

    def __repr__(self) -> str:
        return f"StaticScaler(scale={self._scale})"


class DynamicScaler:
    """DeepSpeed's dynamic loss scaler (see the module docstring for the exact rule).

    Args:
        init_scale: First scale (DeepSpeed: 2**fp16.initial_scale_power).
        window: Clean steps between doublings (fp16.loss_scale_window).
        hysteresis: Overflows tolerated before the first halving (fp16.hysteresis).
        min_scale: Floor of the scale (fp16.min_loss_scale).
        consecutive_hysteresis: Refill the hysteresis counter on every clean step
            (fp16.consecutive_hysteresis).
        raise_at_min_scale: Raise `MinLossScaleError` when an overflow would lower a scale
            that is already at `min_scale`, as DeepSpeed's ZeRO optimizers do.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float,
        window: int,
        hysteresis: int,
        min_scale: float,
        consecutive_hysteresis: bool = False,
        *,
        raise_at_min_scale: bool = True,
    ) -> None:
        self._scale = _positive_finite("fp16 initial loss scale", init_scale)
        self.window = _positive_int("fp16.loss_scale_window", window)
        self.hysteresis = _positive_int("fp16.hysteresis", hysteresis)
        self.min_scale = _positive_finite("fp16.min_loss_scale", min_scale)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_at_min_scale = raise_at_min_scale
        # Steps seen so far, and the step of the last overflow; -1 makes the start count as
        # an overflow, which is where DeepSpeed's "window + 1 clean steps" comes from.
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.hysteresis_left = self.hysteresis

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self._scale == self.min_scale and self.raise_at_min_scale:
                    raise MinLossScaleError(
                        f"fp16 gradients overflowed at step {self.iteration} with the loss "
                        f"scale already at fp16.min_loss_scale={self.min_scale}: it cannot be "
                        "lowered further, so training stops (DeepSpeed stops here too). "
                        "Look for the source of inf/nan (learning rate, data), lower "
                        "fp16.min_loss_scale, or train in bf16."
                    )
                self._scale = max(self._scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable_steps = self.iteration - self.last_overflow_iteration - 1
            if stable_steps > 0 and stable_steps % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self._scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "dynamic",
            "scale": self._scale,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Only the evolving state is restored; window, hysteresis and min_scale come from
        # this run's config.
        _check_kind(state, "dynamic")
        self._scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.hysteresis_left = int(state["hysteresis_left"])

    def __repr__(self) -> str:
        return (
            f"DynamicScaler(scale={self._scale}, window={self.window}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale}, "
            f"consecutive_hysteresis={self.consecutive_hysteresis})"
        )


class AmpScaler:
    """torch.amp.GradScaler's update rule (fp16 under torch_autocast).

    Args:
        init_scale: First scale (GradScaler's default 2**16).
        growth_interval: Clean steps in a row before doubling (default 2000).
        growth_factor: Factor applied on growth (default 2.0).
        backoff_factor: Factor applied on every overflow (default 0.5).
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ) -> None:
        self._scale = _positive_finite("grad scaler init_scale", init_scale)
        self.growth_interval = _positive_int("grad scaler growth_interval", growth_interval)
        self.growth_factor = _positive_finite("grad scaler growth_factor", growth_factor)
        self.backoff_factor = _positive_finite("grad scaler backoff_factor", backoff_factor)
        self.clean_steps_in_a_row = 0

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        if overflow:
            self._scale *= self.backoff_factor
            self.clean_steps_in_a_row = 0
            return
        self.clean_steps_in_a_row += 1
        if self.clean_steps_in_a_row == self.growth_interval:
            grown = self._scale * self.growth_factor
            if grown <= _FLOAT32_MAX:
                self._scale = grown
            self.clean_steps_in_a_row = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "grad_scaler",
            "scale": self._scale,
            "clean_steps_in_a_row": self.clean_steps_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, "grad_scaler")
        self._scale = float(state["scale"])
        self.clean_steps_in_a_row = int(state["clean_steps_in_a_row"])

    def __repr__(self) -> str:
        return (
            f"AmpScaler(scale={self._scale}, growth_interval={self.growth_interval}, "
            f"growth_factor={self.growth_factor}, backoff_factor={self.backoff_factor})"
        )


def make_loss_scaler(settings: Any) -> NoOpScaler | StaticScaler | DynamicScaler | AmpScaler:
    """Build the scaler a resolved precision plan asks for.

    Args:
        settings: Anything with the attributes of `zeroshard.precision.plan.LossScaleSettings`:
            `kind` ("none" | "static" | "dynamic" | "grad_scaler"), `init_scale`, `window`,
            `hysteresis`, `min_scale`, `consecutive_hysteresis`. For "static" the scale is
            `init_scale`. "grad_scaler" ignores the numbers: DeepSpeed builds its GradScaler
            with torch's defaults whatever the fp16 section says, and so do we.

    Raises:
        ValueError: for an unknown kind or an out-of-range number.
    """
    kind = settings.kind
    if kind == "none":
        return NoOpScaler()
    if kind == "static":
        return StaticScaler(settings.init_scale)
    if kind == "dynamic":
        return DynamicScaler(
            init_scale=settings.init_scale,
            window=settings.window,
            hysteresis=settings.hysteresis,
            min_scale=settings.min_scale,
            consecutive_hysteresis=settings.consecutive_hysteresis,
        )
    if kind == "grad_scaler":
        return AmpScaler()
    raise ValueError(
        f"loss scale kind={kind!r}: unknown. Expected one of 'none', 'static', 'dynamic', "
        "'grad_scaler' (this is set by zeroshard.precision.plan, not by the user)."
    )
