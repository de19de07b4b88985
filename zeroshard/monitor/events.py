"""DeepSpeed's monitor events: names, and the events one optimizer step writes.

An event is DeepSpeed's tuple ``(name, value, samples)``: the value is indexed by the global
samples seen, not by the step, so runs with different batch sizes line up on one axis.
"""

from __future__ import annotations

from typing import Any

# DeepSpeed 0.19's names (deepspeed/runtime/engine.py; train_loss as its engine wrote it up to
# 0.18.2 and its pipeline engine still does).
TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"

Event = tuple[str, Any, int]
"""(name, value, global samples); the value is a number or a 0-d tensor (read by the writer)."""


def step_events(
    loss_sum: Any, samples_before: int, samples_after: int, lr: float | None, loss_scale: float | None
) -> list[Event]:
    """The events of one optimizer step, with DeepSpeed's indices.

    DeepSpeed writes the loss from the last backward of the step, before the step counts its
    samples (``samples_before``), and the learning rate and fp16 loss scale after the step
    (``samples_after``). ``loss_sum`` is the sum of what ``engine.backward`` returned over the
    step (the losses divided by the accumulation steps: their mean); None when the step had no
    ``engine.backward`` (a plain ``loss.backward()`` is invisible to the engine).
    """
    events: list[Event] = []
    if loss_sum is not None:
        events.append((TRAIN_LOSS, loss_sum, samples_before))
    if lr is not None:
        events.append((LR, lr, samples_after))
    if loss_scale is not None:
        events.append((LOSS_SCALE, loss_scale, samples_after))
    return events
