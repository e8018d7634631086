"""litdata ``optimize`` output of token sequences (``index.json`` + ``chunk-*.bin``), checked and read in place.

The layout ``litdata.streaming.writer.BinaryWriter`` writes with the default ``PyTreeLoader``, an item
a document, each item one 1-D tensor or array of ids (``data_format`` ``["no_header_tensor:K"]`` or
``["no_header_numpy:K"]``), uncompressed, little-endian::

    index.json     {"chunks": [{"filename", "chunk_size" (items), "chunk_bytes", ...}], "config": {...}}
    chunk-R-I.bin  uint32 n, uint32 offsets[n + 1] (each item's byte offset; the last: the file's end),
                   then each item: uint32 the leaf's byte size, then the leaf's bytes (the ids)

``K`` indexes litdata's dtype tables (``litdata.constants``: torch's, numpy's). An item's ids begin
4 bytes after its offset, so 8-byte ids may lie 4 bytes off their alignment: such a chunk is mapped
twice (at 0 and at 4 bytes), each document read from the mapping its start falls on. Output of
``TokensLoader`` (ids end to end, no document boundaries), compressed or encrypted chunks and items of
several leaves are refused in one line, as is anything that disagrees with itself.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from densebatch.data.store.formats.mapped import MappedFile, place
from densebatch.errors import DataError

INDEX = "index.json"
_TORCH = {11: "u1", 12: "i1", 13: "i2", 14: "i2", 15: "i4", 16: "i4", 17: "i8", 18: "i8", 20: "u2"}
_NUMPY = {0: "i1", 1: "i2", 2: "i4", 3: "i8", 4: "u1", 5: "u2", 6: "u4", 7: "u8"}


def chunks_of(path: str) -> list[Path]:
    """The chunk files the dataset folder ``path`` (or its ``index.json``) lists, in order; a listed chunk
    that is missing is a ``DataError`` naming it."""
    p = Path(path)
    folder = p.parent if p.name == INDEX else p
    index = _index(folder / INDEX)
    out = []
    for c in index["chunks"]:
        f = folder / str(c.get("filename", ""))
        if not f.is_file():
            raise DataError(f"{f}: missing (listed by {folder / INDEX})")
        out.append(f)
    if not out:
        raise DataError(f"{folder / INDEX}: lists no chunk")
    return out


@functools.lru_cache(maxsize=16)
def _index_cached(path: str, mtime: int) -> dict:
    try:
        index = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable litdata index ({(str(e).splitlines() or [type(e).__name__])[0]})") from None
    if not isinstance(index, dict) or not isinstance(index.get("chunks"), list) or not isinstance(index.get("config"), dict):
        raise DataError(f"{path}: not a litdata index (no chunks and config)")
    return index


def _index(path: Path) -> dict:
    if not path.is_file():
        raise DataError(f"{path}: missing (data.format litdata reads the folder litdata.optimize wrote)")
    return _index_cached(str(path), path.stat().st_mtime_ns)


def _dtype(index_path: Path, config: dict) -> np.dtype:
    loader = config.get("item_loader")
    if loader == "TokensLoader":
        raise DataError(
            f"{index_path}: written with TokensLoader (ids end to end, no document boundaries): write one tensor of ids "
            "an item with the default PyTreeLoader"
        )
    for key in ("compression", "encryption"):
        if config.get(key):
            raise DataError(f"{index_path}: {key} {config[key]!r}: only uncompressed, unencrypted chunks are memory-mapped")
    fmt = config.get("data_format") or []
    if loader != "PyTreeLoader" or len(fmt) != 1:
        raise DataError(f"{index_path}: items of {fmt} ({loader}): one 1-D tensor or array of token ids an item is read")
    kind, _, code = str(fmt[0]).partition(":")
    table = {"no_header_tensor": _TORCH, "no_header_numpy": _NUMPY}.get(kind)
    if table is None or not code.isdigit() or int(code) not in table:
        raise DataError(f"{index_path}: items of {fmt[0]}: not integer token ids this reader knows")
    return np.dtype("<" + table[int(code)])


def read_chunk(chunk: Path) -> MappedFile:
    """Check ``chunk`` against its header and its dataset's index and map it; ``DataError`` naming the file."""
    index_path = chunk.parent / INDEX
    dtype = _dtype(index_path, _index(index_path)["config"])
    size = chunk.stat().st_size
    with open(chunk, "rb") as f:
        head = f.read(4)
        n = int(np.frombuffer(head, "<u4")[0]) if len(head) == 4 else -1
        raw = f.read(4 * (n + 1)) if n >= 0 else b""
    if n < 0 or len(raw) != 4 * (n + 1):
        raise DataError(f"{chunk}: {size} bytes: cut short before its header's item offsets")
    offsets = np.frombuffer(raw, "<u4").astype(np.int64)
    if offsets[0] != 4 * (n + 2) or (np.diff(offsets) < 4).any() or offsets[-1] != size:
        what = "cut short" if offsets[-1] > size else "its item offsets disagree with its size"
        raise DataError(f"{chunk}: {size} bytes, its header's {n} items end at byte {int(offsets[-1])}: {what}")
    raw_map = np.memmap(chunk, np.uint8, mode="r")
    sizes = np.ascontiguousarray(raw_map[offsets[:-1, None] + np.arange(4)]).view("<u4").reshape(-1).astype(np.int64)
    if (sizes + 4 != np.diff(offsets)).any() or (sizes % dtype.itemsize).any():
        raise DataError(f"{chunk}: an item's size disagrees with its offsets or with {dtype.name} ids ({index_path.name})")
    starts = offsets[:-1] + 4  # (n,) byte where each document's ids begin
    return place(
        chunk, size=size, byte_starts=starts, lengths=sizes // dtype.itemsize, codes=np.zeros(n, np.int64), dtypes={0: dtype}
    )
