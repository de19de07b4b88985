"""The fabric model (zeroshard/comm/fabric.py): each collective kind's time against the formulas
of docs/simulate.md written out here in float64, the presets, and `--fabric`'s parsing."""

from __future__ import annotations

import pytest

from zeroshard.comm.fabric import PRESETS, Fabric, parse_fabric

GIB = 2**30


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_ring_collectives(kind: str) -> None:
    # 1 GiB over 8 ranks at 100 GB/s and 5 us per step: 7 steps, 7/8 of the buffer on the wire.
    fabric = Fabric("f", bus_gbps=100.0, latency_us=5.0)
    assert fabric.seconds(kind, GIB, 8) == pytest.approx(7 * 5e-6 + GIB * 7 / 8 / 100e9, rel=1e-12)


def test_all_reduce_broadcast_barrier() -> None:
    fabric = Fabric("f", bus_gbps=50.0, latency_us=10.0)
    assert fabric.seconds("all_reduce", GIB, 64) == pytest.approx(2 * 63 * 10e-6 + 2 * GIB * 63 / 64 / 50e9, rel=1e-12)
    assert fabric.seconds("broadcast", GIB, 64) == pytest.approx(63 * 10e-6 + GIB / 50e9, rel=1e-12)
    assert fabric.seconds("barrier", 0, 64) == pytest.approx(2 * 63 * 10e-6, rel=1e-12)


def test_group_of_one_takes_no_time() -> None:
    assert PRESETS["ib"].seconds("all_reduce", GIB, 1) == 0.0


def test_time_grows_with_bytes_and_ranks() -> None:
    ib = PRESETS["ib"]
    assert ib.seconds("all_gather", 2 * GIB, 8) > ib.seconds("all_gather", GIB, 8)
    assert ib.seconds("all_gather", GIB, 512) > ib.seconds("all_gather", GIB, 8)
    assert PRESETS["nvlink"].seconds("all_gather", GIB, 8) < ib.seconds("all_gather", GIB, 8)


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="collective kind 'gather'"):
        PRESETS["ib"].seconds("gather", 1, 2)


def test_parse_presets_and_custom() -> None:
    assert parse_fabric("nvlink") is PRESETS["nvlink"]
    assert parse_fabric(" ib ") is PRESETS["ib"]
    assert parse_fabric("roce=25,12.5") == Fabric("roce", 25.0, 12.5)


@pytest.mark.parametrize(
    "text, message",
    [
        ("ethernet", "not a preset"),
        ("roce=25", "not a preset"),
        ("roce=fast,12", "must be numbers"),
        ("roce=0,12", "bandwidth 0.0 GB/s must be a positive number"),
        ("roce=25,-1", "latency -1.0 us must be a number >= 0"),
    ],
)
def test_parse_errors_name_the_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_fabric(text)
    assert "--fabric" in str(info.value) and "roce=25,12" in str(info.value)
