"""DocumentStore: one prepared split on disk — flat memory-mapped tokens, offsets and loss mask.

Layout of a store directory::

    tokens.npy     uint16 (total_tokens,)   all documents back to back (int32 for vocabularies over 65,536 ids)
    offsets.npy    int64  (n + 1,)          document i is tokens[offsets[i]:offsets[i+1]]
    loss_mask.npy  uint8  (total_tokens,)   1 = this token, *as a target*, carries loss
    doc_loss.npy   uint32 (n,)              loss tokens of each whole document (step sizes by loss tokens)
    source.npy     int16  (n,)              optional: the source (of a mixture) of each document
    meta.json      eos_id, pad_id, vocab_size, mask_id, special_ids, tokenizer, sources (names), ...
    COMPLETE       written last: file sizes; a directory without it (or with other sizes) is not a store

The first token of a document is never a target (nothing precedes it), so its mask is always 0.
A mixture's documents lie source after source (``source`` ascending), the layout ``mixture.Selection``
plans from; ``meta["sources"]`` names them in that order. A mixture's split holds ``parts.json``
instead of arrays: its sources' stores, read as one (``joined.py``).
Training reads tokens and mask by ``read_ranges`` (positioned reads), never through the mapping.
Writes go to a temporary sibling directory (``densebatch.atomic.staged_dir``): every file is
fsynced, then the directory is renamed into place (atomic on POSIX), so a crash mid-write leaves
only a ``.tmp-*`` directory, never a directory that ``open`` would trust.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from densebatch.atomic import staged_dir
from densebatch.data.prepare.joined import JoinedArray, read_parts
from densebatch.errors import DataError

MARKER = "COMPLETE"
WINDOW_TOKENS = 1 << 20  # tokens of the loss mask summed at once (8 MB of prefix sums), whatever the corpus


_FDS: dict[int, int] = {}  # id of a store's memory-mapped array -> a descriptor of its file, for positioned reads
_FDS_LOCK = threading.Lock()


def _file_of(array) -> int | None:
    """A read-only descriptor of the ``.npy`` file ``array`` maps whole (None: not such an array), closed
    when the array goes."""
    if not isinstance(array, np.memmap) or array.filename is None:
        return None
    with _FDS_LOCK:
        fd = _FDS.get(id(array))
        if fd is None:
            fd = os.open(array.filename, os.O_RDONLY)
            if os.fstat(fd).st_size != array.offset + array.nbytes:  # a slice of a mapping: its offset is the file's
                os.close(fd)
                return None
            _FDS[id(array)] = fd
            weakref.finalize(array, _close, id(array), fd)
        return fd


def _close(key: int, fd: int) -> None:
    with _FDS_LOCK:
        _FDS.pop(key, None)
    os.close(fd)


def read_ranges(array: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``array[a:b]`` for each range, end to end, as an array of its own. From a store's memory-mapped file
    by positioned reads: what training reads of a store never stays resident in the process (a page fault
    on a mapping would also map the kernel's read-ahead around it), whatever the corpus size."""
    starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    if isinstance(array, JoinedArray):  # a mixture's split: each part read the same way
        return array.read_ranges(starts, stops, read_ranges)
    fd = _file_of(array)
    if fd is None:
        lens = stops - starts
        idx = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        return np.asarray(array[idx])
    size, base = array.itemsize, array.offset
    parts = [os.pread(fd, (b - a) * size, base + a * size) for a, b in zip(starts.tolist(), stops.tolist()) if b > a]
    return np.frombuffer(b"".join(parts), array.dtype)


def read_window(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    """``array[start:stop]`` as an array of its own (``read_ranges``): a scan over a whole store leaves none of
    its pages resident in this process."""
    return read_ranges(array, np.array([start]), np.array([max(start, stop)]))


_ARRAYS = ("tokens", "offsets", "loss_mask")


def write_marker(directory: Path, payload: dict) -> None:
    """The completion marker, written last into a staged directory (fsynced when it is published)."""
    (directory / MARKER).write_text(json.dumps(payload, sort_keys=True), encoding="utf-8")


def marker_ok(directory: Path) -> bool:
    """True when ``directory`` holds a completion marker whose recorded file sizes all match."""
    try:
        payload = json.loads((directory / MARKER).read_text(encoding="utf-8"))
        return all((directory / name).stat().st_size == size for name, size in payload["sizes"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def token_dtype(meta: dict) -> np.dtype:
    """uint16 when every id of the store's vocabulary (``meta["vocab_size"]``) fits, else int32: half the disk
    and the reads for most tokenizers (GPT-2's 50,257, the byte-level default)."""
    vocab = meta.get("vocab_size")
    return np.dtype(np.uint16) if isinstance(vocab, int) and 0 < vocab <= 1 << 16 else np.dtype(np.int32)


def write_store_files(
    directory: Path, tokens: np.ndarray, offsets: np.ndarray, loss_mask: np.ndarray, meta: dict, source: np.ndarray | None = None
) -> None:
    """Write a store's files into an existing (temporary) directory, marker last."""
    arrays = {
        "tokens": tokens.astype(token_dtype(meta), copy=False),
        "offsets": offsets.astype(np.int64, copy=False),
        "loss_mask": loss_mask.astype(np.uint8, copy=False),
    }
    assert arrays["offsets"][0] == 0 and arrays["offsets"][-1] == len(tokens) == len(loss_mask)
    if source is not None:
        assert len(source) == len(offsets) - 1 and (np.diff(source) >= 0).all(), "documents lie source after source"
        arrays["source"] = source.astype(np.int16, copy=False)
        meta = dict(meta, source_documents=np.bincount(source, minlength=len(meta.get("sources") or [0])).tolist())
    arrays["doc_loss"] = document_loss_tokens(arrays["offsets"], arrays["loss_mask"])
    for name, arr in arrays.items():
        np.save(directory / f"{name}.npy", arr, allow_pickle=False)
    meta = dict(meta, num_documents=len(offsets) - 1, num_tokens=int(len(tokens)), num_loss_tokens=int(loss_mask.sum()))
    (directory / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    names = [f"{n}.npy" for n in arrays] + ["meta.json"]
    write_marker(directory, {"sizes": {n: (directory / n).stat().st_size for n in names}})


class StoreWriter:
    """A single-source store's files written document by document into a new directory, for a corpus that
    is never in memory whole: the sizes are known up front (``num_documents``, ``num_tokens``), so the
    ``.npy`` headers come first and each document's tokens and mask are appended as they come. The
    files are byte for byte those ``write_store_files`` writes for the same documents (source 0 each)."""

    def __init__(self, directory: Path, meta: dict, num_documents: int, num_tokens: int) -> None:
        directory.mkdir()
        self.directory, self.meta = directory, meta
        self.lengths = np.zeros(num_documents, np.int64)
        self.doc_loss = np.zeros(num_documents, np.uint32)
        self.n, self.tokens_left, self.loss = 0, num_tokens, 0
        self.files = {name: open(directory / f"{name}.npy", "wb") for name in ("tokens", "loss_mask")}  # noqa: SIM115
        self.token_dtype = token_dtype(meta)
        for name, dtype in (("tokens", self.token_dtype), ("loss_mask", np.uint8)):
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (num_tokens,)}
            np.lib.format.write_array_header_1_0(self.files[name], header)

    def extend(self, tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents laid end to end: their ``tokens`` and ``mask``, cut by ``lengths``."""
        lengths = np.asarray(lengths, np.int64)
        k = len(lengths)
        self.files["tokens"].write(np.ascontiguousarray(tokens).astype(self.token_dtype, copy=False).tobytes())
        self.files["loss_mask"].write(np.ascontiguousarray(mask, np.uint8).tobytes())
        self.lengths[self.n : self.n + k] = lengths
        self.doc_loss[self.n : self.n + k] = document_loss_tokens(np.concatenate([[0], np.cumsum(lengths)]), mask)
        self.loss += int(np.asarray(mask).sum(dtype=np.int64))
        self.n += k
        self.tokens_left -= len(tokens)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        assert self.n == len(self.lengths) and self.tokens_left == 0, "the documents announced were not all written"
        d = self.directory
        np.save(d / "offsets.npy", np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64), allow_pickle=False)
        np.save(d / "source.npy", np.zeros(self.n, np.int16), allow_pickle=False)
        np.save(d / "doc_loss.npy", self.doc_loss, allow_pickle=False)
        num_tokens = int(self.lengths.sum())
        meta = dict(self.meta, source_documents=[self.n], num_documents=self.n, num_tokens=num_tokens, num_loss_tokens=self.loss)
        (d / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
        names = [f"{n}.npy" for n in ("tokens", "offsets", "loss_mask", "source", "doc_loss")] + ["meta.json"]
        write_marker(d, {"sizes": {n: (d / n).stat().st_size for n in names}})


def document_loss_tokens(offsets: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """(n,) uint32: the loss tokens of each whole document (the mask's ones at its targets: every token but
    the first). Read window by window: memory is one window, not the corpus."""
    offsets = np.asarray(offsets, np.int64)
    n = len(offsets) - 1
    out = np.zeros(n, np.uint32)
    d = 0
    while d < n:  # documents [d, e): at most one window of tokens, or one longer document
        e = max(d + 1, int(np.searchsorted(offsets, offsets[d] + WINDOW_TOKENS, side="right")) - 1)
        e = min(e, n)
        a, b = int(offsets[d]), int(offsets[e])
        c = np.concatenate([[0], np.cumsum(read_window(loss_mask, a, b), dtype=np.int64)])
        ends = offsets[d + 1 : e + 1]
        out[d:e] = c[ends - a] - c[np.minimum(offsets[d:e] + 1, ends) - a]  # targets: every token but the first
        d = e
    return out


@contextlib.contextmanager
def staged_store(final: Path) -> Iterator[Path]:
    """A temporary directory to fill, published as ``final`` (``densebatch.atomic.staged_dir``).

    A ``final`` that exists without a valid marker (left by a crash of an older version) is removed
    first; one that is complete (another writer won the race) is kept and the staged copy dropped."""
    if final.exists() and not marker_ok(final):
        shutil.rmtree(final, ignore_errors=True)
    with staged_dir(final, replace=False) as tmp:
        yield tmp


class DocumentStore:
    """Read access to one prepared split. Arrays are memory-mapped read-only when opened from disk."""

    def __init__(
        self,
        tokens: np.ndarray,
        offsets: np.ndarray,
        loss_mask: np.ndarray,
        meta: dict,
        path: Path | None = None,
        source: np.ndarray | None = None,
    ):
        self.tokens = tokens  # (total_tokens,) uint16 or int32 (token_dtype)
        self.offsets = offsets  # (n + 1,) int64
        self.loss_mask = loss_mask  # (total_tokens,) uint8
        self.lengths = np.diff(offsets)  # (n,) int64
        self.meta = meta
        self.path = path
        self.source = source  # (n,) int16: source of each document, ascending; None = one unnamed source
        if source is not None and len(source) != len(self):
            raise ValueError(f"source: {len(source)} entries for {len(self)} documents")

    # ------------------------------------------------------------------ reading
    @classmethod
    def open(cls, directory: str | Path) -> DocumentStore:
        d = Path(directory)
        if not DocumentStore.is_complete(d):
            raise DataError(f"{d}: not a complete document store (missing or mismatched {MARKER} marker); prepare it again")
        meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
        if (parts := read_parts(d)) is not None:  # a mixture's split: its sources' stores, end to end
            stores = [DocumentStore.open(p["dir"]) for p in parts]
            offsets = np.concatenate([[0], np.cumsum([x for st in stores for x in st.lengths])]).astype(np.int64)
            source = np.repeat([p["source"] for p in parts], [len(st) for st in stores]).astype(np.int16)
            joined = cls(
                JoinedArray([st.tokens for st in stores]), offsets, JoinedArray([st.loss_mask for st in stores]), meta, d, source
            )
            joined.doc_loss_tokens = (
                np.concatenate([np.asarray(st.doc_loss_tokens) for st in stores]) if stores else np.zeros(0, np.uint32)
            )
            return joined
        arrays = {n: np.load(d / f"{n}.npy", mmap_mode="r", allow_pickle=False) for n in _ARRAYS}
        source = np.load(d / "source.npy", allow_pickle=False) if (d / "source.npy").is_file() else None
        return cls(arrays["tokens"], np.asarray(arrays["offsets"]), arrays["loss_mask"], meta, d, source)

    @functools.cached_property
    def doc_loss_tokens(self) -> np.ndarray:
        """(n,) uint32: loss tokens of each whole document (``doc_loss.npy``, memory-mapped; computed for a
        store built in memory)."""
        if self.path is not None and (self.path / "doc_loss.npy").is_file():
            return np.load(self.path / "doc_loss.npy", mmap_mode="r", allow_pickle=False)
        return document_loss_tokens(self.offsets, self.loss_mask)

    @staticmethod
    def is_complete(directory: str | Path) -> bool:
        """Its marker matches its files, and (a mixture's split) every store it names is complete too."""
        d = Path(directory)
        return marker_ok(d) and all(DocumentStore.is_complete(p["dir"]) for p in read_parts(d) or [])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, loss_mask) of document ``i``: views, no copy."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.loss_mask[a:b]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def source_names(self) -> list[str]:
        """Names of the sources, in store order (one unnamed source: ``["data"]``)."""
        names = self.meta.get("sources")
        return list(names) if names else ["data"]

    def source_offsets(self) -> np.ndarray:
        """(sources + 1,) first document of each source: source s is documents offsets[s] .. offsets[s+1] - 1."""
        k = len(self.source_names)
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
        return cls(tokens, np.cumsum(lengths, dtype=np.int64), mask, dict(meta or {}), None, src)

    def subset(self, docs: np.ndarray) -> DocumentStore:
        """An in-memory store of documents ``docs`` (ascending indices), in that order, with their sources
        and this store's meta (a copy of their tokens: for small selections, such as an eval cap)."""
        docs = np.asarray(docs, np.int64)
        parts = [self.document(int(d)) for d in docs]
        src = None if self.source is None else np.asarray(self.source)[docs]
        meta = {k: v for k, v in self.meta.items() if k not in ("num_documents", "num_tokens", "num_loss_tokens")}
        return DocumentStore.from_documents(parts, meta, src)

    def save(self, directory: str | Path) -> DocumentStore:
        """Write atomically to ``directory`` (replacing an incomplete one) and return the opened copy."""
        final = Path(directory)
        if final.exists():
            shutil.rmtree(final)  # save() replaces: unlike a cache entry, the caller asked for this content
        with staged_store(final) as tmp:
            src = None if self.source is None else np.asarray(self.source)
            write_store_files(tmp, np.asarray(self.tokens), np.asarray(self.offsets), np.asarray(self.loss_mask), self.meta, src)
        return DocumentStore.open(final)
