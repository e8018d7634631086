"""safetensors files written in one streaming pass that also hashes them, and read back by row ranges.

``write_safetensors(tensors, path)`` writes the format safetensors defines (an 8-byte little-endian
header length, a JSON header of dtype / shape / byte offsets, 8-byte aligned, then the raw bytes in
row-major order) straight from each tensor's memory: no serialised copy of the file is built, and the
SHA-256 of what was written comes back with its size, so a checkpoint's writer never reads its own
files again to hash them. Every file it writes is one that ``safetensors.safe_open`` reads.

``RowReader`` reads rows ``[start, stop)`` of a tensor with plain positioned reads into a tensor it
allocates (or one the caller gives: a rank's own shard), checking the header against the file's size.
No memory map: the pages read go to the page cache, not to the process's resident memory, so a rank
that reads its rows of a large model holds those rows and nothing else. Used by checkpoints (each rank
its own rows of a sharded checkpoint) and by the sharded build of a Hugging Face model. A leaf module:
imports torch only.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

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


MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size


def read_header(path: str | Path) -> tuple[int, dict[str, dict]]:
    """(offset of the data, {key: {"dtype", "shape", "data_offsets"}}) of a safetensors file, checked: a
    header that does not parse, or offsets that do not fit the file, raise ``ValueError``."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{path}: header of {n} bytes does not fit a file of {size}")
        header = json.loads(f.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    names = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    for key, e in header.items():
        dtype, shape, (lo, hi) = names[e["dtype"]], e["shape"], e["data_offsets"]
        if hi - lo != dtype.itemsize * int(torch.Size(shape).numel()) or not 0 <= lo <= hi <= size - 8 - n:
            raise ValueError(f"{path}: {key}: offsets {lo}..{hi} do not hold a {e['dtype']} tensor of shape {shape}")
        e["torch_dtype"] = dtype
    return 8 + n, header


class RowReader:
    """Rows of tensors held by safetensors files in ``directory``: headers read once, rows by positioned reads."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._files: dict[str, tuple] = {}

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc) -> None:
        for f, _, _ in self._files.values():
            f.close()
        self._files.clear()

    def _file(self, name: str):
        if name not in self._files:
            start, header = read_header(self.directory / name)
            self._files[name] = (open(self.directory / name, "rb"), start, header)
        return self._files[name]

    def shape(self, name: str, key: str) -> list[int]:
        return list(self._file(name)[2][key]["shape"])

    def dtype(self, name: str, key: str) -> torch.dtype:
        return self._file(name)[2][key]["torch_dtype"]

    def rows(
        self, name: str, key: str, start: int | None = None, stop: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``[start, stop)`` along the first dimension of ``key`` in file ``name`` (all of it when both
        are None; a 0-dimensional tensor is always read whole), into ``out`` when it is given (contiguous,
        of the file's dtype and the rows' shape) or a new tensor."""
        f, data, header = self._file(name)
        e = header[key]
        shape, dtype = list(e["shape"]), e["torch_dtype"]
        if not shape:
            start, stop, rows_shape = 0, 1, []
        else:
            start, stop = start or 0, shape[0] if stop is None else stop
            if not 0 <= start <= stop <= shape[0]:
                raise ValueError(f"{name}: {key}: rows {start}..{stop} are outside its {shape[0]}")
            rows_shape = [stop - start, *shape[1:]]
        row_bytes = dtype.itemsize * int(torch.Size(shape[1:]).numel()) if shape else dtype.itemsize
        t = torch.empty(rows_shape, dtype=dtype) if out is None else out
        if t.dtype != dtype or list(t.shape) != rows_shape or not t.is_contiguous():
            raise ValueError(f"{name}: {key}: cannot read rows {start}..{stop} into a {t.dtype} tensor of shape {list(t.shape)}")
        if t.numel():
            f.seek(data + e["data_offsets"][0] + start * row_bytes)
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            if f.readinto(view) != len(view):
                raise ValueError(f"{name}: {key}: the file ends inside rows {start}..{stop}")
        return t
