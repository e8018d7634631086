"""A token file whose documents' ids lie at several byte alignments (or dtypes), mapped once per alignment and dtype.

litdata's chunks and MDS shards put each document's ids after a per-item header, so the ids of one
file may begin at any byte: 8-byte ids 4 bytes off their alignment (litdata), or ids of another dtype
in each sample (MDS's ``ndarray`` column). Such a file is memory-mapped once per (dtype, byte offset
modulo the id size) its documents need, the mappings read end to end as one token space (as
``joined.read_as_one`` joins them), and each document placed in the mapping its first byte falls on::

    parts          [{"file", "dtype", "offset" (bytes), "tokens", "size" (the file's)}, ...]: the mappings, in order
    doc_starts     (documents,) int64: each document's first token in those mappings end to end
    doc_lengths    (documents,) int64: its ids
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class MappedFile:
    """One checked file of a corpus: its mappings and each document's place in them (module docstring)."""

    path: Path
    parts: list[dict]
    doc_starts: np.ndarray
    doc_lengths: np.ndarray


def place(
    path: Path, *, size: int, byte_starts: np.ndarray, lengths: np.ndarray, codes: np.ndarray, dtypes: dict[int, np.dtype]
) -> MappedFile:
    """``path`` (``size`` bytes) mapped once per (dtype, alignment) of its documents: document ``i``'s ids begin
    at byte ``byte_starts[i]``, in dtype ``dtypes[codes[i]]``; the mappings ordered by code, then by offset. A
    file of no document: one empty mapping, of the smallest code's dtype."""
    byte_starts, codes = np.asarray(byte_starts, np.int64), np.asarray(codes, np.int64)
    itemsize = np.zeros(max(dtypes) + 1, np.int64)
    itemsize[list(dtypes)] = [d.itemsize for d in dtypes.values()]
    rem = byte_starts % itemsize[codes]
    parts, base = [], 0
    doc_starts = np.zeros(len(byte_starts), np.int64)
    groups = np.unique(np.stack([codes, rem], 1), axis=0) if len(codes) else np.zeros((0, 2), np.int64)
    for code, r in groups.tolist():
        dt = dtypes[code]
        sel = (codes == code) & (rem == r)
        count = (size - r) // dt.itemsize
        doc_starts[sel] = base + (byte_starts[sel] - r) // dt.itemsize
        parts.append({"file": str(path), "dtype": dt.str, "offset": r, "tokens": int(count), "size": size})
        base += count
    if not parts:
        parts.append({"file": str(path), "dtype": dtypes[min(dtypes)].str, "offset": 0, "tokens": 0, "size": size})
    return MappedFile(path, parts, doc_starts, np.asarray(lengths, np.int64))


def map_part(part: dict) -> np.ndarray:
    """One mapping (``MappedFile.parts``, or a corpus entry's recorded part), read-only."""
    dtype = np.dtype(part["dtype"])
    if not part["tokens"]:
        return np.zeros(0, dtype)
    return np.memmap(part["file"], dtype, mode="r", offset=part["offset"], shape=(part["tokens"],))
