"""Writing a document store (layout in ``store.py``): documents appended shard by shard, never whole in memory.

``StoreWriter`` takes documents in store order, a batch at a time, and cuts them into shards of at most
``shard_tokens`` tokens (whole documents; a longer document gets a shard of its own; a new source
starts a new shard). A shard's ``.npy`` files are written as the documents come: their headers are
rewritten with the final shape when the shard closes (a version-1.0 header keeps its 128 bytes for any
length), so memory is one call's documents plus a few counters per shard. ``close`` writes
``index.json`` (each shard's directory, source, counts and file sizes), ``meta.json`` and the
completion marker last.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from densebatch.data.store.joined import FORMAT, write_index
from densebatch.data.store.store_io import document_loss_tokens, write_marker

DEFAULT_SHARD_TOKENS = 1 << 27  # 128M tokens: 256 MB of uint16 ids and 128 MB of mask a shard
_SHARD = "shard-{:06d}"


def token_dtype(meta: dict) -> np.dtype:
    """uint16 when every id of the store's vocabulary (``meta["vocab_size"]``) fits, else int32: half the disk
    and the reads for most tokenizers (GPT-2's 50,257, the byte-level default)."""
    vocab = meta.get("vocab_size")
    return np.dtype(np.uint16) if isinstance(vocab, int) and 0 < vocab <= 1 << 16 else np.dtype(np.int32)


def npy_header(dtype: np.dtype, n: int) -> bytes:
    """The version-1.0 ``.npy`` header of a 1-D array of ``n`` ``dtype`` items: 128 bytes for any ``n``, so a file
    written as its items come gets its final header written over the first."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)}
    )
    return buf.getvalue()


class _Shard:
    """One shard's four ``.npy`` files, open for appending."""

    FILES = ("tokens", "loss_mask", "lengths", "doc_loss")

    def __init__(self, directory: Path, tok_dtype: np.dtype, source: int) -> None:
        directory.mkdir()
        self.directory, self.source = directory, source
        self.dtypes = dict(zip(self.FILES, (tok_dtype, np.dtype(np.uint8), np.dtype(np.uint32), np.dtype(np.uint32))))
        self.files = {n: open(directory / f"{n}.npy", "wb") for n in self.FILES}  # noqa: SIM115
        for n, f in self.files.items():
            f.write(npy_header(self.dtypes[n], 0))
        self.documents = self.tokens = self.loss_tokens = self.max_length = 0

    def add(self, tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        if self.dtypes["tokens"] == np.uint16 and len(tokens) and not 0 <= int(np.min(tokens)) <= int(np.max(tokens)) < 1 << 16:
            raise ValueError("token ids outside 0 .. 65535 for a uint16 store: the meta's vocab_size undercounts the ids")
        doc_loss = document_loss_tokens(np.concatenate([[0], np.cumsum(lengths)]), mask)
        for name, arr in zip(self.FILES, (tokens, mask, lengths, doc_loss)):
            self.files[name].write(np.ascontiguousarray(arr).astype(self.dtypes[name], copy=False).tobytes())
        self.documents += len(lengths)
        self.tokens += int(lengths.sum())
        self.loss_tokens += int(doc_loss.sum(dtype=np.int64))
        self.max_length = max(self.max_length, int(lengths.max(initial=0)))

    def close(self) -> dict:
        counts = {"tokens": self.tokens, "loss_mask": self.tokens, "lengths": self.documents, "doc_loss": self.documents}
        for name, f in self.files.items():
            head = npy_header(self.dtypes[name], counts[name])
            assert len(head) == len(npy_header(self.dtypes[name], 0)), "a .npy header changed its size"
            f.seek(0)
            f.write(head)
            f.close()
        return {
            "path": self.directory.name,
            "source": self.source,
            "documents": self.documents,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "max_length": self.max_length,
            "sizes": {f"{n}.npy": (self.directory / f"{n}.npy").stat().st_size for n in self.FILES},
        }


class StoreWriter:
    """A store's shards written document by document into ``directory`` (new or empty; see the module
    docstring); ``meta`` goes to ``meta.json`` with the counts added."""

    def __init__(self, directory: Path, meta: dict, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> None:
        directory.mkdir(exist_ok=True)
        self.directory, self.meta, self.shard_tokens = directory, meta, max(1, int(shard_tokens))
        self.token_dtype = token_dtype(meta)
        self.shards: list[dict] = []
        self.current: _Shard | None = None

    def extend(self, tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray, source: int = 0) -> None:
        """Append documents laid end to end: their ``tokens`` and ``mask``, cut by ``lengths``, all of ``source``."""
        lengths = np.asarray(lengths, np.int64)
        ends = np.cumsum(lengths)
        assert len(tokens) == len(mask) == (int(ends[-1]) if len(ends) else 0), "tokens, mask and lengths disagree"
        d = 0
        while d < len(lengths):
            if (
                self.current is None
                or self.current.source != source
                or (self.current.tokens and self.current.tokens + int(lengths[d]) > self.shard_tokens)
            ):
                self._next_shard(source)
            room = self.shard_tokens - self.current.tokens
            base = int(ends[d] - lengths[d])
            e = max(d + 1, int(np.searchsorted(ends, base + room, side="right")))  # whole documents that fit
            a, b = base, int(ends[e - 1])
            self.current.add(tokens[a:b], mask[a:b], lengths[d:e])
            d = e

    def _next_shard(self, source: int) -> None:
        if self.current is not None:
            self.shards.append(self.current.close())
        self.current = _Shard(self.directory / _SHARD.format(len(self.shards)), self.token_dtype, source)

    def close(self) -> None:
        if self.current is not None:
            self.shards.append(self.current.close())
            self.current = None
        names = write_index(self.directory, self.shards, self.meta)
        write_marker(self.directory, {"format": FORMAT, "sizes": {n: (self.directory / n).stat().st_size for n in names}})


def write_store_files(
    directory: Path,
    *,
    tokens: np.ndarray,
    offsets: np.ndarray,
    loss_mask: np.ndarray,
    meta: dict,
    source: np.ndarray | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> None:
    """A store of documents held in memory, written into ``directory`` (new or empty; marker last)."""
    offsets = np.asarray(offsets, np.int64)
    assert offsets[0] == 0 and offsets[-1] == len(tokens) == len(loss_mask)
    lengths = np.diff(offsets)
    src = np.zeros(len(lengths), np.int64) if source is None else np.asarray(source, np.int64)
    assert len(src) == len(lengths) and (np.diff(src) >= 0).all(), "documents lie source after source"
    w = StoreWriter(directory, meta, shard_tokens)
    cuts = np.flatnonzero(np.diff(src)) + 1
    for a, b in zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [len(src)]]).tolist()):
        t0, t1 = int(offsets[a]), int(offsets[b])
        w.extend(np.asarray(tokens[t0:t1]), np.asarray(loss_mask[t0:t1]), lengths[a:b], int(src[a]) if b > a else 0)
    w.close()


__all__ = ["DEFAULT_SHARD_TOKENS", "StoreWriter", "token_dtype", "write_store_files"]
