"""Megatron / NeMo indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, the ``MMIDIDX`` layout), checked and read in place.

The layout ``megatron.core.datasets.indexed_dataset`` writes (``IndexedDatasetBuilder`` /
``_IndexWriter``, version 1), little-endian::

    .idx  b"MMIDIDX\\x00\\x00"  uint64 version (1)  uint8 dtype code  uint64 S (sequences)  uint64 D
          int32 sequence_lengths[S]  int64 sequence_pointers[S] (bytes into .bin)
          int64 document_indices[D] (0, then the sequence that ends each document: D - 1 documents)
          [int8 sequence_modes[S]: multimodal datasets only]
    .bin  every sequence's tokens end to end, in the dtype of the code:
          1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16

A document is its sequences end to end (``preprocess_data`` writes one sequence a document unless
it splits sentences). Everything is checked against everything else before training: the header,
the dtype (a float dtype holds no token ids), the index's size against its counts, the pointers
against the lengths, the document indices, and the ``.bin``'s size against the tokens the index
describes; any disagreement is one ``DataError`` naming the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from densebatch.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_FLOATS = {6: "float64", 7: "float32"}


@dataclass(frozen=True)
class IndexedFile:
    """One checked prefix: its ``.bin`` memory-mapped, and each document's first token and length."""

    bin_path: Path
    idx_path: Path
    tokens: np.ndarray  # (tokens,) memory-mapped .bin, in its dtype
    doc_starts: object  # (documents,) int64 token offsets into tokens, sliced a block at a time (Spans)
    doc_lengths: object  # (documents,) int64, the same


def prefixes_of(path: str) -> list[Path]:
    """The prefixes ``path`` names: ``PREFIX`` itself, ``PREFIX.bin`` / ``PREFIX.idx``, or a directory
    (every ``*.idx`` in it, sorted)."""
    p = Path(path)
    if p.suffix in (".bin", ".idx"):
        return [p.with_suffix("")]
    if p.is_dir():
        found = sorted(q.with_suffix("") for q in p.glob("*.idx"))
        if not found:
            raise DataError(f"{p}: no Megatron index (*.idx) in this directory")
        return found
    return [p]


def read_indexed(prefix: Path) -> IndexedFile:
    """Check ``prefix``'s ``.idx`` and ``.bin`` against each other and map them; ``DataError`` naming the file."""
    idx, binf = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for f in (idx, binf):
        if not f.is_file():
            raise DataError(f"{f}: missing (data.format megatron reads PREFIX.bin with PREFIX.idx)")
    size = idx.stat().st_size
    with open(idx, "rb") as fh:
        head = fh.read(_HEADER)
    if len(head) < _HEADER or head[: len(MAGIC)] != MAGIC:
        raise DataError(f"{idx}: not a Megatron indexed dataset index (no MMIDIDX header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC) :])
    if version != 1:
        raise DataError(f"{idx}: index version {version}; only version 1 (megatron-core's) is read")
    if code in _FLOATS:
        raise DataError(f"{idx}: its tokens are {_FLOATS[code]} (dtype code {code}), not token ids")
    if code not in DTYPES:
        raise DataError(f"{idx}: unknown dtype code {code} (megatron-core writes 1-8)")
    dtype = np.dtype(DTYPES[code])
    plain = _HEADER + 12 * n_seq + 8 * n_doc
    if size not in (plain, plain + n_seq) or n_doc < 1:
        raise DataError(
            f"{idx}: {size} bytes, but its header's {n_seq} sequences and {n_doc} document indices need {plain} "
            "(cut short or not written whole)"
        )
    seq_len = IndexArray(idx, np.int32, _HEADER, n_seq)
    pointers = IndexArray(idx, np.int64, _HEADER + 4 * n_seq, n_seq)
    doc_idx = IndexArray(idx, np.int64, _HEADER + 12 * n_seq, n_doc)
    total = _check_sequences(idx, seq_len, pointers, dtype.itemsize)
    d0, dn = (int(doc_idx[0]), int(doc_idx[-1]))
    if d0 != 0 or dn != n_seq or any((np.diff(doc_idx[a : a + _BLOCK + 1]) < 0).any() for a in range(0, n_doc, _BLOCK)):
        raise DataError(f"{idx}: its document indices do not run from 0 to its {n_seq} sequences in order")
    have = binf.stat().st_size
    if have != total * dtype.itemsize:
        what = "cut short" if have < total * dtype.itemsize else "longer than its index says"
        raise DataError(
            f"{binf}: {have} bytes, but {idx.name} describes {total} {dtype.name} tokens ({total * dtype.itemsize} bytes): {what}"
        )
    tokens = np.memmap(binf, dtype, mode="r") if total else np.zeros(0, dtype)
    spans = Spans(pointers, doc_idx, total, dtype.itemsize)
    return IndexedFile(binf, idx, tokens, spans.starts, spans.lengths)


_BLOCK = 1 << 22  # sequences or documents checked or read at once: 32 MB of int64


def _check_sequences(idx: Path, seq_len: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """The tokens the sequences hold, after checking, a block at a time, that each pointer is the previous
    one plus its sequence's bytes (``DataError`` naming the index otherwise)."""
    at = 0  # the byte the next sequence must begin at
    for a in range(0, len(seq_len), _BLOCK):
        n = seq_len[a : a + _BLOCK].astype(np.int64)
        if (n < 0).any():
            raise DataError(f"{idx}: a negative sequence length")
        want = at + np.cumsum(n * itemsize) - n * itemsize
        if (pointers[a : a + _BLOCK] != want).any():
            raise DataError(f"{idx}: its sequence pointers disagree with its sequence lengths")
        at = int(want[-1] + n[-1] * itemsize)
    return at // itemsize


class IndexArray:
    """One array of the ``.idx``, read by positioned reads of the slices asked for (``a[i]``, ``a[i:j]``):
    a scan of a 100M-document index leaves none of it resident (a mapping would keep its pages)."""

    def __init__(self, path: Path, dtype, offset: int, n: int) -> None:
        self.path, self.dtype, self.offset, self.n = path, np.dtype(dtype).newbyteorder("<"), offset, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, _ = key.indices(self.n)
            b = max(a, b)
            return np.fromfile(self.path, self.dtype, b - a, offset=self.offset + a * self.dtype.itemsize).astype(
                self.dtype.newbyteorder("=")
            )
        i = int(key) + (self.n if int(key) < 0 else 0)
        return self[i : i + 1][0]


class Spans:
    """Each document's first token and length, computed for the slice asked for from the index's memory-mapped
    pointers and document indices (``starts[a:b]``, ``lengths[a:b]``, ``len``): nothing held per document."""

    def __init__(self, pointers: np.ndarray, doc_idx: np.ndarray, total: int, itemsize: int) -> None:
        self.pointers, self.doc_idx, self.total, self.itemsize = pointers, doc_idx, total, itemsize
        self.starts, self.lengths = _Part(self, 0), _Part(self, 1)

    def __len__(self) -> int:
        return len(self.doc_idx) - 1

    def bounds(self, a: int, b: int) -> np.ndarray:
        """(b - a + 1,) int64: the token where documents a .. b begin (the last: where b - 1 ends)."""
        seq = np.asarray(self.doc_idx[a : b + 1], np.int64)
        inside = seq < len(self.pointers)
        out = np.full(len(seq), self.total, np.int64)
        if inside.any():  # ascending: one read of the pointers they span
            lo, hi = int(seq[inside][0]), int(seq[inside][-1])
            out[inside] = self.pointers[lo : hi + 1][seq[inside] - lo] // self.itemsize
        return out


class _Part:
    def __init__(self, spans: Spans, which: int) -> None:
        self.spans, self.which = spans, which

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, key: slice) -> np.ndarray:
        a, b, _ = key.indices(len(self.spans))
        bounds = self.spans.bounds(a, max(a, b))
        return bounds[:-1] if self.which == 0 else np.diff(bounds)
