"""DeepSpeed's warmup schedules: lrs for the first steps worked out by hand, and the errors.

Expected values are written as the formula they come from. Comparisons use
pytest.approx(rel=1e-12) because the log warmup computes 1/log(n) * log(k), whose float
rounding differs in the last bit from the quotient written here; everything else is exact.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from zeroshard.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

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

    from zeroshard.schedulers import WarmupDecayLR

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
