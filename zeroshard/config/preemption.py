"""The ``preemption`` section (zeroshard's own; DeepSpeed has none): which signals mean "the
scheduler is about to stop this job", where the ranks save together, the exit status that
asks the scheduler to run the job again, and resuming from the newest complete checkpoint.

The handlers and the agreement are in zeroshard/checkpoint/preempt.py; docs/cluster.md. This
module imports nothing outside zeroshard/config (tests/unit/config/test_config_leaf.py).
"""

from __future__ import annotations

import signal
from typing import Any

from pydantic import Field

from zeroshard.config.base import JsonInt, _Report, _Section, _show

# Slurm's `--signal` sends SIGUSR1/SIGUSR2 (as configured) before its kill; Kubernetes, torchrun's
# agent and Slurm's own preemption send SIGTERM.
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
# 128 + SIGTERM, what a shell reports for a job SIGTERM ended: non-zero, so torchrun's elastic
# agent restarts the workers (while --max-restarts lasts) and Kubernetes' OnFailure restarts the
# pod; 128-255 is "retryable" to Kubeflow's ExitCode restart policy; a Slurm batch script tests
# for it before `scontrol requeue`.
DEFAULT_EXIT_CODE = 143
# Signals a process cannot catch, or whose handler would break the run itself.
_UNCATCHABLE = frozenset({"SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGCHLD"})


class PreemptionConfig(_Section):
    """``preemption``: save together and exit when the scheduler signals (docs/cluster.md).

    Attributes:
        enabled: install the signal handlers at ``initialize``.
        signals: names of the signals that request the stop (``"SIGUSR1"`` or ``"USR1"``).
        save_dir: where the ranks save the preemption checkpoint at the step boundary where
            they agree, before exiting; None: nothing automatic, the loop polls
            ``engine.should_stop()`` and saves itself.
        tag: the checkpoint's tag; None: DeepSpeed's ``global_step<N>``.
        exit_code: the status every rank exits with after that save.
        resume: at ``initialize``, load the newest complete checkpoint in ``save_dir``
            (``engine.resume_latest()``); nothing there is not an error (a first start).
    """

    enabled: bool = False
    signals: list[str] = Field(default_factory=lambda: list(DEFAULT_SIGNALS))
    save_dir: str | None = None
    tag: str | None = None
    exit_code: JsonInt = Field(DEFAULT_EXIT_CODE, ge=0, le=255)
    resume: bool = False

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        names = raw.get("signals", list(DEFAULT_SIGNALS))
        # Not a list: the type error is reported by the model.
        for i, name in enumerate(names if isinstance(names, list) else []):
            if not isinstance(name, str):
                continue
            try:
                canonical = signal_number(name).name
            except ValueError as error:
                report.problems.append(f"{path}.signals.{i}={_show(name)}: {error}")
                continue
            if canonical in _UNCATCHABLE:
                report.problems.append(
                    f"{path}.signals.{i}={_show(name)}: {canonical} cannot be handled (the kernel does, "
                    "or a handler would hide a crash). Use SIGTERM, SIGUSR1, SIGUSR2, SIGINT or SIGHUP."
                )
        tag = raw.get("tag")
        if isinstance(tag, str) and (
            not tag or tag.startswith(".") or tag != tag.strip() or any(c in tag for c in "/\\\0")
            or not tag.isprintable()
        ):
            # The checkpoint tag rule (checkpoint/format.py's validate_tag), checked here so that
            # a bad tag is found at initialize, not when the scheduler has already signalled.
            report.problems.append(
                f"{path}.tag={_show(tag)}: must be a plain directory name (no path separators, no "
                "leading '.', no leading or trailing whitespace, no control characters). Use e.g. "
                '"preempted", or null for global_step<N>.'
            )
        if raw.get("resume") is True and not raw.get("save_dir"):
            report.problems.append(
                f"{path}.resume=true: resume from where? Set {path}.save_dir to the directory the "
                "preemption checkpoints go to, or call engine.resume_latest(dir) yourself."
            )


def signal_number(name: str) -> signal.Signals:
    """The signal called `name` ("SIGUSR1", "USR1", any case)."""
    key = name.strip().upper()
    key = key if key.startswith("SIG") else "SIG" + key
    try:
        return signal.Signals[key]
    except KeyError:
        raise ValueError(
            f"no signal called {name!r} on this system; use a name such as 'SIGTERM', 'SIGUSR1' or 'SIGUSR2'."
        ) from None
