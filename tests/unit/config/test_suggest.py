"""The one "did you mean" hint (zeroshard/config/suggest.py) and that every unknown-name
message uses it: no other module of zeroshard calls difflib."""

from __future__ import annotations

from pathlib import Path

import zeroshard
from zeroshard.config.suggest import did_you_mean

PACKAGE_DIR = Path(zeroshard.__file__).parent


def test_the_closest_choice() -> None:
    assert did_you_mean("gradient_clippin", ["gradient_clipping", "fp16"]) == " Did you mean 'gradient_clipping'?"


def test_a_choice_equal_but_for_case() -> None:
    # difflib's ratio of "WARMUPLR" and "WarmupLR" is below its 0.6 cutoff: the case match is the hint.
    assert did_you_mean("WARMUPLR", ["WarmupLR", "OneCycle"], known=None) == " Did you mean 'WarmupLR'?"


def test_without_a_close_choice_the_sorted_list_or_nothing() -> None:
    assert did_you_mean("zzz", ["b", "a"]) == " Known keys here: a, b."
    assert did_you_mean("zzz", ["b", "a"], known="Known keys") == " Known keys: a, b."
    assert did_you_mean("zzz", ["b", "a"], known=None) == ""


def test_no_other_copy() -> None:
    copies = [
        str(p.relative_to(PACKAGE_DIR)) for p in PACKAGE_DIR.rglob("*.py")
        if p.name != "suggest.py" and "get_close_matches" in p.read_text(encoding="utf-8")
    ]
    assert copies == []
