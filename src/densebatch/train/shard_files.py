"""safetensors files written in one streaming pass that also hashes them, and read back by row ranges.

``write_safetensors(path, tensors)`` writes the format safetensors defines (an 8-byte little-endian
header length, a JSON header of dtype / shape / byte offsets, 8-byte aligned, then the raw bytes in
row-major order) straight from each tensor's memory: no serialised copy of the file is built, and the
SHA-256 of what was written comes back with its size, so a checkpoint's writer never reads its own
files again to hash them. Every file it writes is one that ``safetensors.safe_open`` reads.

``RowReader`` reads rows ``[start, stop)`` of a tensor through safetensors' slices (the file is
memory-mapped: only those rows' bytes are read), which is how a rank takes its share of a checkpoint
written by any number of ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_ALIGN = 8


def header_bytes(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a file holding ``specs`` (name -> dtype, shape), in that order."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (dtype, shape) in specs.items():
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % _ALIGN)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw row-major bytes of ``t`` (copied to the CPU, and made contiguous, only when it is not already)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> dict:
    """Write ``tensors`` to ``path`` (fsynced) and return ``{"size": bytes, "sha256": hex}`` of the file."""
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for chunk in [header_bytes(specs, metadata)] + [tensor_bytes(t) for t in tensors.values()]:
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


class RowReader:
    """Rows of tensors held by safetensors files, each file opened once (memory-mapped) while in use."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._open: dict[str, object] = {}

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()

    def _file(self, name: str):
        if name not in self._open:
            handle = safe_open(str(self.directory / name), framework="pt")
            self._open[name] = handle.__enter__()
        return self._open[name]

    def rows(self, name: str, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` along the first dimension of ``key`` in file ``name`` (all of it when both
        are None; a 0-dimensional tensor is always read whole)."""
        f = self._file(name)
        if start is None and stop is None:
            return f.get_tensor(key)
        piece = f.get_slice(key)
        if not piece.get_shape():
            return f.get_tensor(key)
        return piece[start:stop]
