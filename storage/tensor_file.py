"""A safetensors file written one tensor at a time, for files larger than the memory at hand.

``safetensors.torch.save_file`` takes every tensor at once, so writing a converted model with it
holds the whole model in memory. A safetensors file is an 8-byte little-endian header length,
a JSON header (each tensor's dtype, shape and byte range; ``__metadata__``), then the tensors'
bytes back to back in that order. When every tensor's dtype and shape are known before any is
computed, the header can be written first and each tensor's bytes appended as it is made:
``TensorFileWriter``. The result is an ordinary safetensors file (read by ``safe_open``).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

__all__ = ["TensorFileWriter"]

_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
}

_NUMPY = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
}


class TensorFileWriter:
    """Write the safetensors file ``path`` from ``specs`` (``[(name, dtype, shape), ...]``, in the
    order the tensors will be given): the header at once, then each tensor's bytes with ``write``,
    in that order and exactly that dtype and shape. ``close`` checks that every one was written;
    a file left incomplete (an exception before ``close``) is the caller's to remove."""

    def __init__(self, path: str | os.PathLike, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata=None):
        header: dict = {}
        offset = 0
        self._order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in specs:
            if name in header:
                raise ValueError(f"tensor {name!r} is listed twice")
            if dtype not in _DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
            shape = tuple(int(d) for d in shape)
            size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8
            for d in shape:
                size *= d
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            self._order.append((name, dtype, shape))
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor | np.ndarray) -> None:
        """Append ``tensor`` (a torch tensor, or a numpy array such as a read-only view of a mapped
        file, written without a copy), which must be the next one listed."""
        if self._next >= len(self._order):
            raise ValueError(f"tensor {name!r} is one more than the file lists")
        want, dtype, shape = self._order[self._next]
        got = _NUMPY.get(tensor.dtype) if isinstance(tensor, np.ndarray) else tensor.dtype
        if name != want or got != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"tensor {name!r} {tensor.dtype} {tuple(tensor.shape)} given where {want!r} {dtype} {shape} is next"
            )
        if isinstance(tensor, np.ndarray):
            data = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
        else:
            data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        # bytes as they lie in memory (little-endian on every platform torch runs chatkv on)
        if data.size:
            self._file.write(memoryview(data))
        self._next += 1

    def close(self) -> None:
        """Flush, sync and close; raises if a listed tensor was not written."""
        missing = [n for n, _, _ in self._order[self._next :]]
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if missing:
            raise ValueError(f"{self.path}: {len(missing)} listed tensors were never written ({missing[0]!r}, ...)")

    def abandon(self) -> None:
        """Close without checking (the caller removes the file)."""
        self._file.close()
