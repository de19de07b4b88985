"""From the ranks' published progress records to one decision and one text: is the job hung,
where is each rank, where did their sequences of collectives part, and why, in words.

Pure functions over plain data (the JSON the watchdog publishes, zeroshard/comm/watchdog.py):
the watchdog's decider calls `decide` every tick and `compose` once; the tests call them with
records written by hand.

A record (`Record`, one per rank): its heartbeat, its state ("waiting" in a collective,
"inside" an engine call but not waiting, "outside" the engine, "failed": a collective raised a
transport error), how long it has waited, the collective it waits in (a progress.Entry as a
dict), how many collectives it issued on each channel it belongs to, its position (step,
micro-step, the engine calls running, the last call that ended) and whether it has finished an
optimizer step yet (the first step has its own timeout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Decision", "decide", "compose", "ranks_text", "entry_text", "by_position"]

Record = dict[str, Any]


@dataclass
class Decision:
    """Why the job is hung: `kind` is "deadlock" (every rank waits, and no rank's collective
    can complete), "mismatch" (ranks wait at the same place of a transport in different
    collectives), "hang" (a rank waited past its timeout for ranks that did not reach its
    collective) or "failure" (a rank's collective failed: a peer died or closed its
    connection). `waiting_for` maps each waiting rank to the ranks it waits for."""

    kind: str
    waiting_for: dict[int, list[int]] = field(default_factory=dict)


def ranks_text(ranks: list[int]) -> str:
    """ "rank 3" or "ranks 0, 2-4" (runs of consecutive ranks joined)."""
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}" if r > start + 1 else f"{start}, {r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _position(step: Any, micro: Any, unit: Any = None, phase: str | None = None) -> str:
    parts = []
    if phase:
        parts.append(f"{_PHASE_WORDS.get(phase, phase)}")
    if step is not None:
        parts.append(f"step {step}")
    if micro is not None and phase in ("forward", "evaluation", "backward", "reduction"):
        parts.append(f"micro-step {micro}")
    if unit:
        parts.append(f"unit '{unit}'")
    return ", ".join(parts)


_PHASE_WORDS = {
    "forward": "forward", "evaluation": "evaluation forward", "backward": "backward",
    "reduction": "gradient reduction", "step": "optimizer step", "save": "save_checkpoint",
    "load": "load_checkpoint", "init": "initialize", "other": "outside an engine call",
}


def _call_word(phase: str) -> str:
    """The engine call a phase belongs to, in words (a gradient reduction is its backward's)."""
    return _PHASE_WORDS["backward" if phase == "reduction" else phase] if phase in _PHASE_WORDS else phase


def entry_text(entry: Record) -> str:
    """ "all_reduce 'norm' #41 (8 x float32; optimizer step, step 1)"."""
    size = f"{entry['numel']} x {entry['dtype']}" if entry.get("numel") is not None else entry["dtype"]
    where = _position(entry.get("step"), entry.get("micro_step"), entry.get("unit"), entry.get("phase"))
    return f"{entry['op']} '{entry['tag']}' #{entry['seq']} ({size}; {where})"


def _fingerprint(entry: Record) -> tuple:
    return (entry["op"], entry["tag"], entry.get("unit"), entry.get("numel"), entry["dtype"],
            entry["group_size"], entry["phase"], entry.get("step"), entry.get("micro_step"))


def by_position(records: dict[int, Record | None]) -> dict[tuple, list[int]]:
    """Ranks grouped by where they are: state and the collective they wait in (or issued last)."""
    out: dict[tuple, list[int]] = {}
    for r, rec in sorted(records.items()):
        if rec is not None:
            current = rec.get("current")
            out.setdefault((rec["state"], current and current["seq"], current and _fingerprint(current)), []).append(r)
    return out


def _unsatisfied(rank: int, records: dict[int, Record | None]) -> list[int]:
    """The ranks that have not issued the collective `rank` waits in (its channel's members)."""
    entry = records[rank]["current"]
    channel, index = entry["channel"], entry["index"]
    behind = []
    for peer, rec in records.items():
        if peer == rank:
            continue
        if rec is None:  # never published: it has not reached anything
            behind.append(peer)
            continue
        count = rec["issued"].get(channel)
        if count is not None and count < index:
            behind.append(peer)
    return behind


def decide(records: dict[int, Record | None], stale: set[int], stable: bool, judged: bool = True) -> Decision | None:
    """The decision from every rank's latest record (None: none published yet).

    Args:
        records: rank -> its record.
        stale: ranks whose heartbeat has not moved for several ticks (stopped or dead).
        stable: the waiting ranks' positions were the same at the previous tick, and every
            heartbeat moved in between (so the records are current).
        judged: the decider has watched the heartbeats long enough for `stale` to be complete;
            until then only a certain deadlock or mismatch is decided.
    """
    waiting = {r: rec for r, rec in records.items() if rec is not None and rec["state"] in ("waiting", "failed")}
    failed = [r for r, rec in waiting.items() if rec["state"] == "failed"]
    waiting_for = {r: _unsatisfied(r, records) for r, rec in waiting.items() if rec.get("current")}
    if failed and judged and (stale or any(records[r] is None for r in records)):
        return Decision("failure", waiting_for)
    # Ranks waiting at the same place of the same transport in different collectives.
    at: dict[tuple[str, int], dict[tuple, list[int]]] = {}
    for r, rec in waiting.items():
        entry = rec.get("current")
        if entry is not None:
            at.setdefault((entry["channel"], entry["index"]), {}).setdefault(_fingerprint(entry), []).append(r)
    if stable and any(len(kinds) > 1 for kinds in at.values()):
        return Decision("mismatch", waiting_for)
    everyone_waits = len(waiting) == len(records) and not stale and all(waiting_for.get(r) for r in waiting)
    if stable and everyone_waits:
        return Decision("deadlock", waiting_for)
    if not judged:
        return None
    for r, rec in waiting.items():
        limit = rec["first_step_timeout_s"] if rec["first_step"] else rec["hang_timeout_s"]
        if waiting_for.get(r) and rec.get("waited") is not None and rec["waited"] > limit:
            return Decision("hang", waiting_for)
    return None


def _state_text(rank: int, rec: Record | None, stale_s: float | None) -> str:
    if rec is None:
        return "never published a record (it has built no engine yet, or died before)"
    if stale_s is not None:
        last = entry_text(rec["current"]) if rec.get("current") else f"step {rec.get('step')}"
        return f"stopped publishing {stale_s:.0f} s ago (last seen {rec['state']}: {last})"
    state = rec["state"]
    if state == "waiting":
        return f"waits {rec['waited']:.1f} s in {entry_text(rec['current'])}"
    if state == "failed":
        return f"saw {entry_text(rec['current'])} fail: {rec.get('failure') or 'a transport error'}"
    if state == "inside":
        call = rec["calls"][-1] if rec.get("calls") else "an engine call"
        return f"is running {_PHASE_WORDS.get(call, call)} of step {rec.get('step')} (not in a collective)"
    last = rec.get("last_call")
    if last:
        return (f"is outside zeroshard for {last[2]:.0f} s, since its {_PHASE_WORDS.get(last[0], last[0])} of "
                f"step {last[1]} ended")
    return "is outside zeroshard (no engine call yet)"


def _first_difference(a: int, b: int, rings: dict[int, list]) -> tuple[int, Record | None, Record | None] | None:
    """(seq, a's entry, b's entry) of the first collective at which ranks a and b differ (an
    entry is None where the rank had not issued it); None if their rings agree or do not overlap."""
    ring_a = {e["seq"]: e for e in rings.get(a, []) if isinstance(e, dict)}
    ring_b = {e["seq"]: e for e in rings.get(b, []) if isinstance(e, dict)}
    if not ring_a or not ring_b:
        return None
    lo = max(min(ring_a), min(ring_b))
    hi = max(max(ring_a), max(ring_b))
    for seq in range(lo, hi + 1):
        ea, eb = ring_a.get(seq), ring_b.get(seq)
        if ea is None or eb is None or _fingerprint(ea) != _fingerprint(eb):
            return seq, ea, eb
    return None


def _waits_in(rec: Record | None, entry: Record) -> bool:
    """Whether the rank's record says it waits in `entry` (then the position lines show it)."""
    current = rec.get("current") if rec is not None else None
    return bool(rec and rec["state"] == "waiting" and current and current["seq"] == entry["seq"])


def _groups(records: dict[int, Record | None], stale: dict[int, float]) -> list[tuple[list[int], str]]:
    """Ranks with the same position together, in rank order of their first member."""
    by_text: dict[str, list[int]] = {}
    for r in sorted(records):
        rec = records[r]
        key = _state_text(r, rec, stale.get(r))
        if rec is not None and r not in stale and rec["state"] == "waiting":
            # Group ranks waiting in the same collective whatever their exact waiting times.
            key = f"waits in {entry_text(rec['current'])}"
        by_text.setdefault(key, []).append(r)
    out = []
    for text, ranks in by_text.items():
        if text.startswith("waits in "):
            longest = max(records[r]["waited"] for r in ranks)
            text = f"waits {longest:.1f} s in {text[len('waits in '):]}"
        out.append((ranks, text))
    return out


def _cause(decision: Decision, records: dict[int, Record | None], stale: dict[int, float],
           difference: tuple[int, int, int, Record | None, Record | None] | None) -> str:
    behind = sorted({p for peers in decision.waiting_for.values() for p in peers})
    dead = sorted(r for r in records if r in stale or records[r] is None)
    if dead:
        failures = " ".join(
            rec["failure"] for rec in records.values() if rec is not None and rec.get("failure")
        )
        how = "its connection closed: the process died" if "closed" in failures or "reset" in failures else (
            "it stopped publishing: it is dead, or stopped (SIGSTOP, a debugger, a frozen node)")
        return (f"a dead or stopped peer: {ranks_text(dead)} {'does' if len(dead) == 1 else 'do'} not answer "
                f"({how}); the others wait for it. Look at {ranks_text(dead)}'s own log and exit status.")
    outside = [r for r in behind if records[r] is not None and records[r]["state"] == "outside"]
    if outside:
        return (f"{ranks_text(outside)} {'is' if len(outside) == 1 else 'are'} alive but outside zeroshard while the "
                "others wait in a collective: stuck in the training loop's own code, such as its data loader, "
                "an evaluation or a save of its own on some ranks only. Every rank must reach the same engine calls.")
    computing = [r for r in behind if records[r] is not None and records[r]["state"] == "inside"]
    if computing and decision.kind == "hang":
        first = any(records[r]["first_step"] for r in computing)
        return (f"{ranks_text(computing)} {'is' if len(computing) == 1 else 'are'} still computing inside an engine "
                "call while the others wait: a slow rank" + (
                    " (still in the first step: raise zeroshard.hang_first_step_timeout_s if warm-up is slow)"
                    if first else " (raise zeroshard.hang_timeout_s if that rank is slow by design)") + ".")
    if difference is None:
        return ("the ranks wait in collectives that cannot complete. Every rank must make the same engine calls "
                "in the same order.")
    _, a, b, ea, eb = difference
    if ea is None or eb is None:
        ahead, missing, entry = (a, b, ea) if eb is None else (b, a, eb)
        return _missing_cause(ahead, missing, entry, records)
    pa, pb = ea["phase"], eb["phase"]
    training = ("forward", "backward", "reduction")
    if {pa, pb} & {"save", "load"} and pa != pb:
        saver, other = (a, b) if pa in ("save", "load") else (b, a)
        es, eo = (ea, eb) if saver == a else (eb, ea)
        return (f"rank {saver} entered {_call_word(es['phase'])} at step {es.get('step')} while rank {other} "
                f"was in its {_call_word(eo['phase'])} of step {eo.get('step')}: the ranks ran "
                "different numbers of optimizer steps (or micro-batches) before the checkpoint. Every rank must run "
                "the same steps before saving or loading.")
    if "step" in (pa, pb) and pa != pb and ({pa, pb} - {"step"}) <= set(training):
        stepper, other = (a, b) if pa == "step" else (b, a)
        eo = eb if other == b else ea
        return (f"rank {other} ran a {_call_word(eo['phase'])} of step {eo.get('step')} where rank {stepper} ran "
                f"the optimizer step: rank {other} skipped a step() call, or ran one micro-batch more than rank "
                f"{stepper}. Every rank must call forward, backward and step() the same number of times.")
    if ea.get("step") != eb.get("step"):
        low, high = (a, b) if (ea.get("step") or 0) < (eb.get("step") or 0) else (b, a)
        return (f"rank {low} is at step {min(ea.get('step') or 0, eb.get('step') or 0)} and rank {high} at step "
                f"{max(ea.get('step') or 0, eb.get('step') or 0)}: rank {low} skipped optimizer steps. Every rank must "
                "call step() the same number of times.")
    if ea.get("micro_step") != eb.get("micro_step") and pa in training and pb in training:
        return (f"unequal micro-batch counts: in step {ea.get('step')} rank {a} is at micro-step "
                f"{ea.get('micro_step')} and rank {b} at micro-step {eb.get('micro_step')}. Every rank must run the "
                "same number of micro-batches (forward and backward) per step.")
    gathers = [(r, e, o, eo) for r, e, o, eo in ((a, ea, b, eb), (b, eb, a, ea)) if _is_unit_gather(e)]
    if gathers and ea.get("step") == eb.get("step"):
        r, e, other, eo = gathers[0]
        there = f"gathers unit '{eo['unit']}'" if _is_unit_gather(eo) else f"issued {entry_text(eo)}"
        return (f"at stage 3 rank {r} gathers unit '{e['unit']}' where rank {other} {there}: " + _BRANCH)
    return (f"rank {a} issued {entry_text(ea)} where rank {b} issued {entry_text(eb)}. Every rank must make the same "
            "engine calls in the same order.")


_BRANCH = ("a module or parameter used on some ranks only (a rank-dependent branch, or a parameter used directly "
           "on some ranks). Every rank must run the same modules and use the same parameters at stage 3 (read one "
           "rank's values inside zeroshard.zero.GatheredParameters on every rank).")


def _is_unit_gather(entry: Record) -> bool:
    return entry["op"] == "all_gather" and entry["tag"] == "param" and bool(entry.get("unit"))


def _missing_cause(ahead: int, missing: int, entry: Record, records: dict[int, Record | None]) -> str:
    if _is_unit_gather(entry):
        where = _position(entry.get("step"), None, None, entry["phase"])
        unit = entry["unit"]
        return f"at stage 3 rank {ahead} gathers unit '{unit}' ({where}) and rank {missing} does not: " + _BRANCH
    rec = records.get(missing)
    where = _state_text(missing, rec, None) if rec is not None else "has not issued it"
    return (f"rank {ahead} issued {entry_text(entry)} and rank {missing} did not (it {where}). Every rank must "
            "make the same engine calls in the same order.")


def compose(decision: Decision, records: dict[int, Record | None], stale: dict[int, float],
            rings: dict[int, list], settings: dict[str, float]) -> str:
    """The diagnosis: every rank's position (grouped), the first collective at which their
    sequences differ, and the likely cause. `settings` holds the timeouts it names."""
    lines = [
        "zeroshard hang diagnosis ("
        + ", ".join(f"zeroshard.{k}={v:g}" for k, v in settings.items()) + "): the ranks stopped moving together."
    ]
    groups = _groups(records, stale)
    for ranks, text in groups:
        lines.append(f"  {ranks_text(ranks)}: {text}")
    difference = None
    reps = [ranks[0] for ranks, _ in groups if ranks[0] in rings]
    for a, b in ((reps[0], other) for other in reps[1:]) if reps else ():
        found = _first_difference(a, b, rings)
        if found is not None and (difference is None or found[0] < difference[0]):
            difference = (found[0], a, b, found[1], found[2])
    if difference is not None:
        seq, a, b, ea, eb = difference
        if ea and eb and _waits_in(records.get(a), ea) and _waits_in(records.get(b), eb):
            lines.append(f"first difference: collective #{seq}, where rank {a} and rank {b} wait (above)")
        else:
            left = entry_text(ea) if ea else "(not issued)"
            right = entry_text(eb) if eb else "(not issued)"
            lines.append(f"first difference: collective #{seq}: rank {a} {left}; rank {b} {right}")
    lines.append("likely cause: " + _cause(decision, records, stale, difference))
    return "\n".join(lines)
