"""Live bytes of fake tensors, by what they are for: the prediction's side of the measurement.

[Note: predicting by tracing on fake tensors]
A model run under torch's `FakeTensorMode` computes shapes and dtypes but allocates nothing, so
a forward and backward of a 1B-parameter model at sequence 2048 costs seconds and no memory.
`Ledger` is a TorchDispatchMode that sees the output of every operator and follows each new
storage with a weakref: its bytes count from the operator that made it until the last tensor
on it dies, which is when the CPU allocator (or CUDA's caching allocator) would take it back.
Storages that existed before (the model's own parameters, the inputs) are not counted; what
the engine keeps is allocated by the prediction itself, as fake tensors inside the same ledger,
so the engine's buffers and the model's activations interleave in the order they really do.

Checked against the allocator (zeroshard/memory/tracker.py) on the demo GPT: the traced
forward equals the measured one to the byte. What it cannot see is memory an operator takes and
returns inside its kernel (bf16 attention backward on the CPU: 2.25 MiB of 41.8 on the `medium`
preset), and kernel choices of another device (the trace runs the CPU's kernels: flash
attention on both, docs/memory.md says where they differ).

Every live storage carries a label (`label()`): the prediction's parts are the labels' bytes at
the instant of the peak.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["ACTIVATIONS", "HOST", "Ledger", "Peak"]

ACTIVATIONS = "activations"
HOST = "host:"  # a label starting with this lives in host memory (offloaded states, landing buffers)
PLACES = ("device", "host", "all")


def place_of(label: str) -> str:
    return "host" if label.startswith(HOST) else "device"


class Peak:
    """The most bytes alive at once in one place, with the labels' bytes and the phase then."""

    __slots__ = ("bytes", "parts", "phase")

    def __init__(self) -> None:
        self.bytes = 0
        self.parts: dict[str, int] = {}
        self.phase = ""


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class Ledger(TorchDispatchMode):
    """Live bytes of the storages created while active, labelled; the peak and its parts.

    Args:
        ignore: tensors whose storages are not counted (they exist already).
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = (), workspace: Callable[..., int] | None = None) -> None:
        super().__init__()
        self._workspace = workspace  # (func, args, out) -> bytes a kernel holds inside (workspaces.py)
        self._known = {_key(t) for t in ignore}
        self._live: dict[int, tuple[int, str]] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._labels = [ACTIVATIONS]
        self.by_label: Counter[str] = Counter()
        self.now = dict.fromkeys(PLACES, 0)
        self.peaks = {place: Peak() for place in PLACES}
        self.phase = ""
        self.phase_peaks: dict[str, int] = {}  # phase -> the most bytes alive in it (all places)

    # ------------------------------------------------------------------ labels and phases
    @contextlib.contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Storages created inside count as `name`."""
        self._labels.append(name)
        try:
            yield
        finally:
            self._labels.pop()

    def enter_phase(self, name: str) -> None:
        """Peaks from now on are reported under `name` (forward, backward, step, ...)."""
        self.phase = name
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.now["all"])

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        self._known.update(_key(t) for t in tensors)

    def reset_peak(self) -> None:
        """Forget the peaks so far (a warm-up pass before the measured one)."""
        self.phase_peaks = {}
        for place in PLACES:
            self.peaks[place] = Peak()
            self._note(place)

    # ------------------------------------------------------------------ counting
    def add(self, tensor: torch.Tensor, label: str | None = None) -> None:
        """Count `tensor`'s storage (made outside an operator this mode saw) from now on."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live or key in self._known:
            return
        nbytes = storage.nbytes()
        name = label or self._labels[-1]
        self._live[key] = (nbytes, name)
        self.by_label[name] += nbytes
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._drop(key))
        for place in (place_of(name), "all"):
            self.now[place] += nbytes
            self._note(place)
        if self.phase:
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.now["all"])

    def _note(self, place: str) -> None:
        peak = self.peaks[place]
        if self.now[place] > peak.bytes or not peak.parts:
            peak.bytes = self.now[place]
            peak.parts = {k: v for k, v in self.by_label.items() if v and (place == "all" or place_of(k) == place)}
            peak.phase = self.phase

    def _drop(self, key: int) -> None:
        entry = self._live.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            nbytes, name = entry
            self.by_label[name] -= nbytes
            self.now[place_of(name)] -= nbytes
            self.now["all"] -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.add(leaf)
        if self._workspace is not None and (extra := self._workspace(func, args, out)):
            self._transient(extra)
        return out

    def _transient(self, nbytes: int) -> None:
        """Bytes alive only inside the operator just run, with its inputs and output."""
        name = self._labels[-1]
        self.by_label[name] += nbytes
        for place in (place_of(name), "all"):
            self.now[place] += nbytes
            self._note(place)
        if self.phase:
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.now["all"])
        self.by_label[name] -= nbytes
        for place in (place_of(name), "all"):
            self.now[place] -= nbytes
