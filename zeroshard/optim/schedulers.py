"""DeepSpeed's warmup learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR.

Names, parameters, defaults and arithmetic follow DeepSpeed 0.19 (`deepspeed/runtime/
lr_schedules.py`), so a DeepSpeed config gives the same learning rate at every step. The
points where that behaviour is easy to get wrong:

- Construction does not step. It writes the lr of "iteration -1" into the optimizer:
  `warmup_min_lr` for WarmupLR/WarmupDecayLR and 0.0 for WarmupCosineLR (not
  `warmup_min_ratio * lr`). The engine calls `step()` after each optimizer step, so the first
  optimizer step runs with that construction lr, and the first `step()` moves to iteration 0.
- `warmup_num_steps` is raised to at least 2 (the log warmup divides by log(warmup_num_steps)),
  and every later formula uses the raised value.
- Log warmup: gamma = log(iteration + 1) / log(warmup_num_steps); linear warmup: gamma =
  iteration / warmup_num_steps. Both are 0 at iteration 0.
- WarmupLR's `warmup_max_lr` defaults to each param group's lr at construction (DeepSpeed
  0.19's code; its docstring still says 0.001). WarmupDecayLR's defaults to 0.001.
- WarmupCosineLR scales each group's construction lr by a ratio; after warmup the cosine
  progress is clamped to [0, 1] so the ratio stays at `cos_min_ratio` past `total_num_steps`.
- `state_dict()` holds only `last_batch_iteration`; `load_state_dict` does not touch the
  optimizer's lr (the optimizer's own state dict restores it), exactly as DeepSpeed.

Where DeepSpeed warns and carries on, zeroshard refuses: an unknown `warmup_type` (DeepSpeed
silently uses "log") is a ValueError, and so is a `total_num_steps` that is not positive.
`OneCycle` is DeepSpeed's 1Cycle schedule (see its docstring). Every parameter's rule is in
`_RULES`, the one place both the config validation and the constructors check it.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from zeroshard.config.suggest import did_you_mean

__all__ = ["OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "accepted_params",
           "build_scheduler", "param_problems"]

WARMUP_TYPES = ("log", "linear")


class _ParamError(ValueError):
    """A bad scheduler parameter; `build_scheduler` prefixes the key with `scheduler.params.`."""

    def __init__(self, key: str, value: Any, rule: str) -> None:
        super().__init__(f"{key}={value!r}: {rule}")
        self.key, self.value, self.rule = key, value, rule


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_warmup_num_steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _ParamError("warmup_num_steps", value, "must be a positive integer.")
    return value


def _check_warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise _ParamError("warmup_type", value, "must be 'log' or 'linear'.")
    return value


def _check_number(key: str, value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise _ParamError(key, value, "must be a number.")
    return value


def _check_total_num_steps(value: Any) -> int | float:
    if not _is_number(value) or not value > 0:
        raise _ParamError("total_num_steps", value, "must be a positive number of optimizer steps.")
    return value


def _check_last_batch_iteration(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise _ParamError("last_batch_iteration", value, "must be an integer >= -1 (-1 for a fresh start).")
    return value


def _check_number_or_list(key: str, value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        for item in value:
            if not _is_number(item):
                raise _ParamError(key, value, "must be a number or a list of numbers (one per param group).")
        return value
    return _check_number(key, value)


def _check_positive(key: str, value: Any) -> float:
    if not _is_number(value) or not value > 0:
        raise _ParamError(key, value, "must be a positive number of steps.")
    return value


def _check_count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _ParamError(key, value, "must be an integer >= 0 (0 turns the staircase off).")
    return value


def _check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _ParamError(key, value, "must be true or false.")
    return value


def _optional(check):
    return lambda key, value: None if value is None else check(key, value)


# The rule of every parameter of every schedule: the one place they are checked, by the config
# validation (zeroshard.config.schema) and by the constructors alike.
_RULES: dict[str, Any] = {
    "warmup_min_lr": _check_number_or_list,
    "warmup_max_lr": _optional(_check_number_or_list),
    "warmup_num_steps": lambda key, value: _check_warmup_num_steps(value),
    "warmup_type": lambda key, value: _check_warmup_type(value),
    "last_batch_iteration": lambda key, value: _check_last_batch_iteration(value),
    "total_num_steps": lambda key, value: _check_total_num_steps(value),
    "warmup_min_ratio": _check_number,
    "cos_min_ratio": _check_number,
    "cycle_min_lr": _check_number,
    "cycle_max_lr": _check_number,
    "decay_lr_rate": _check_number,
    "cycle_first_step_size": _check_positive,
    "cycle_second_step_size": _optional(_check_positive),
    "cycle_first_stair_count": _check_count,
    "cycle_second_stair_count": _optional(_check_count),
    "decay_step_size": lambda key, value: _check_decay_step_size(value),
    "cycle_momentum": _check_bool,
    "cycle_min_mom": _check_number,
    "cycle_max_mom": _check_number,
    "decay_mom_rate": _check_number,
}


def _check_decay_step_size(value: Any) -> float:
    if not _is_number(value) or value < 0:
        raise _ParamError("decay_step_size", value, "must be a number >= 0 (0 turns the decay off).")
    return value


def _per_group(key: str, value: Any, num_groups: int) -> list[Any]:
    """A scalar applies to every param group; a list or tuple gives one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise _ParamError(key, value, f"has {len(value)} values but the optimizer has {num_groups} param groups.")
        for item in value:
            _check_number(key, item)
        return list(value)
    return [_check_number(key, value)] * num_groups


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, Sequence) or not all(isinstance(g, dict) and "lr" in g for g in groups):
        raise TypeError(
            f"{type(optimizer).__name__} is not an optimizer: a scheduler needs `param_groups`, "
            "a list of dicts that each hold an 'lr'."
        )
    return list(groups)


def _write_lrs(param_groups: list[dict[str, Any]], lrs: list[Any]) -> list[Any]:
    """Set each group's lr, in place for tensor lrs (so a captured tensor stays valid)."""
    for group, lr in zip(param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far through warmup an iteration is: 0 at iteration 0, 1 at warmup_num_steps."""
    if warmup_type == "log":
        # Written as DeepSpeed writes it (reciprocal, then product) so the float results
        # agree bit for bit.
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


class _Schedule:
    """What the three schedules share: the iteration counter and writing lrs."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.param_groups = _param_groups(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[Any] | None = None

    def get_lr(self) -> list[Any]:
        """The lr of each param group at `last_batch_iteration`."""
        raise NotImplementedError

    def _start(self) -> None:
        # A fresh schedule (not a resumed one) writes its iteration -1 lr at construction.
        if self.last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.param_groups, self.get_lr())

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to `last_batch_iteration`) and write the lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _write_lrs(self.param_groups, self.get_lr())

    def get_last_lr(self) -> list[Any]:
        """The lrs last written to the optimizer, one per param group."""
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__}.get_last_lr(): no lr written yet; a schedule built with "
                "last_batch_iteration != -1 writes its first lr at the first step()."
            )
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # As DeepSpeed, the optimizer's lrs are not rewritten here (a checkpoint restores them
        # with the optimizer); get_last_lr() reports the lr of the restored iteration.
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = self.get_lr()


class WarmupLR(_Schedule):
    """Warm up from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then hold.

    Args:
        optimizer: Any object with torch-style `param_groups`.
        warmup_min_lr: First lr (a number, or one per param group).
        warmup_max_lr: Lr after warmup; None (the default) takes each group's current lr.
        warmup_num_steps: Steps of warmup (raised to at least 2).
        warmup_type: "log" or "linear".
        last_batch_iteration: -1 for a fresh start; a resumed run passes its last iteration.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        num_groups = len(self.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.param_groups]
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, num_groups)
        self.max_lrs = _per_group("warmup_max_lr", warmup_max_lr, num_groups)
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, _check_warmup_num_steps(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        self._start()

    def _gamma(self) -> float:
        """0 at the start of warmup, 1 at its end."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches 0 at `total_num_steps`.

    Args:
        optimizer: Any object with torch-style `param_groups`.
        total_num_steps: Optimizer steps of the whole run.
        warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration: as
            WarmupLR, except that `warmup_max_lr` defaults to 0.001.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _check_total_num_steps(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        _warn_if_total_below_warmup(self.total_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration) / decay_steps)


class WarmupCosineLR(_Schedule):
    """Scale each group's lr: warm up from `warmup_min_ratio` to 1, then a cosine to `cos_min_ratio`.

    Args:
        optimizer: Any object with torch-style `param_groups`; their lrs at construction are
            the peak lrs.
        total_num_steps: Optimizer steps of the whole run (warmup included).
        warmup_min_ratio: Ratio at the first step.
        warmup_num_steps: Steps of warmup (raised to at least 2).
        cos_min_ratio: Ratio at and after `total_num_steps`.
        warmup_type: "log" or "linear".
        last_batch_iteration: -1 for a fresh start; a resumed run passes its last iteration.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _check_total_num_steps(total_num_steps)
        self.warmup_min_ratio = _check_number("warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = _check_number("cos_min_ratio", cos_min_ratio)
        self.warmup_num_steps = max(2, _check_warmup_num_steps(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        _warn_if_total_below_warmup(self.total_num_steps, self.warmup_num_steps)
        self.org_lrs = [
            group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"] for group in self.param_groups
        ]
        self._start()

    def get_lr_ratio(self) -> float:
        """The factor applied to every group's construction lr at `last_batch_iteration`."""
        iteration = self.last_batch_iteration
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        steps_into_decay = iteration - self.warmup_num_steps + 1
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, steps_into_decay / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


def _warn_if_total_below_warmup(total_num_steps: float, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        warnings.warn(
            f"scheduler.params.total_num_steps={total_num_steps} is less than "
            f"warmup_num_steps={warmup_num_steps}: the run ends before warmup does.",
            stacklevel=3,
        )


class OneCycle(_Schedule):
    """DeepSpeed's 1Cycle: lr up from `cycle_min_lr` to `cycle_max_lr` and back, then a decay.

    The cycle has `cycle_first_step_size` rising steps and `cycle_second_step_size` falling
    ones (default: as many as rising). With a stair count n > 0 a half cycle moves in n flat
    stairs instead of every step. After the cycle the lr is `cycle_min_lr / (1 + decay_lr_rate *
    k / decay_step_size)` k steps in (no decay when either is 0). With `cycle_momentum` (and an
    optimizer with `betas`, as Adam's) beta1 moves the other way, from `cycle_max_mom` down to
    `cycle_min_mom` and back, then grows by `(1 + decay_mom_rate * k / decay_step_size)`; beta2
    is set to 0.99, as DeepSpeed does. Without `betas` momentum is not cycled (a warning says so).

    Args: DeepSpeed's, with its defaults; `last_batch_iteration` as WarmupLR's.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, _check_last_batch_iteration(last_batch_iteration))
        # Every argument by its rule in _RULES (the one the config validation applies too).
        for key, value in list(locals().items()):
            if key in _RULES:
                _RULES[key](key, value)
        self.min_lr, self.max_lr = cycle_min_lr, cycle_max_lr
        self.first_size = float(cycle_first_step_size)
        self.second_size = float(cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size)
        self.total_size = self.first_size + self.second_size
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.decay_lr_rate, self.decay_mom_rate = decay_lr_rate, decay_mom_rate
        self.min_mom, self.max_mom = cycle_min_mom, cycle_max_mom
        defaults = getattr(optimizer, "defaults", {})
        self.cycle_momentum = cycle_momentum and "betas" in defaults
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(
                f"OneCycle: cycle_momentum is off because {type(optimizer).__name__} has no 'betas' "
                "(as in DeepSpeed); set scheduler.params.cycle_momentum=false to silence this.",
                stacklevel=2,
            )
        if self.last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.param_groups, [self.min_lr] * len(self.param_groups))
            if self.cycle_momentum:
                for group in self.param_groups:
                    group["betas"] = (self.min_mom, 0.99)

    def _fraction(self) -> float:
        """How far up the cycle the next iteration is: 0 at the bottom, 1 at the peak."""
        iteration = self.last_batch_iteration + 1
        position = iteration % self.total_size  # steps into the current cycle
        rising = position <= self.first_size
        stairs = self.first_stairs if rising else self.second_stairs
        if rising:
            steps, size = position, self.first_size
        else:
            steps, size = self.total_size - position, self.second_size
        if stairs > 0:
            return math.floor(steps * stairs / size) / stairs
        return steps / size

    def _decay_divisor(self, rate: float) -> float:
        steps_after_cycle = self.last_batch_iteration - self.total_size + 1
        if self.decay_step_size == 0 or rate == 0:
            return 1.0
        return 1.0 + rate * steps_after_cycle / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._fraction()
        else:
            lr = self.min_lr / self._decay_divisor(self.decay_lr_rate)
        return [lr] * len(self.param_groups)

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's betas at `last_batch_iteration`; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            beta1 = self.max_mom - (self.max_mom - self.min_mom) * self._fraction()
        else:
            beta1 = self.max_mom * self._decay_divisor(self.decay_mom_rate)
        return [(beta1, 0.99)] * len(self.param_groups)

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        momenta = self.get_mom()
        if momenta is not None:
            for group, betas in zip(self.param_groups, momenta, strict=True):
                group["betas"] = betas


SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
}
# DeepSpeed's `deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`: the schedule class names
# (Accelerate recognises a DeepSpeed schedule object by its class name in this list). DeepSpeed
# also lists LRRangeTest, which zeroshard does not implement.
VALID_LR_SCHEDULES = list(SCHEDULERS)


def _accepted_params(cls: type[_Schedule]) -> dict[str, inspect.Parameter]:
    params = dict(inspect.signature(cls.__init__).parameters)
    del params["self"], params["optimizer"]
    return params


def accepted_params(name: str) -> dict[str, inspect.Parameter]:
    """The parameters schedule `name` takes (its constructor's, less the optimizer)."""
    return _accepted_params(SCHEDULERS[name])


def param_problems(name: str, params: dict[str, Any]) -> list[tuple[str, str, Any, str]]:
    """Every problem of a schedule's parameters, checked without an optimizer.

    Returns:
        ``(kind, key, value, rule)`` tuples, kind "unknown", "missing" or "value"; the
        config validation and `build_scheduler` each render them in their own words.
    """
    accepted = accepted_params(name)
    problems: list[tuple[str, str, Any, str]] = []
    for key, value in params.items():
        if key not in accepted:
            problems.append(("unknown", key, value, did_you_mean(key, accepted, known=None)))
            continue
        if isinstance(value, str) and value.strip().lower() == "auto":
            problems.append(("value", key, value, "zeroshard does not fill in 'auto' values; write the number."))
            continue
        try:
            _RULES[key](key, value)
        except _ParamError as error:
            problems.append(("value", key, value, error.rule))
    for key, param in accepted.items():
        if param.default is inspect.Parameter.empty and key not in params:
            problems.append(("missing", key, None, f"required by {name}; add it."))
    return problems


def build_scheduler(config: Any, optimizer: Any) -> _Schedule:
    """Build the schedule a config's `scheduler` section names.

    Args:
        config: Has `.type` (a schedule name, as DeepSpeed spells it) and `.params` (a dict of
            that schedule's keyword arguments, or None).
        optimizer: The optimizer whose param groups' lrs the schedule sets.

    Raises:
        ValueError: naming `scheduler.type` or every bad `scheduler.params.<key>` at once.
    """
    name = config.type
    cls = SCHEDULERS.get(name)
    if cls is None:
        supported = ", ".join(SCHEDULERS)
        raise ValueError(
            f"scheduler.type={name!r}: not a supported scheduler.{did_you_mean(str(name), SCHEDULERS, known=None)}"
            f" Supported: {supported}."
        )
    params = dict(config.params or {})
    accepted = ", ".join(accepted_params(name))
    problems = []
    for kind, key, value, rule in param_problems(name, params):
        if kind == "unknown":
            problems.append(f"scheduler.params.{key}: unknown parameter for {name}.{rule} {name} takes: {accepted}.")
        elif kind == "missing":
            problems.append(f"scheduler.params.{key}: {rule}")
        else:
            problems.append(f"scheduler.params.{key}={value!r}: {rule}")
    if problems:
        raise ValueError(problems[0] if len(problems) == 1 else "invalid scheduler config:\n  " + "\n  ".join(problems))
    try:
        return cls(optimizer, **params)
    except _ParamError as error:
        raise ValueError(f"scheduler.params.{error}") from None
