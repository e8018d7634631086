"""DocumentStore: one prepared split on disk — shards of memory-mapped tokens, loss mask and lengths, with an index.

Layout of a store directory (format 4)::

    index.json     the shards in order: directory, source, documents, tokens, loss tokens, longest, file sizes
    meta.json      eos_id, pad_id, vocab_size, mask_id, special_ids, tokenizer, sources (names), counts, ...
    COMPLETE       written last: the sizes of index.json and meta.json; without it the directory is not a store
    shard-000000/  whole documents, at most data.shard_tokens tokens (a longer document alone), one source:
        tokens.npy     uint16 (tokens,)   the documents back to back (int32 for vocabularies over 65,536 ids)
        loss_mask.npy  uint8  (tokens,)   1 = this token, *as a target*, carries loss
        lengths.npy    uint32 (docs,)     each document's tokens
        doc_loss.npy   uint32 (docs,)     loss tokens of each whole document (step sizes by loss tokens)

The first token of a document is never a target (nothing precedes it), so its mask is always 0.
A mixture's documents lie source after source, the layout ``mixture.Selection`` plans from;
``meta["sources"]`` names them in that order. A mixture's split holds no shard of its own: its index
points at its sources' shards (``joined.py``). Training reads tokens, mask and lengths by
``read_ranges`` (positioned reads), never through the mapping, and finds a document's first token
from the lengths and one offset every 64 documents (``doc_spans``): nothing held grows by more than
a fraction of a byte a document. Writes (``store_write.py``) go to a temporary sibling directory
(``densebatch.atomic.staged_dir``): every file is fsynced, then the directory is renamed into place
(atomic on POSIX), so a crash mid-write leaves only a ``.tmp-*`` directory, never a directory that
``open`` would trust. A store of an older format is refused with one line, never misread.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from densebatch.atomic import staged_dir
from densebatch.data.store.joined import FORMAT, INDEX, JoinedArray, read_index
from densebatch.data.store.store_io import (
    MARKER,
    WINDOW_TOKENS,
    document_loss_tokens,
    marker_ok,
    read_ranges,
    read_window,
    take,
    windows,
    write_marker,
)
from densebatch.data.store.store_write import DEFAULT_SHARD_TOKENS, write_store_files
from densebatch.errors import DataError

STORE_FORMAT = FORMAT
_EVERY = 64  # documents between two held offsets (doc_spans)
_SPANS = 1 << 14  # documents whose spans one read finds (at most 2^20 lengths read, ~24 MB)
__all__ = [
    "MARKER",
    "STORE_FORMAT",
    "WINDOW_TOKENS",
    "DocumentStore",
    "document_loss_tokens",
    "marker_ok",
    "read_ranges",
    "read_window",
    "staged_store",
    "take",
    "windows",
    "write_marker",
]


@contextlib.contextmanager
def staged_store(final: Path) -> Iterator[Path]:
    """A temporary directory to fill, published as ``final`` (``densebatch.atomic.staged_dir``).

    A ``final`` that exists without a valid marker (left by a crash of an older version) is removed
    first; one that is complete (another writer won the race) is kept and the staged copy dropped."""
    if final.exists() and not marker_ok(final):
        shutil.rmtree(final, ignore_errors=True)
    with staged_dir(final, replace=False) as tmp:
        yield tmp


def _one(parts: list[np.ndarray], dtype) -> np.ndarray | JoinedArray:
    """A shard's array itself, or the shards' arrays read as one."""
    if len(parts) == 1:
        return parts[0]
    return JoinedArray(parts) if parts else np.zeros(0, dtype)


def _shards_ok(shards: list[dict]) -> bool:
    try:
        return all((Path(e["dir"]) / n).stat().st_size == size for e in shards for n, size in e["sizes"].items())
    except (OSError, KeyError, TypeError, AttributeError):
        return False


def room_for_files(n: int, d: Path, *, reading: str = "", fix: str = "prepare again with a larger data.shard_tokens") -> None:
    """Make room for ``n`` more open files: the soft limit is raised up to the hard one (as data loaders do);
    a store that still needs more is a one-line ``DataError`` (what it reads: ``reading``, the way out: ``fix``),
    not "Too many open files" mid-run."""
    try:
        import resource  # noqa: I001  (POSIX only)
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 64
    want = used + n + 64
    if want <= soft:
        return
    if hard == resource.RLIM_INFINITY or want <= hard:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else max(want, min(hard, 2 * want)), hard)
        )
        return
    raise DataError(
        f"{d}: reading {reading or f'its {n // 8} shards'} needs about {want} open files and this process may open {hard} "
        f"(ulimit -n): raise the limit, or {fix}"
    )


def _older_format(d: Path) -> bool:
    return marker_ok(d) and not (d / INDEX).is_file() and ((d / "tokens.npy").is_file() or (d / "parts.json").is_file())


class DocumentStore:
    """Read access to one prepared split: opened from disk (``open``: its shards memory-mapped read-only and
    read by positioned reads), or held in memory (``from_documents``, the constructor)."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        offsets: np.ndarray,
        loss_mask: np.ndarray,
        meta: dict,
        path: Path | None = None,
        source: np.ndarray | None = None,
    ):
        offsets = np.asarray(offsets, np.int64)
        self.tokens = tokens  # (total_tokens,) uint16 or int32 (store_write.token_dtype)
        self.__dict__["offsets"] = offsets  # (n + 1,) int64 (computed only when asked for on a store opened from disk)
        self.loss_mask = loss_mask  # (total_tokens,) uint8
        self.lengths = np.diff(offsets)  # (n,) int64; uint32 memory-mapped from disk
        self.meta = meta
        self.path = path
        self.__dict__["source"] = source  # (n,) int16: source of each document, ascending; None = one unnamed source
        self._source_starts: np.ndarray | None = None  # from disk: first document of each source (the index's)
        if source is not None and len(source) != len(self):
            raise ValueError(f"source: {len(source)} entries for {len(self)} documents")

    # ------------------------------------------------------------------ reading
    @classmethod
    def open(cls, directory: str | Path) -> DocumentStore:
        d = Path(directory)
        if not DocumentStore.is_complete(d):
            if _older_format(d):
                raise DataError(f"{d}: a document store of an older densebatch (before format {FORMAT}); prepare it again")
            raise DataError(f"{d}: not a complete document store (missing or mismatched {MARKER} marker); prepare it again")
        meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
        shards = read_index(d) or []
        room_for_files(8 * len(shards), d)  # a mapping and a positioned reader of each shard's 4 files
        arrays = {
            n: [np.load(Path(e["dir"]) / f"{n}.npy", mmap_mode="r", allow_pickle=False) for e in shards]
            for n in ("tokens", "loss_mask", "lengths", "doc_loss")
        }
        store = cls.__new__(cls)
        store.tokens = _one(arrays["tokens"], np.int32)
        store.loss_mask = _one(arrays["loss_mask"], np.uint8)
        store.lengths = _one(arrays["lengths"], np.uint32)
        store.__dict__["doc_loss_tokens"] = _one(arrays["doc_loss"], np.uint32)
        store.meta, store.path = meta, d
        k = max(len(meta.get("sources") or [0]), 1 + max((e["source"] for e in shards), default=0))
        counts = np.bincount([e["source"] for e in shards], [e["documents"] for e in shards], minlength=k)
        store._source_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if len(store.lengths) != int(store._source_starts[-1]) or meta.get("num_documents") != len(store.lengths):
            raise DataError(f"{d}: its index and meta.json disagree on the documents; prepare it again")
        return store

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """(n + 1,) int64 token offsets (held in memory: 8 bytes a document; ``doc_spans`` holds none)."""
        out = np.zeros(len(self) + 1, np.int64)
        for a, got in windows(self.lengths, WINDOW_TOKENS):
            out[a + 1 : a + 1 + len(got)] = out[a] + np.cumsum(got, dtype=np.int64)
        return out

    @functools.cached_property
    def source(self) -> np.ndarray | None:
        """(n,) int16: each document's source (in memory: 2 bytes a document; ``sources_of`` holds none)."""
        if self._source_starts is None:
            return None
        return np.repeat(np.arange(len(self._source_starts) - 1), np.diff(self._source_starts)).astype(np.int16)

    @functools.cached_property
    def doc_loss_tokens(self) -> np.ndarray:
        """(n,) uint32: loss tokens of each whole document (each shard's ``doc_loss.npy``, memory-mapped;
        computed for a store held in memory)."""
        return document_loss_tokens(self.offsets, self.loss_mask)

    @functools.cached_property
    def _marks(self) -> np.ndarray:
        """The token offset of every ``_EVERY``-th document (one scan of the lengths, window by window)."""
        n, step = len(self), WINDOW_TOKENS // _EVERY * _EVERY
        marks, total = np.zeros(-(-n // _EVERY), np.int64), 0
        for a, got in windows(self.lengths, step):
            got = got.astype(np.int64)
            c = total + np.concatenate([[0], np.cumsum(got)])  # offsets of documents a .. a + len(got)
            marks[a // _EVERY : a // _EVERY + -(-len(got) // _EVERY)] = c[: len(got) : _EVERY]
            total = int(c[-1])
        return marks

    def doc_spans(self, docs) -> tuple[np.ndarray, np.ndarray]:
        """(first token, length) of each of ``docs``, as int64. From disk: the 64-document blocks that hold
        them are read (``read_ranges``) and summed from the block's held offset."""
        docs = np.asarray(docs, np.int64)
        if "offsets" in self.__dict__:
            o = self.offsets
            return o[docs], o[docs + 1] - o[docs]
        if not docs.size:
            return np.zeros(docs.shape, np.int64), np.zeros(docs.shape, np.int64)
        if docs.size > _SPANS:  # in ascending batches: each reads the blocks of its documents once, memory bounded
            flat = docs.reshape(-1)
            order = np.argsort(flat, kind="stable")
            starts, lengths = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
            for i in range(0, flat.size, _SPANS):
                here = order[i : i + _SPANS]
                starts[here], lengths[here] = self.doc_spans(flat[here])
            return starts.reshape(docs.shape), lengths.reshape(docs.shape)
        blocks, inv = np.unique(docs.reshape(-1) // _EVERY, return_inverse=True)
        a = blocks * _EVERY
        n = np.minimum(a + _EVERY, len(self)) - a
        got = read_ranges(self.lengths, a, a + n).astype(np.int64)
        before = np.cumsum(got) - got  # tokens before each document read, over all blocks read
        base = np.cumsum(n) - n  # where each block's lengths begin in `got`
        pos = base[inv] + docs.reshape(-1) - a[inv]
        starts = self._marks[blocks][inv] + before[pos] - before[base[inv]]
        return starts.reshape(docs.shape), got[pos].reshape(docs.shape)

    def sources_of(self, docs) -> np.ndarray | None:
        """Each of ``docs``' source (int64), or None for a store without sources."""
        docs = np.asarray(docs, np.int64)
        if self._source_starts is not None:
            return np.searchsorted(self._source_starts, docs, side="right") - 1
        return None if self.source is None else np.asarray(self.source)[docs].astype(np.int64)

    @property
    def max_length(self) -> int:
        """The longest document's tokens (from meta.json on disk; no scan)."""
        m = self.meta.get("max_length")
        return int(m) if isinstance(m, int) and self.path is not None else int(np.max(self.lengths, initial=0))

    @staticmethod
    def is_complete(directory: str | Path) -> bool:
        """Its marker matches its index and meta, and every shard the index names (its own, or a mixture's
        sources') has the files and sizes recorded there."""
        d = Path(directory)
        if not marker_ok(d):
            return False
        shards = read_index(d)
        return shards is not None and _shards_ok(shards)

    @staticmethod
    def damaged(directory: str | Path) -> bool:
        """A store whose own files do not match what its marker and index record: a file missing, cut or
        rewritten. The shards it names outside itself (a mixture's sources') are not its own: missing, the
        store is incomplete (``is_complete``), not damaged."""
        d = Path(directory).resolve()
        if not marker_ok(d):
            return True
        shards = read_index(d)
        return shards is None or not _shards_ok([e for e in shards if e["dir"].is_relative_to(d)])

    def __len__(self) -> int:
        return len(self.lengths)

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, loss_mask) of document ``i`` (views held in memory; read from disk)."""
        start, n = (int(x[0]) for x in self.doc_spans([i]))
        return self.tokens[start : start + n], self.loss_mask[start : start + n]

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"]) if self.path is not None else int(self.offsets[-1])

    @property
    def source_names(self) -> list[str]:
        """Names of the sources, in store order (one unnamed source: ``["data"]``)."""
        names = self.meta.get("sources")
        return list(names) if names else ["data"]

    def source_offsets(self) -> np.ndarray:
        """(sources + 1,) first document of each source: source s is documents offsets[s] .. offsets[s+1] - 1."""
        k = len(self.source_names)
        if self._source_starts is not None:
            starts = self._source_starts
            return np.concatenate([starts[: k + 1], np.full(max(0, k + 1 - len(starts)), starts[-1])]).astype(np.int64)
        if self.source is None:
            return np.array([0] + [len(self)] * k, np.int64)
        return np.searchsorted(np.asarray(self.source), np.arange(k + 1), side="left").astype(np.int64)

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def pad_id(self) -> int:
        return int(self.meta["pad_id"])

    def __repr__(self) -> str:
        return f"DocumentStore({len(self)} documents, {self.num_tokens} tokens, path={self.path})"

    # ------------------------------------------------------------------ building
    @classmethod
    def from_documents(
        cls, documents: Iterable[tuple[Sequence[int], Sequence[int]]], meta: dict | None = None, source=None
    ) -> DocumentStore:
        """An in-memory store from ``(tokens, loss_mask)`` pairs (tests, small tools); ``source``: one id per document."""
        toks, masks, lengths = [], [], [0]
        for t, m in documents:
            t, m = np.asarray(t, dtype=np.int32), np.asarray(m, dtype=np.uint8)
            if t.shape != m.shape:
                raise ValueError(f"document {len(toks)}: {len(t)} tokens but {len(m)} mask entries")
            toks.append(t)
            masks.append(m)
            lengths.append(len(t))
        tokens = np.concatenate(toks) if toks else np.zeros(0, np.int32)
        mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
        src = None if source is None else np.asarray(source, np.int16)
        if src is not None and len(src) and (np.diff(src) < 0).any():
            raise ValueError("source: documents must lie source after source (ascending source ids)")
        return cls(
            tokens, offsets=np.cumsum(lengths, dtype=np.int64), loss_mask=mask, meta=dict(meta or {}), path=None, source=src
        )

    def subset(self, docs: np.ndarray) -> DocumentStore:
        """An in-memory store of documents ``docs`` (ascending indices), in that order, with their sources
        and this store's meta (a copy of their tokens: for small selections, such as an eval cap)."""
        docs = np.asarray(docs, np.int64)
        parts = [self.document(int(d)) for d in docs]
        src = self.sources_of(docs)
        meta = {k: v for k, v in self.meta.items() if k not in ("num_documents", "num_tokens", "num_loss_tokens", "max_length")}
        return DocumentStore.from_documents(parts, meta, src)

    def save(self, directory: str | Path, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> DocumentStore:
        """Write atomically to ``directory`` (replacing an incomplete one) and return the opened copy."""
        final = Path(directory)
        if final.exists():
            shutil.rmtree(final)  # save() replaces: unlike a cache entry, the caller asked for this content
        with staged_store(final) as tmp:
            src = None if self.source is None else np.asarray(self.source)
            spans = self.doc_spans(np.arange(len(self)))
            offsets = np.concatenate([[0], np.cumsum(spans[1])])
            tokens = read_ranges(self.tokens, spans[0], spans[0] + spans[1])
            mask = read_ranges(self.loss_mask, spans[0], spans[0] + spans[1])
            write_store_files(
                tmp, tokens=tokens, offsets=offsets, loss_mask=mask, meta=self.meta, source=src, shard_tokens=shard_tokens
            )
        return DocumentStore.open(final)
