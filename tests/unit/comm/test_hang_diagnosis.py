"""The hang watchdog's decisions and texts from records written by hand (zeroshard/comm/diagnosis.py),
its timeouts (zeroshard/comm/watchdog.py) and the config keys that set them. No process group:
the multi-process behaviour is tests/dist/comm/test_hang_watchdog.py."""

from __future__ import annotations

import pickle

import pytest

from zeroshard.comm import diagnosis
from zeroshard.comm.channels import group_key
from zeroshard.comm.faults import CollectiveError, HangError
from zeroshard.comm.watchdog import resolve_timeouts
from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config


def entry(seq, op, tag, phase, channel, index, *, step=1, micro=1, unit=None, numel=8, dtype="float32", size=2):
    return {"seq": seq, "op": op, "tag": tag, "unit": unit, "numel": numel, "dtype": dtype, "group": "0-1",
            "group_size": size, "channel": channel, "index": index, "phase": phase, "step": step,
            "micro_step": micro, "issued": 0.0, "waited": 0.0, "done": None}


def record(rank, state, current=None, issued=None, *, waited=None, step=1, first_step=False, last_call=None,
           calls=(), failure=None, hb=5):
    return {"rank": rank, "hb": hb, "state": state, "waited": waited, "current": current,
            "issued": issued or {}, "calls": list(calls), "step": step, "micro": 1, "last_call": last_call,
            "first_step": first_step, "failure": failure, "hang_timeout_s": 3.0, "first_step_timeout_s": 10.0}


# Rank 1 skipped step() at stage 2: rank 0 waits in the norm on the step channel, rank 1 in its
# next backward's reduce-scatter on the backward channel; neither channel has both.
NORM = entry(9, "all_reduce", "norm", "step", "step@0-1", 2, numel=8)
GRAD = entry(9, "reduce_scatter", "grad", "reduction", "backward@0-1", 3, numel=1244, unit="<root>")
SKIPPED = {
    0: record(0, "waiting", NORM, {"step@0-1": 2, "backward@0-1": 2}, waited=1.8),
    1: record(1, "waiting", GRAD, {"step@0-1": 1, "backward@0-1": 3}, waited=1.7),
}
SHARED = [entry(i, "reduce_scatter", "grad", "reduction", "backward@0-1", 1, step=0, micro=0, numel=1244)
          for i in range(1, 9)]
SKIPPED_RINGS = {0: [*SHARED, ["call", "step", "start", 1, 1, 0.0, 8], NORM], 1: [*SHARED, GRAD]}
SETTINGS = {"hang_timeout_s": 3.0, "collective_timeout_s": 30.0}


def test_ranks_text_joins_runs():
    assert diagnosis.ranks_text([3]) == "rank 3"
    assert diagnosis.ranks_text([0, 2, 3, 4, 7, 8]) == "ranks 0, 2-4, 7, 8"


def test_a_deadlock_is_decided_once_the_positions_are_stable():
    assert diagnosis.decide(SKIPPED, set(), stable=False, judged=False) is None
    decision = diagnosis.decide(SKIPPED, set(), stable=True, judged=False)
    assert decision.kind == "deadlock" and decision.waiting_for == {0: [1], 1: [0]}


def test_a_collective_every_member_issued_is_slow_not_hung():
    # Both wait in the same collective (a large transfer): nobody is behind, whatever the wait.
    both = {r: record(r, "waiting", NORM, {"step@0-1": 2}, waited=100.0) for r in (0, 1)}
    assert diagnosis.decide(both, set(), stable=True) is None


def test_a_rank_outside_zeroshard_is_a_hang_after_the_timeout_only():
    outside = record(1, "outside", NORM, {"step@0-1": 1}, last_call=["step", 0, 2.0])
    early = {0: record(0, "waiting", NORM, {"step@0-1": 2}, waited=2.0), 1: outside}
    assert diagnosis.decide(early, set(), stable=True) is None
    late = {0: record(0, "waiting", NORM, {"step@0-1": 2}, waited=3.5), 1: outside}
    assert diagnosis.decide(late, set(), stable=True, judged=False) is None  # staleness not known yet
    assert diagnosis.decide(late, set(), stable=True).kind == "hang"
    # In the process's first step the longer timeout applies (10 s here).
    first = {0: record(0, "waiting", NORM, {"step@0-1": 2}, waited=3.5, first_step=True), 1: outside}
    assert diagnosis.decide(first, set(), stable=True) is None


def test_the_skipped_step_text_names_both_collectives_and_the_cause():
    decision = diagnosis.decide(SKIPPED, set(), stable=True)
    text = diagnosis.compose(decision, SKIPPED, {}, SKIPPED_RINGS, SETTINGS)
    assert text.splitlines() == [
        "zeroshard hang diagnosis (zeroshard.hang_timeout_s=3, zeroshard.collective_timeout_s=30): the ranks stopped "
        "moving together.",
        "  rank 0: waits 1.8 s in all_reduce 'norm' #9 (8 x float32; optimizer step, step 1)",
        "  rank 1: waits 1.7 s in reduce_scatter 'grad' #9 (1244 x float32; gradient reduction, step 1, micro-step 1, "
        "unit '<root>')",
        "first difference: collective #9, where rank 0 and rank 1 wait (above)",
        "likely cause: rank 1 ran a backward of step 1 where rank 0 ran the optimizer step: rank 1 skipped a step() "
        "call, or ran one micro-batch more than rank 0. Every rank must call forward, backward and step() the same "
        "number of times.",
    ]


def test_ranks_at_the_same_place_are_one_line_with_the_longest_wait():
    records = {r: record(r, "waiting", NORM, {"step@0-1": 2, "backward@0-1": 2}, waited=1.0 + r / 10) for r in range(3)}
    records[3] = record(3, "waiting", GRAD, {"step@0-1": 1, "backward@0-1": 3}, waited=1.0)
    text = diagnosis.compose(diagnosis.decide(records, set(), stable=True), records, {}, {}, SETTINGS)
    assert "  ranks 0-2: waits 1.2 s in all_reduce 'norm' #9" in text, text


def test_a_stopped_or_dead_peer_is_named():
    gather = entry(8, "all_gather", "param", "forward", "gather:152xfloat32@0-1", 4, unit="blocks.0")
    records = {0: record(0, "waiting", gather, {"gather:152xfloat32@0-1": 4}, waited=4.0),
               1: record(1, "inside", gather, {"gather:152xfloat32@0-1": 3}, calls=["forward"], hb=2)}
    decision = diagnosis.decide(records, {1}, stable=False)
    assert decision.kind == "hang"
    text = diagnosis.compose(decision, records, {1: 12.0}, {}, SETTINGS)
    assert "rank 1: stopped publishing 12 s ago (last seen inside: all_gather 'param' #8" in text, text
    assert "likely cause: a dead or stopped peer: rank 1 does not answer (it stopped publishing" in text, text
    # A closed connection, reported by the rank whose collective failed: the peer died.
    failed = dict(records)
    failed[0] = record(0, "failed", gather, {"gather:152xfloat32@0-1": 4}, failure="RuntimeError: Connection "
                       "closed by peer [127.0.0.1]:4242.")
    assert diagnosis.decide(failed, {1}, stable=False, judged=False) is None
    decision = diagnosis.decide(failed, {1}, stable=False)
    assert decision.kind == "failure"
    assert "its connection closed: the process died" in diagnosis.compose(decision, failed, {1: 5.0}, {}, SETTINGS)


def test_a_unit_gathered_on_one_rank_only_is_a_stage3_branch():
    def gather(seq, unit, numel, index):
        return entry(seq, "all_gather", "param", "forward", f"gather:{numel}xfloat32@0-1", index, step=0, micro=0,
                     unit=unit, numel=numel)

    shared = [gather(i, f"blocks.{i - 1}", 152, i) for i in range(1, 4)]
    # Rank 1 gathers blocks.2 (wider) where rank 0 goes on with blocks.3: two transports, a deadlock.
    mine, theirs = gather(4, "blocks.3", 152, 4), gather(4, "blocks.2", 200, 1)
    # Every rank counts every channel it belongs to, from 0.
    counts = {"backward@0-1": 0, "gather:152xfloat32@0-1": 4, "gather:200xfloat32@0-1": 0}
    records = {0: record(0, "waiting", mine, counts, waited=1.0),
               1: record(1, "waiting", theirs, {**counts, "gather:152xfloat32@0-1": 3, "gather:200xfloat32@0-1": 1},
                         waited=1.0)}
    rings = {0: [*shared, mine], 1: [*shared, theirs]}
    text = diagnosis.compose(diagnosis.decide(records, set(), stable=True), records, {}, rings, SETTINGS)
    assert "first difference: collective #4, where rank 0 and rank 1 wait (above)" in text, text
    assert "likely cause: at stage 3 rank 0 gathers unit 'blocks.3' where rank 1 gathers unit 'blocks.2': a module " \
        "or parameter used on some ranks only" in text, text
    # Rank 1 gathers a unit more at the end of its forward, rank 0 is in its backward already.
    grad = entry(4, "reduce_scatter", "grad", "reduction", "backward@0-1", 1, step=0, micro=0)
    counts = {"backward@0-1": 1, "gather:152xfloat32@0-1": 3, "gather:200xfloat32@0-1": 0}
    records[0] = record(0, "waiting", grad, counts, waited=1.0)
    rings[0] = [*shared, grad]
    text = diagnosis.compose(diagnosis.decide(records, set(), stable=True), records, {}, rings, SETTINGS)
    assert "likely cause: at stage 3 rank 1 gathers unit 'blocks.2' where rank 0 issued reduce_scatter 'grad' #4" \
        in text, text
    # A rank whose ring ends before the other's extra gather: named as not issued.
    rings[0] = shared
    text = diagnosis.compose(diagnosis.decide(records, set(), stable=True), records, {}, rings, SETTINGS)
    assert "first difference: collective #4: rank 0 (not issued); rank 1 all_gather 'param' #4" in text, text
    assert "likely cause: at stage 3 rank 1 gathers unit 'blocks.2' (forward, step 0) and rank 0 does not" in text


def test_timeouts_follow_the_collective_timeout_unless_set():
    timeouts, problems = resolve_timeouts(None, None, 600.0)
    assert (timeouts.hang_timeout_s, timeouts.first_step_timeout_s, problems) == (300.0, 450.0, [])
    timeouts, _ = resolve_timeouts(None, None, 8.0)  # a test's few seconds: the watchdog speaks first
    assert (timeouts.hang_timeout_s, timeouts.first_step_timeout_s, timeouts.tick_s) == (4.0, 6.0, 0.25)
    assert not resolve_timeouts(0.0, None, 600.0)[0].enabled


def test_config_refuses_a_watchdog_that_could_not_speak_first():
    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match=r"zeroshard.hang_timeout_s=700: must be below "
                       r"zeroshard.collective_timeout_s \(600\)"):
        resolve_config({**base, "zeroshard": {"hang_timeout_s": 700}})
    with pytest.raises(ConfigError, match=r"zeroshard.hang_first_step_timeout_s=1: must be at least "
                       r"zeroshard.hang_timeout_s \(2\) and below zeroshard.collective_timeout_s \(10\)"):
        resolve_config({**base, "zeroshard": {"hang_timeout_s": 2, "hang_first_step_timeout_s": 1,
                                              "collective_timeout_s": 10}})
    cfg = resolve_config({**base, "zeroshard": {"hang_timeout_s": 0}})
    assert cfg.zeroshard.hang_timeout_s == 0


def test_hang_error_is_a_collective_error_that_survives_pickling():
    error = HangError("rank 1 stopped in its forward.", "zeroshard hang diagnosis (...)")
    assert isinstance(error, CollectiveError)
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.diagnosis) == (str(error), error.diagnosis)


def test_group_keys_are_short():
    assert group_key((0, 1, 2, 3)) == "0-3" and group_key((0, 2)) == "0,2"
    assert group_key(tuple(range(0, 64, 2))).startswith("32r")
