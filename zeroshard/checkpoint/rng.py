"""Random-number generator state of one process, as safetensors tensors plus string metadata.

A resumed run draws the same dropout masks (torch), the same Python `random` numbers and
the same numpy numbers as the uninterrupted one would have, so RNG state is saved per rank:
torch's CPU generator, every CUDA generator when CUDA is initialised, Python's `random`,
and numpy's global generator when numpy is installed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroshard.checkpoint.base import CheckpointError

RNG_PREFIX = "rng/"
_TORCH_CPU = RNG_PREFIX + "torch_cpu"
_CUDA = RNG_PREFIX + "cuda_"
_NUMPY_KEYS = RNG_PREFIX + "numpy_keys"
_META_PYTHON = "rng.python"
_META_NUMPY = "rng.numpy"


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's RNG states: (tensors for a safetensors file, string metadata)."""
    tensors: dict[str, torch.Tensor] = {_TORCH_CPU: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{_CUDA}{i}"] = state
    version, internal, gauss_next = random.getstate()
    metadata = {_META_PYTHON: json.dumps([version, list(internal), gauss_next])}
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        tensors[_NUMPY_KEYS] = torch.from_numpy(keys.astype("int64"))
        metadata[_META_NUMPY] = json.dumps([kind, int(pos), int(has_gauss), float(cached)])
    return tensors, metadata


@dataclass
class RngState:
    """Parsed and checked RNG state, ready to be applied (`apply_rng_state`) without failing."""

    torch_cpu: torch.Tensor | None = None
    cuda: list[torch.Tensor] = field(default_factory=list)
    python: tuple | None = None
    numpy: tuple | None = None


def _bad(where: str, name: str, value: Any, rule: str) -> CheckpointError:
    shown = repr(value) if len(repr(value)) < 80 else f"{repr(value)[:77]}..."
    return CheckpointError(f"{where}: field {name} = {shown}: {rule}; the checkpoint is corrupt or was edited.")


def _byte_state(value: torch.Tensor, where: str, name: str, numel: int | None) -> torch.Tensor:
    if value.dtype != torch.uint8 or value.dim() != 1 or (numel is not None and value.numel() != numel):
        raise _bad(where, name, f"{value.dtype} {list(value.shape)}", f"must be a 1-D uint8 tensor of {numel} bytes")
    return value


def parse_rng_state(tensors: dict[str, torch.Tensor], metadata: dict[str, Any], where: str) -> RngState:
    """Check what `capture_rng_state` saved, so that applying it cannot fail halfway.

    Each generator's state is tried on a throwaway generator of the same kind.

    Raises:
        CheckpointError: names `where` (the rank file) and the field.
    """
    state = RngState()
    if _TORCH_CPU in tensors:
        state.torch_cpu = _byte_state(tensors[_TORCH_CPU], where, _TORCH_CPU, torch.get_rng_state().numel())
    cuda_keys = [k for k in tensors if k.startswith(_CUDA)]
    if not all(k[len(_CUDA) :].isdigit() for k in cuda_keys):
        raise _bad(where, "rng/cuda_*", cuda_keys, "device numbers must be integers")
    for key in sorted(cuda_keys, key=lambda k: int(k[len(_CUDA) :])):
        state.cuda.append(_byte_state(tensors[key], where, key, None))
    if _META_PYTHON in metadata:
        raw = metadata[_META_PYTHON]
        try:
            version, internal, gauss_next = json.loads(raw)
            state.python = (version, tuple(internal), gauss_next)
            random.Random().setstate(state.python)
        except (ValueError, TypeError, RecursionError) as error:
            raise _bad(where, f"metadata {_META_PYTHON}", raw, f"not a Python random state ({error})") from None
    np = _numpy()
    if np is not None and _META_NUMPY in metadata and _NUMPY_KEYS in tensors:
        raw = metadata[_META_NUMPY]
        try:
            kind, pos, has_gauss, cached = json.loads(raw)
            keys = tensors[_NUMPY_KEYS].numpy().astype("uint32")
            state.numpy = (kind, keys, pos, has_gauss, cached)
            np.random.RandomState().set_state(state.numpy)
        except (ValueError, TypeError, RecursionError) as error:
            raise _bad(where, f"metadata {_META_NUMPY}", raw, f"not a numpy random state ({error})") from None
    return state


def apply_rng_state(state: RngState) -> None:
    """Put back a parsed state; generators it did not save stay as they are."""
    if state.torch_cpu is not None:
        torch.set_rng_state(state.torch_cpu)
    if state.cuda and torch.cuda.is_available():
        for i, value in enumerate(state.cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(value, device=i)
    if state.python is not None:
        random.setstate(state.python)
    np = _numpy()
    if np is not None and state.numpy is not None:
        np.random.set_state(state.numpy)
