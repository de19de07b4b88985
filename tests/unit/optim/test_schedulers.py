"""DeepSpeed's warmup schedules: lrs for the first steps worked out by hand, and the errors.

Expected values are written as the formula they come from. Comparisons use
pytest.approx(rel=1e-12) because the log warmup computes 1/log(n) * log(k), whose float
rounding differs in the last bit from the quotient written here; everything else is exact.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from zeroshard.optim.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

REL = 1e-12  # a few ulps: the reciprocal-then-product order of the log warmup


def sgd(*lrs: float) -> torch.optim.SGD:
    """An SGD optimizer with one param group per lr."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups)


def lrs_over(scheduler, optimizer, steps: int) -> list[float]:
    """The first group's lr after each of `steps` calls to step()."""
    out = []
    for _ in range(steps):
        scheduler.step()
        out.append(optimizer.param_groups[0]["lr"])
        assert scheduler.get_last_lr() == [g["lr"] for g in optimizer.param_groups]
    return out


def test_warmup_lr_log() -> None:
    opt = sgd(0.1)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=4)
    # Construction writes iteration -1's lr (warmup_min_lr) and does not step.
    assert sched.last_batch_iteration == -1
    assert opt.param_groups[0]["lr"] == 0.0 and sched.get_last_lr() == [0.0]
    expected = [
        0.0,  # iteration 0: log(1) = 0
        0.01 * math.log(2) / math.log(4),  # = 0.005
        0.01 * math.log(3) / math.log(4),
        0.01 * math.log(4) / math.log(4),
        0.01,  # past warmup: held at warmup_max_lr
        0.01,
    ]
    assert lrs_over(sched, opt, 6) == pytest.approx(expected, rel=REL)
    assert sched.last_batch_iteration == 5


def test_warmup_lr_linear_and_default_max_is_the_optimizers_lr() -> None:
    opt = sgd(0.1)
    sched = WarmupLR(opt, warmup_min_lr=0.02, warmup_num_steps=4, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.02
    # min + (max - min) * k / 4 with max = 0.1, the lr the optimizer had at construction.
    expected = [0.02, 0.02 + 0.08 * 0.25, 0.02 + 0.08 * 0.5, 0.02 + 0.08 * 0.75, 0.1, 0.1]
    assert lrs_over(sched, opt, 6) == pytest.approx(expected, rel=REL)


def test_warmup_num_steps_is_raised_to_two() -> None:
    opt = sgd(1.0)
    sched = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert sched.warmup_num_steps == 2
    assert lrs_over(sched, opt, 3) == [0.0, 0.5, 1.0]


def test_warmup_lr_per_group_lists() -> None:
    opt = sgd(1.0, 1.0)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.5], warmup_num_steps=2, warmup_type="linear")
    assert sched.get_last_lr() == [0.0, 0.1]
    sched.step()
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.5, 0.1 + 0.4 * 0.5], rel=REL)


def test_warmup_decay_lr() -> None:
    opt = sgd(0.5)
    sched = WarmupDecayLR(opt, total_num_steps=10, warmup_max_lr=0.01, warmup_num_steps=4, warmup_type="linear")
    expected = [
        0.0,
        0.01 * 1 / 4,
        0.01 * 2 / 4,
        0.01 * 3 / 4,
        0.01 * (10 - 4) / 6,  # iteration 4: decay starts at gamma (total - k) / (total - warmup) = 1
        0.01 * (10 - 5) / 6,
        0.01 * (10 - 6) / 6,
        0.01 * (10 - 7) / 6,
        0.01 * (10 - 8) / 6,
        0.01 * (10 - 9) / 6,
        0.0,  # iteration 10 = total_num_steps
        0.0,  # clamped at 0 after the end
    ]
    assert lrs_over(sched, opt, 12) == pytest.approx(expected, rel=REL)


def test_warmup_decay_lr_default_max_is_0_001() -> None:
    opt = sgd(0.5)
    sched = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=2, warmup_type="linear")
    assert lrs_over(sched, opt, 3) == pytest.approx([0.0, 0.0005, 0.001], rel=REL)


def test_warmup_cosine_lr() -> None:
    opt = sgd(0.1)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=10,
        warmup_min_ratio=0.2,
        warmup_num_steps=4,
        cos_min_ratio=0.1,
        warmup_type="linear",
    )
    # Construction writes 0.0, not warmup_min_ratio * lr: DeepSpeed's first optimizer step
    # runs at lr 0.
    assert opt.param_groups[0]["lr"] == 0.0 and sched.org_lrs == [0.1]

    def cosine(progress: float) -> float:
        return 0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2

    expected = [
        0.1 * 0.2,  # iteration 0: warmup_min_ratio
        0.1 * (0.2 + 0.8 * 1 / 4),
        0.1 * (0.2 + 0.8 * 2 / 4),
        0.1 * (0.2 + 0.8 * 3 / 4),
        0.1 * cosine(1 / 6),  # iteration 4: (4 - 4 + 1) / (10 - 4) of the way down
        0.1 * cosine(2 / 6),
        0.1 * cosine(3 / 6),  # = 0.1 * (0.1 + 0.45)
        0.1 * cosine(4 / 6),  # = 0.1 * (0.1 + 0.9 * 0.25)
        0.1 * cosine(5 / 6),
        0.1 * 0.1,  # iteration 9: progress 1, cos_min_ratio
        0.1 * 0.1,  # clamped past the end, not rising again
    ]
    assert lrs_over(sched, opt, 11) == pytest.approx(expected, rel=REL)
    assert expected[6] == pytest.approx(0.055, rel=REL) and expected[7] == pytest.approx(0.0325, rel=REL)


def test_warmup_cosine_log_warmup_defaults() -> None:
    opt = sgd(1.0)
    sched = WarmupCosineLR(opt, total_num_steps=5000)
    assert (sched.warmup_min_ratio, sched.warmup_num_steps, sched.cos_min_ratio) == (0.0, 1000, 0.0001)
    assert lrs_over(sched, opt, 3) == pytest.approx(
        [0.0, math.log(2) / math.log(1000), math.log(3) / math.log(1000)], rel=REL
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda opt: WarmupLR(opt, warmup_max_lr=0.01, warmup_num_steps=5),
        lambda opt: WarmupDecayLR(opt, total_num_steps=12, warmup_num_steps=5),
        lambda opt: WarmupCosineLR(opt, total_num_steps=12, warmup_num_steps=5),
    ],
)
def test_state_dict_resume_continues_the_schedule(make) -> None:
    opt = sgd(0.1)
    uninterrupted = make(opt)
    expected = lrs_over(uninterrupted, opt, 9)

    opt_a = sgd(0.1)
    first = make(opt_a)
    lrs_over(first, opt_a, 6)
    assert first.state_dict() == {"last_batch_iteration": 5}

    opt_b = sgd(0.1)
    resumed = make(opt_b)
    resumed.load_state_dict(first.state_dict())
    assert resumed.last_batch_iteration == 5
    assert lrs_over(resumed, opt_b, 3) == expected[6:]


def test_resumed_construction_leaves_the_lr_alone() -> None:
    opt = sgd(0.1)
    sched = WarmupLR(opt, warmup_max_lr=0.01, warmup_num_steps=4, last_batch_iteration=5)
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(RuntimeError, match="get_last_lr"):
        sched.get_last_lr()
    sched.step()
    assert sched.get_last_lr() == [0.01]


def test_tensor_lr_is_filled_in_place() -> None:
    lr = torch.tensor(0.1)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=2, warmup_type="linear")
    assert opt.param_groups[0]["lr"] is lr
    sched.step()
    sched.step()
    assert lr.item() == pytest.approx(0.005, rel=1e-6)  # float32 tensor


def test_any_object_with_param_groups_works() -> None:
    wrapper = SimpleNamespace(param_groups=[{"lr": 1.0}])
    sched = WarmupLR(wrapper, warmup_num_steps=2, warmup_type="linear")
    sched.step()
    sched.step()
    assert wrapper.param_groups[0]["lr"] == 0.5
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())


def config(type_: str, **params) -> SimpleNamespace:
    return SimpleNamespace(type=type_, params=params)


def test_build_scheduler_passes_params() -> None:
    opt = sgd(0.1)
    sched = build_scheduler(config("WarmupDecayLR", total_num_steps=20, warmup_max_lr=0.02, warmup_num_steps=10), opt)
    assert isinstance(sched, WarmupDecayLR)
    assert (sched.total_num_steps, sched.max_lrs, sched.warmup_num_steps) == (20, [0.02], 10)
    assert isinstance(build_scheduler(SimpleNamespace(type="WarmupLR", params=None), opt), WarmupLR)


def test_build_scheduler_unknown_type_lists_supported() -> None:
    with pytest.raises(ValueError) as info:
        build_scheduler(config("WarmupLr"), sgd(0.1))
    message = str(info.value)
    assert message.startswith("scheduler.type='WarmupLr': not a supported scheduler.")
    assert "Did you mean 'WarmupLR'?" in message
    assert "Supported: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle." in message


def test_build_scheduler_reports_every_bad_param() -> None:
    with pytest.raises(ValueError) as info:
        build_scheduler(config("WarmupDecayLR", warmup_max_lrr=0.1, warmup_steps=5), sgd(0.1))
    message = str(info.value)
    assert "scheduler.params.warmup_max_lrr: unknown parameter for WarmupDecayLR. Did you mean 'warmup_max_lr'?" in (
        message
    )
    assert "scheduler.params.warmup_steps: unknown parameter" in message
    assert "scheduler.params.total_num_steps: required by WarmupDecayLR" in message


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"warmup_type": "cosine"}, r"scheduler\.params\.warmup_type='cosine': must be 'log' or 'linear'"),
        ({"warmup_num_steps": 0}, r"scheduler\.params\.warmup_num_steps=0: must be a positive integer"),
        ({"warmup_num_steps": 10.5}, r"scheduler\.params\.warmup_num_steps=10\.5"),
        ({"warmup_min_lr": "0"}, r"scheduler\.params\.warmup_min_lr='0': must be a number"),
        ({"warmup_max_lr": [0.1, 0.2]}, r"warmup_max_lr=\[0\.1, 0\.2\]: has 2 values but the optimizer has 1"),
        ({"warmup_max_lr": "auto"}, r"scheduler\.params\.warmup_max_lr='auto'"),
    ],
)
def test_build_scheduler_bad_values_name_the_key(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_scheduler(config("WarmupLR", **params), sgd(0.1))


def test_total_below_warmup_warns() -> None:
    with pytest.warns(UserWarning, match="total_num_steps=5 is less than warmup_num_steps=10"):
        WarmupCosineLR(sgd(0.1), total_num_steps=5, warmup_num_steps=10)


def test_load_state_dict_reports_the_restored_iterations_lr():
    import torch

    from zeroshard.optim.schedulers import WarmupDecayLR

    def make():
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        return WarmupDecayLR(opt, total_num_steps=10, warmup_min_lr=0.0, warmup_max_lr=0.1,
                             warmup_num_steps=4, warmup_type="linear")

    trained = make()
    for _ in range(6):
        trained.step()
    resumed = make()
    resumed.load_state_dict(trained.state_dict())
    assert resumed.get_last_lr() == trained.get_last_lr()


# ---------------------------------------------------------------------------------- OneCycle
def adam(lr: float = 0.5) -> torch.optim.Adam:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def one_cycle_formula(t, lo, hi, first, second, stairs1=0, stairs2=None, decay_rate=0.0, decay_step=0,
                      mom_lo=0.8, mom_hi=0.9, mom_rate=0.0):
    """DeepSpeed's 1Cycle written out: (lr, beta1) at iteration t (t = -1 at construction)."""
    stairs2 = stairs1 if stairs2 is None else stairs2
    if t == -1:
        return lo, mom_lo
    total = first + second
    if t < total:
        pos = (t + 1) % total
        if pos <= first:
            frac = math.floor(pos * stairs1 / first) / stairs1 if stairs1 else pos / first
        else:
            frac = math.floor((total - pos) * stairs2 / second) / stairs2 if stairs2 else (total - pos) / second
        return lo + (hi - lo) * frac, mom_hi - (mom_hi - mom_lo) * frac
    k = t - total + 1
    lr_div = 1 + decay_rate * k / decay_step if decay_step and decay_rate else 1.0
    mom_mul = 1 + mom_rate * k / decay_step if decay_step and mom_rate else 1.0
    return lo / lr_div, mom_hi * mom_mul


def test_one_cycle_by_hand():
    opt = adam()
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=0.6, cycle_first_step_size=2, cycle_second_step_size=3,
                     decay_lr_rate=0.5, decay_step_size=2)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["betas"] == (0.8, 0.99)
    # up in 2 steps, down in 3, then lr = 0.1 / (1 + 0.5 * k / 2) k steps after the cycle
    expected = [0.35, 0.6, 0.1 + 0.5 * 2 / 3, 0.1 + 0.5 / 3, 0.1, 0.1 / 1.25, 0.1 / 1.5]
    assert lrs_over(sched, opt, 7) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lo=0.01, hi=0.1, first=4, second=4, stairs1=2),
        dict(lo=0.01, hi=0.1, first=3, second=5, stairs1=3, stairs2=2),
        dict(lo=0.001, hi=0.01, first=5, second=None, decay_rate=0.3, decay_step=3, mom_rate=0.01),
        dict(lo=0.02, hi=0.05, first=7, second=2, mom_lo=0.85, mom_hi=0.95),
    ],
)
def test_one_cycle_matches_the_formula(kwargs):
    formula_kwargs = dict(kwargs, second=kwargs["second"] or kwargs["first"])
    opt = adam()
    sched = OneCycle(
        opt, cycle_min_lr=kwargs["lo"], cycle_max_lr=kwargs["hi"], cycle_first_step_size=kwargs["first"],
        cycle_second_step_size=kwargs["second"], cycle_first_stair_count=kwargs.get("stairs1", 0),
        cycle_second_stair_count=kwargs.get("stairs2"), decay_lr_rate=kwargs.get("decay_rate", 0.0),
        decay_step_size=kwargs.get("decay_step", 0), cycle_min_mom=kwargs.get("mom_lo", 0.8),
        cycle_max_mom=kwargs.get("mom_hi", 0.9), decay_mom_rate=kwargs.get("mom_rate", 0.0),
    )
    for t in range(-1, 25):
        if t >= 0:
            sched.step()
        lr, beta1 = one_cycle_formula(t, **formula_kwargs)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, rel=REL), t
        assert opt.param_groups[0]["betas"][0] == pytest.approx(beta1, rel=REL), t
        assert opt.param_groups[0]["betas"][1] == 0.99


def test_one_cycle_without_betas_leaves_momentum_alone():
    opt = sgd(0.1)
    with pytest.warns(UserWarning, match="cycle_momentum is off because SGD has no 'betas'"):
        sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=0.2, cycle_first_step_size=2)
    sched.step()
    assert "betas" not in opt.param_groups[0] and sched.get_mom() is None
    assert opt.param_groups[0]["lr"] == pytest.approx(0.15, rel=REL)


def test_one_cycle_resumes_from_its_state_dict():
    def make():
        return OneCycle(opt := adam(), cycle_min_lr=0.1, cycle_max_lr=0.6, cycle_first_step_size=2), opt

    trained, _ = make()
    for _ in range(3):
        trained.step()
    resumed, opt = make()
    resumed.load_state_dict(trained.state_dict())
    resumed.step()
    trained.step()
    assert resumed.get_last_lr() == trained.get_last_lr()
    assert opt.param_groups[0]["betas"] == trained.optimizer.param_groups[0]["betas"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"cycle_max_lr": 0.1}, r"scheduler\.params\.cycle_min_lr: required by OneCycle"),
        ({"cycle_min_lr": 0.1, "cycle_max_lr": "0.2"}, r"cycle_max_lr='0\.2': must be a number"),
        ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_step_size": 0}, r"cycle_first_step_size=0: must be"),
        ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_stair_count": -1}, r"cycle_first_stair_count=-1"),
        ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_momentum": "no"}, r"cycle_momentum='no': must be true"),
        ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_max_mon": 0.9}, r"Did you mean 'cycle_max_mom'\?"),
    ],
)
def test_one_cycle_bad_params(params, message):
    with pytest.raises(ValueError, match=message):
        build_scheduler(config("OneCycle", **params), adam())


def test_one_cycle_from_the_config_through_the_engine():
    import zeroshard

    model = torch.nn.Linear(4, 2)
    engine, optimizer, _, sched = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), dist_init_required=False,
        config={"optimizer": {"type": "AdamW", "params": {"lr": 1.0}},
                "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.6,
                                                             "cycle_first_step_size": 2,
                                                             "cycle_second_step_size": 3}}},
    )
    assert isinstance(sched, OneCycle)
    seen = []
    for _ in range(5):
        seen.append((engine.get_lr()[0], optimizer.param_groups[0]["betas"][0]))
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
    expected = [one_cycle_formula(t, 0.1, 0.6, 2, 3) for t in range(-1, 4)]
    assert seen == [pytest.approx(e, rel=REL) for e in expected]
