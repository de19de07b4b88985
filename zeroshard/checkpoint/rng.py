"""Random-number generator state of one process, as safetensors tensors plus string metadata.

A resumed run draws the same dropout masks (torch), the same Python `random` numbers and
the same numpy numbers as the uninterrupted one would have, so RNG state is saved per rank:
torch's CPU generator, every CUDA generator when CUDA is initialised, Python's `random`,
and numpy's global generator when numpy is installed.
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch

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


def restore_rng_state(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` returned; generators it did not save stay as they are."""
    if _TORCH_CPU in tensors:
        torch.set_rng_state(tensors[_TORCH_CPU])
    cuda_states = sorted((k for k in tensors if k.startswith(_CUDA)), key=lambda k: int(k[len(_CUDA) :]))
    if cuda_states and torch.cuda.is_available():
        for i, key in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(tensors[key], device=i)
    if _META_PYTHON in metadata:
        version, internal, gauss_next = json.loads(metadata[_META_PYTHON])
        random.setstate((version, tuple(internal), gauss_next))
    np = _numpy()
    if np is not None and _META_NUMPY in metadata and _NUMPY_KEYS in tensors:
        kind, pos, has_gauss, cached = json.loads(metadata[_META_NUMPY])
        keys = tensors[_NUMPY_KEYS].numpy().astype("uint32")
        np.random.set_state((kind, keys, pos, has_gauss, cached))
