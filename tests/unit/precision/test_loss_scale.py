"""Loss scalers: exact scale trajectories for sequences of clean and overflowed steps.

The dynamic trajectories are worked out by hand from DeepSpeed's DynamicLossScaler rule
(documented in zeroshard/precision/loss_scale.py); the GradScaler-style one is checked against torch's
own `_amp_update_scale_` kernel. Scales are powers of two (or clamped to a given floor), so
every comparison is exact.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from zeroshard.precision.loss_scale import (
    AmpScaler,
    DynamicScaler,
    LossScaler,
    MinLossScaleError,
    NoOpScaler,
    StaticScaler,
    make_loss_scaler,
)

ok, inf = False, True  # a clean step, a step whose gradients overflowed


def trajectory(scaler: LossScaler, steps: list[bool]) -> list[float]:
    """The scale after each update."""
    scales = []
    for overflow in steps:
        scaler.update(overflow)
        scales.append(scaler.scale)
    return scales


# Four clean steps, three overflows, four clean, overflow, clean, overflow.
MIXED = [ok, ok, ok, ok, inf, inf, inf, ok, ok, ok, ok, inf, ok, inf]


def test_dynamic_hysteresis_2_window_3() -> None:
    scaler = DynamicScaler(init_scale=8, window=3, hysteresis=2, min_scale=1)
    assert scaler.dynamic and scaler.scale == 8.0
    # Steps 0-2 are clean but the start counts as an overflow at step -1, so the first
    # doubling is on the 4th clean step (stable interval 3). Step 4's overflow only uses up
    # hysteresis; steps 5 and 6 halve (a halving does not refill the counter). Steps 7-10
    # are clean and step 10 doubles and refills. Step 11 uses up hysteresis again; the clean
    # step 12 does not refill it (not at a window boundary), so step 13 halves.
    assert trajectory(scaler, MIXED) == [8, 8, 8, 16, 16, 8, 4, 4, 4, 4, 8, 8, 8, 4]


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    scaler = DynamicScaler(8, window=3, hysteresis=2, min_scale=1, consecutive_hysteresis=True)
    # Same as above up to step 12, whose clean step now refills the counter, so the
    # overflow at step 13 only uses up hysteresis instead of halving.
    assert trajectory(scaler, MIXED) == [8, 8, 8, 16, 16, 8, 4, 4, 4, 4, 8, 8, 8, 8]


def test_hysteresis_1_halves_on_every_overflow() -> None:
    scaler = DynamicScaler(64, window=2, hysteresis=1, min_scale=1)
    # 64 -> 32 -> 16; clean steps 2, 3 (stable 0, 1), step 4 is stable 2 -> 32; step 5
    # halves to 16.
    assert trajectory(scaler, [inf, inf, ok, ok, ok, inf]) == [32, 16, 16, 16, 32, 16]


def test_hysteresis_counts_only_overflows_between_window_boundaries() -> None:
    scaler = DynamicScaler(16, window=100, hysteresis=3, min_scale=1)
    # Without consecutive_hysteresis, clean steps between overflows do not refill: the
    # third overflow halves even though clean steps came in between.
    assert trajectory(scaler, [inf, ok, inf, ok, inf, inf]) == [16, 16, 16, 16, 8, 4]


def test_window_1_doubles_every_clean_step_after_the_first() -> None:
    scaler = DynamicScaler(1, window=1, hysteresis=2, min_scale=1)
    assert trajectory(scaler, [ok, ok, ok, ok]) == [1, 2, 4, 8]


def test_deepspeed_defaults_double_on_the_1001st_clean_step() -> None:
    scaler = DynamicScaler(2.0**16, window=1000, hysteresis=2, min_scale=1)
    trajectory(scaler, [ok] * 1000)
    assert scaler.scale == 2.0**16
    scaler.update(False)
    assert scaler.scale == 2.0**17
    trajectory(scaler, [ok] * 999)
    assert scaler.scale == 2.0**17
    scaler.update(False)
    assert scaler.scale == 2.0**18


def test_scale_is_clamped_at_min_scale_then_raises_like_deepspeed() -> None:
    scaler = DynamicScaler(3, window=10, hysteresis=1, min_scale=2)
    scaler.update(True)
    assert scaler.scale == 2.0  # max(3 / 2, 2)
    with pytest.raises(MinLossScaleError, match=r"fp16\.min_loss_scale=2\.0"):
        scaler.update(True)


def test_min_scale_without_raising_stays_at_the_floor() -> None:
    scaler = DynamicScaler(4, window=10, hysteresis=1, min_scale=1, raise_at_min_scale=False)
    assert trajectory(scaler, [inf, inf, inf, inf]) == [2, 1, 1, 1]


def test_overflow_at_min_scale_with_hysteresis_left_does_not_raise() -> None:
    scaler = DynamicScaler(1, window=10, hysteresis=2, min_scale=1)
    scaler.update(True)  # uses up hysteresis, nothing to lower yet
    assert scaler.scale == 1.0
    with pytest.raises(MinLossScaleError):
        scaler.update(True)


def test_dynamic_state_dict_resumes_the_same_trajectory() -> None:
    uninterrupted = DynamicScaler(8, window=3, hysteresis=2, min_scale=1)
    expected = trajectory(uninterrupted, MIXED)

    first = DynamicScaler(8, window=3, hysteresis=2, min_scale=1)
    head = trajectory(first, MIXED[:6])
    state = first.state_dict()
    assert state == {
        "kind": "dynamic",
        "scale": 8.0,
        "iteration": 6,
        "last_overflow_iteration": 5,
        "hysteresis_left": 1,
    }
    resumed = DynamicScaler(8, window=3, hysteresis=2, min_scale=1)
    resumed.load_state_dict(state)
    assert head + trajectory(resumed, MIXED[6:]) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0}, "initial loss scale"),
        ({"init_scale": float("inf")}, "initial loss scale"),
        ({"window": 0}, r"fp16\.loss_scale_window=0"),
        ({"hysteresis": 0}, r"fp16\.hysteresis=0"),
        ({"min_scale": -1}, r"fp16\.min_loss_scale=-1"),
    ],
)
def test_dynamic_rejects_out_of_range_settings(kwargs: dict, message: str) -> None:
    args = {"init_scale": 8, "window": 3, "hysteresis": 2, "min_scale": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        DynamicScaler(**args)


def test_noop_and_static_never_change() -> None:
    noop, static = NoOpScaler(), StaticScaler(128)
    assert not noop.dynamic and not static.dynamic
    assert trajectory(noop, MIXED) == [1.0] * len(MIXED)
    assert trajectory(static, MIXED) == [128.0] * len(MIXED)
    with pytest.raises(ValueError, match=r"fp16\.loss_scale=-4"):
        StaticScaler(-4)


def test_amp_scaler_defaults_are_grad_scalers() -> None:
    ours, torchs = AmpScaler(), torch.amp.GradScaler("cpu")
    assert ours.scale == torchs.get_scale() == 2.0**16
    assert ours.growth_interval == torchs.get_growth_interval() == 2000
    assert ours.backoff_factor == torchs.get_backoff_factor() == 0.5
    assert ours.growth_factor == torchs.get_growth_factor() == 2.0


def test_amp_scaler_doubles_on_the_growth_interval_th_clean_step() -> None:
    scaler = AmpScaler(init_scale=4, growth_interval=3)
    # No hysteresis, no floor, and growth after exactly 3 clean steps in a row.
    steps = [ok, ok, ok, inf, inf, ok, ok, inf, ok, ok, ok]
    assert trajectory(scaler, steps) == [4, 4, 8, 4, 2, 2, 2, 1, 1, 1, 2]


def test_amp_scaler_matches_torch_amp_update_kernel() -> None:
    rng = random.Random(0)
    steps = [rng.random() < 0.3 for _ in range(300)]
    scaler = AmpScaler(init_scale=2.0**10, growth_interval=4)
    scale = torch.full((1,), 2.0**10)
    growth_tracker = torch.zeros(1, dtype=torch.int32)
    for overflow in steps:
        scaler.update(overflow)
        found_inf = torch.full((1,), float(overflow))
        torch._amp_update_scale_(scale, growth_tracker, found_inf, 2.0, 0.5, 4)
        assert scaler.scale == scale.item()
        assert scaler.clean_steps_in_a_row == growth_tracker.item()


def test_amp_scaler_state_dict_round_trip() -> None:
    scaler = AmpScaler(init_scale=16, growth_interval=3)
    trajectory(scaler, [ok, ok, inf, ok])
    resumed = AmpScaler(init_scale=16, growth_interval=3)
    resumed.load_state_dict(scaler.state_dict())
    assert trajectory(resumed, [ok, ok, ok]) == trajectory(scaler, [ok, ok, ok]) == [8, 16, 16]


def settings(kind: str, **overrides) -> SimpleNamespace:
    values = dict(
        kind=kind,
        init_scale=2.0**16,
        window=1000,
        hysteresis=2,
        min_scale=1.0,
        consecutive_hysteresis=False,
    )
    return SimpleNamespace(**(values | overrides))


def test_make_loss_scaler_builds_each_kind() -> None:
    assert isinstance(make_loss_scaler(settings("none")), NoOpScaler)

    static = make_loss_scaler(settings("static", init_scale=512.0))
    assert isinstance(static, StaticScaler) and static.scale == 512.0

    dynamic = make_loss_scaler(settings("dynamic", init_scale=8.0, window=3, consecutive_hysteresis=True))
    assert isinstance(dynamic, DynamicScaler)
    assert (dynamic.scale, dynamic.window, dynamic.hysteresis) == (8.0, 3, 2)
    assert dynamic.min_scale == 1.0 and dynamic.consecutive_hysteresis

    # DeepSpeed builds torch's GradScaler with its defaults whatever fp16 says.
    amp = make_loss_scaler(settings("grad_scaler", init_scale=8.0, window=3))
    assert isinstance(amp, AmpScaler) and amp.scale == 2.0**16 and amp.growth_interval == 2000

    for scaler in (static, dynamic, amp):
        assert isinstance(scaler, LossScaler)


def test_make_loss_scaler_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind='bogus': unknown"):
        make_loss_scaler(settings("bogus"))


def test_loading_another_kinds_state_is_refused() -> None:
    with pytest.raises(ValueError, match="kind='static'.*'dynamic'"):
        DynamicScaler(8, 3, 2, 1).load_state_dict(StaticScaler(4).state_dict())
