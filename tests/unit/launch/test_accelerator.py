"""DeepSpeed's `get_accelerator()`, `move_to_device` and `log_dist` under zeroshard (issue 24,
item 1). The expected answers are DeepSpeed 0.19.8's on this CPU machine (its CPU accelerator,
run in /tmp/dsvenv: device_name() and device_name(0) are "cpu", the backend "gloo"), and
DeepSpeed's source for `move_to_device` and `log_dist` (runtime/utils.py, utils/logging.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from zeroshard.accelerator import get_accelerator
from zeroshard.launch.device import move_to_device
from zeroshard.utils import log_dist


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answers; a GPU gives cuda:N")
def test_cpu_accelerator_answers_as_deepspeeds() -> None:
    accel = get_accelerator()
    assert accel is get_accelerator()
    assert (accel.device_name(), accel.device_name(0), accel.current_device_name()) == ("cpu", "cpu", "cpu")
    assert accel.communication_backend_name() == "gloo"
    assert accel.is_bf16_supported() and accel.is_fp16_supported() and accel.current_device() == 0
    assert accel.on_accelerator(torch.zeros(1))


def test_move_to_device_keeps_containers_and_moves_in_place_with_a_criterion() -> None:
    t = torch.ones(2, dtype=torch.float64)
    out = move_to_device({"a": [t, (t,)]}, "cpu")
    assert isinstance(out["a"], list) and isinstance(out["a"][1], tuple) and torch.equal(out["a"][0], t)
    moved = move_to_device([t], torch.device("cpu"), criterion_func=torch.is_tensor)
    assert moved[0] is t  # moved in place: the same tensor object (DeepSpeed replaces its .data)
    with pytest.raises(AttributeError):  # DeepSpeed's rule: what the criterion refuses is still .to()-ed
        move_to_device(["x"], "cpu", criterion_func=torch.is_tensor)


def test_log_dist_without_a_process_group_logs_as_rank_minus_one(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        log_dist("hello", ranks=[0])
        log_dist("quiet", ranks=[3], level=logging.DEBUG)
    assert [r.getMessage() for r in caplog.records] == ["[Rank -1] hello"]
