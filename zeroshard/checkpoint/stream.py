"""Writing a safetensors file one tensor at a time, so the host never holds the whole state dict.

[Note: streamed safetensors]
A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range, and the bytes. Every range follows from the names, dtypes and shapes
alone, so the header can be written first and each tensor's bytes placed where it says when the
tensor is ready: a rank file as each flat's state comes to the host, a consolidated fp32 file as
each parameter is assembled from its fragments, a 16-bit export as each unit is gathered. The host
then holds one tensor at a time (plus, on an accelerator, its copy on the way), not the file.
The bytes go from the tensor's own memory to the file (a ctypes view, no copy on the CPU). The
file reads back with `safetensors.safe_open` and `load_file` as one safetensors' own writer made
(tests/unit/checkpoint/test_stream.py); only the order of the entries may differ.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["StreamedSafetensors", "safetensors_dtype"]

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_ALIGN = 8  # safetensors pads its header so the data starts 8-byte aligned


def safetensors_dtype(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"{dtype}: safetensors has no such dtype") from None


class StreamedSafetensors:
    """A safetensors file whose tensors are written one by one, in any order (the note above).

    Args:
        path: the file to create (truncated if it exists).
        entries: (name, dtype, shape) of every tensor, in the order their bytes are laid out.
        metadata: the header's `__metadata__` (strings).
    """

    def __init__(self, path: str | os.PathLike, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._ranges: dict[str, tuple[int, int]] = {}
        self._specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in entries:
            if name in self._ranges:
                raise ValueError(f"{name!r}: named twice in one safetensors file")
            shape = tuple(int(d) for d in shape)
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            header[name] = {"dtype": safetensors_dtype(dtype), "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._ranges[name] = (offset, offset + nbytes)
            self._specs[name] = (dtype, shape)
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-(len(text) + 8) % _ALIGN)
        self._data_start = 8 + len(text)
        self._size = self._data_start + offset
        self._written: set[str] = set()
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close(), also on error
        try:
            self._file.write(struct.pack("<Q", len(text)))
            self._file.write(text)
            self._file.truncate(self._size)  # every byte exists; tensors fill their ranges
        except BaseException:
            self._file.close()
            raise

    @property
    def names(self) -> list[str]:
        return list(self._ranges)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Place `tensor`'s bytes (any device; brought to the host here) at `name`'s range."""
        if name not in self._ranges:
            raise KeyError(f"{name!r}: not in this file's header")
        dtype, shape = self._specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name!r}: {tensor.dtype} {tuple(tensor.shape)}, the header says {dtype} {shape}")
        host = tensor.detach().to("cpu").contiguous()
        start, end = self._ranges[name]
        if end > start:
            view = (ctypes.c_char * (end - start)).from_address(host.data_ptr())
            self._file.seek(self._data_start + start)
            self._file.write(memoryview(view).cast("B"))
        self._written.add(name)

    def close(self) -> None:
        """Flush and close; every tensor of the header must have been written."""
        missing = [name for name in self._ranges if name not in self._written]
        self._file.close()
        if missing:
            raise RuntimeError(f"{self.path}: {len(missing)} tensor(s) never written (first: {missing[:3]})")

    def abort(self) -> None:
        self._file.close()

    def __enter__(self) -> StreamedSafetensors:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
