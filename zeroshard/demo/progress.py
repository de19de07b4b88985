"""What the demo shows while it trains: a rich progress bar on a terminal, plain lines elsewhere.

Only rank 0 reports; other ranks get a reporter that does nothing, so the training loop has
no `if rank == 0` around each call.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class ProgressReporter:
    """Shows step, loss and tokens/s; a context manager around the training loop.

    Args:
        start_step: the optimizer step training resumes from (0 for a fresh run).
        total_steps: the step training stops at.
        enabled: False on every rank but 0: then nothing is shown.
        print_every: on a non-terminal (a log file, CI), print one line every this many steps.
    """

    def __init__(self, start_step: int, total_steps: int, enabled: bool, print_every: int = 10) -> None:
        # soft_wrap: long lines (paths, the sample) stay whole in logs instead of breaking at 80.
        self.console = Console(soft_wrap=True)
        self.enabled = enabled
        self.total_steps = total_steps
        self.print_every = max(1, print_every)
        # A live bar only makes sense on a terminal; in a pipe it would print nothing useful.
        self._progress: Progress | None = None
        if enabled and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tokens_per_s]} tok/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, loss="-", tokens_per_s="-"
            )

    def __enter__(self) -> ProgressReporter:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, step: int, loss: float, tokens_per_s: float, lr: float) -> None:
        """Report the optimizer step just finished (tokens_per_s: the run's average so far)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", tokens_per_s=f"{tokens_per_s:,.0f}")
        elif step % self.print_every == 0 or step == self.total_steps:
            self.console.print(
                f"step {step}/{self.total_steps}  loss {loss:.4f}  lr {lr:.2e}  {tokens_per_s:,.0f} tok/s",
                highlight=False,
            )

    def print(self, *objects, **kwargs) -> None:
        """Print on rank 0 only, above the bar when one is live."""
        if self.enabled:
            self.console.print(*objects, **kwargs)
