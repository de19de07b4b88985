"""DeepSpeed's `get_accelerator()` for the two devices zeroshard trains on: CUDA when torch sees
a GPU, the CPU otherwise (zeroshard/launch/device.py chooses the same way).

Integrations ask it for device names (transformers' ZeRO-3 loading calls
`get_accelerator().current_device_name()` and `.device_name(local_rank)`); the methods here are
the subset of DeepSpeed's accelerator interface that names, counts and synchronises devices,
with DeepSpeed's names and answers ("cuda:0", "cpu", "nccl"/"gloo").
"""

from __future__ import annotations

from typing import Any

import torch


class Accelerator:
    """The device zeroshard runs on, under DeepSpeed's accelerator method names."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"
        self._communication_backend_name = "nccl" if self._name == "cuda" else "gloo"

    def device_name(self, device_index: int | str | None = None) -> str:
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{int(device_index)}"

    def current_device_name(self) -> str:
        return self.device_name(torch.cuda.current_device() if self._name == "cuda" else None)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def __repr__(self) -> str:
        return f"zeroshard accelerator ({self._name}, {self._communication_backend_name})"


_ACCELERATOR: list[Accelerator] = []


def get_accelerator() -> Accelerator:
    """The process's accelerator (made on first call, as DeepSpeed's is)."""
    if not _ACCELERATOR:
        _ACCELERATOR.append(Accelerator())
    return _ACCELERATOR[0]


def set_accelerator(accel_obj: Any) -> None:
    """Use `accel_obj` for every later `get_accelerator()` (DeepSpeed's hook for tests)."""
    _ACCELERATOR[:] = [accel_obj]
