"""ForeignStore: a corpus another engine wrote, read in place as a ``DocumentStore`` (its tokens memory-mapped, never copied).

The planner, loader and collator read a store through its ``lengths``, ``doc_spans``, ``tokens``,
``loss_mask``, ``doc_loss_tokens``, ``sources_of`` and ``meta``. A ``ForeignStore`` gives them the
same: ``tokens`` is the writer's own token file (or files, read as one ``JoinedArray``), and the
split's documents are described by three arrays kept in the cache entry (``data.cache_dir``, never
beside the corpus)::

    starts.npy    int64  (docs,)  each document's first token in ``tokens``
    lengths.npy   uint32 (docs,)  its tokens (after data.max_seq_len's truncation)
    doc_loss.npy  uint32 (docs,)  its loss tokens
    first_tokens.npy  int64  (docs,)  starts.npy sorted; only where a format's mappings (one per id
                  alignment: litdata, mds) leave the starts of documents in the writer's order unsorted

A split may skip documents (the eval split's, the dropped ones), so a document is found by its start,
not by summing lengths. The loss mask follows our convention (``loss_mask[i] == 1``: token ``i``, as a
target, carries loss): every token but a document's first (``FirstTokenMask``), or where the format
writes its own mask file (``mask_file``), its tokens but a document's first.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from densebatch.data.store.joined import JoinedArray
from densebatch.data.store.store import DocumentStore
from densebatch.data.store.store_io import read_ranges, take, windows
from densebatch.data.store.store_write import npy_header

SPLIT_FILES = ("starts", "lengths", "doc_loss")
_EVERY = 64  # document starts between two that FirstTokenMask holds in memory (1/8 byte a document)


class FirstTokenMask(JoinedArray):
    """A loss mask of ones (or of the writer's own mask, ``base``, read by positioned reads) but at each
    document's first token (``starts``, ascending), computed for the ranges read: nothing held per
    token, and of ``starts`` (memory-mapped) one in ``every``, as ``DocumentStore.doc_spans`` holds one
    offset in 64. ``read_ranges`` (``store_io``) calls its ``read_ranges`` as it does a joined store's."""

    def __init__(self, starts: np.ndarray, num_tokens: int, base=None, *, every: int = _EVERY) -> None:
        self.starts_of_docs, self.base, self.every = starts, base, every
        self._held: np.ndarray | None = None  # every ``every``-th start, read on first use (_blocks)
        self.parts = []
        self.starts = np.array([0, num_tokens], np.int64)
        self.dtype = np.dtype(np.uint8)
        self.shape = (int(num_tokens),)

    def read_ranges(self, starts, stops, read_part=None) -> np.ndarray:
        starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        lens = np.maximum(stops - starts, 0)
        if self.base is None:
            out = np.ones(int(lens.sum()), np.uint8)
        else:
            out = (read_ranges(self.base, starts, starts + lens) != 0).astype(np.uint8)
        a, e = self._blocks(starts, starts + lens)  # the starts inside each range lie in starts_of_docs[a:e]
        got = read_ranges(self.starts_of_docs, a, e).astype(np.int64)  # one positioned read a range: nothing resident
        which = np.repeat(np.arange(len(starts)), e - a)
        inside = (got >= starts[which]) & (got < (starts + lens)[which])
        which = which[inside]
        out[(np.cumsum(lens) - lens)[which] + got[inside] - starts[which]] = 0
        return out

    def _blocks(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each token range, entries ``[a, e)`` of ``starts_of_docs`` that hold every document start inside it:
        from the block of ``every`` starts where the range begins to the one where it ends, found by a search of
        the held starts (one in ``every``, read by one scan on first use). A search of the mapping itself would
        fault its pages in: 8 bytes a document resident, not 1/8."""
        n = len(self.starts_of_docs)
        if self._held is None:
            step = (1 << 18) // self.every * self.every  # 2 MB read at a time
            held = [w[:: self.every].copy() for _, w in windows(self.starts_of_docs, step)]  # not views of each window
            self._held = np.concatenate([np.zeros(0, np.int64), *held]).astype(np.int64)
        first = np.maximum(np.searchsorted(self._held, starts, side="left") - 1, 0)  # held[k-1] < start <= held[k]
        last = np.maximum(np.searchsorted(self._held, stops, side="left"), 1)  # every start < stop lies before held[last]
        return np.minimum(first * self.every, n), np.minimum(last * self.every, n)

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, _ = key.indices(len(self))
            return self.read_ranges(np.array([a]), np.array([max(a, b)]))
        idx = np.asarray(key, np.int64)
        got = self.read_ranges(idx.reshape(-1), idx.reshape(-1) + 1)
        return got.reshape(idx.shape) if idx.ndim else got[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[0 : len(self)]
        return whole if dtype is None else whole.astype(dtype)


class SplitWriter:
    """One split of a cache entry written a block of documents at a time (``add``), never whole in memory:
    its three ``.npy`` files (headers rewritten with the final count on ``close``, as ``store_write`` does)
    and ``meta.json`` with the counts."""

    DTYPES = {"starts": np.dtype(np.int64), "lengths": np.dtype(np.uint32), "doc_loss": np.dtype(np.uint32)}

    def __init__(self, directory: Path, meta: dict) -> None:
        directory.mkdir()
        self.directory, self.meta = directory, meta
        self.files = {n: open(directory / f"{n}.npy", "wb") for n in SPLIT_FILES}  # noqa: SIM115
        for n, f in self.files.items():
            f.write(npy_header(self.DTYPES[n], 0))
        self.documents = self.tokens = self.loss_tokens = self.longest = 0
        self.last_start, self.ascending, self.blocks = -1, True, []

    def add(self, starts: np.ndarray, lengths: np.ndarray, doc_loss: np.ndarray) -> None:
        for n, arr in zip(SPLIT_FILES, (starts, lengths, doc_loss)):
            self.files[n].write(np.ascontiguousarray(arr, self.DTYPES[n]).tobytes())
        if len(starts):
            self.ascending &= bool(starts[0] > self.last_start and (np.diff(starts) > 0).all())
            self.last_start = max(self.last_start, int(np.max(starts)))
            self.blocks.append(len(starts))
        self.documents += len(lengths)
        self.tokens += int(np.sum(lengths, dtype=np.int64))
        self.loss_tokens += int(np.sum(doc_loss, dtype=np.int64))
        self.longest = max(self.longest, int(np.max(lengths, initial=0)))

    def close(self) -> None:
        for n, f in self.files.items():
            head = npy_header(self.DTYPES[n], self.documents)
            assert len(head) == len(npy_header(self.DTYPES[n], 0)), "a .npy header changed its size"
            f.seek(0)
            f.write(head)
            f.close()
        if not self.ascending:  # FirstTokenMask finds the document starts inside a range by bisection
            self._write_first_tokens()
        meta = dict(
            self.meta,
            num_documents=self.documents,
            num_tokens=self.tokens,
            num_loss_tokens=self.loss_tokens,
            max_length=self.longest,
            source_documents=[self.documents],
        )
        (self.directory / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")

    def _write_first_tokens(self) -> None:
        """``first_tokens.npy``: each ``add``'s starts sorted in turn, one block in memory, while each block's
        follow the last (a format's disorder stays inside an input file, which a block rarely spans); else all
        of them sorted at once."""
        starts = np.load(self.directory / "starts.npy", mmap_mode="r")
        path = self.directory / "first_tokens.npy"
        with open(path, "wb") as f:
            f.write(npy_header(self.DTYPES["starts"], self.documents))
            at, last = 0, -1
            for n in self.blocks:
                block = np.sort(starts[at : at + n])
                if block[0] <= last:
                    break
                f.write(np.ascontiguousarray(block, self.DTYPES["starts"]).tobytes())
                at, last = at + n, int(block[-1])
            else:
                return
        np.save(path, np.sort(starts))


class ForeignStore(DocumentStore):
    """One split of a foreign corpus: the cache entry's arrays over the writer's token files (see the
    module docstring). Opened read-only; a store of one source."""

    def __init__(self, directory: Path, tokens, mask_file=None) -> None:  # noqa: D107 (no super(): nothing in memory)
        d = Path(directory)
        arrays = {n: np.load(d / f"{n}.npy", mmap_mode="r", allow_pickle=False) for n in SPLIT_FILES}
        self._starts, self._lengths = arrays["starts"], arrays["lengths"]  # the mappings themselves: doc_spans
        self.tokens = tokens
        first = d / "first_tokens.npy"
        first_tokens = np.load(first, mmap_mode="r", allow_pickle=False) if first.exists() else self._starts
        self.loss_mask = FirstTokenMask(first_tokens, len(tokens), mask_file)
        # read as a joined store's (slices by positioned reads, as our sharded stores are): a slice of a plain
        # mapping would keep the lengths' pages resident while the planner walks the epoch
        self.lengths = JoinedArray([arrays["lengths"]])
        self.__dict__["doc_loss_tokens"] = JoinedArray([arrays["doc_loss"]])
        self.__dict__["source"] = None
        self.meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
        self.path = d
        self._source_starts = np.array([0, len(self.lengths)], np.int64)

    @property
    def offsets(self) -> np.ndarray:  # type: ignore[override]
        raise TypeError("a ForeignStore's documents are not laid end to end: read them through doc_spans")

    def doc_spans(self, docs) -> tuple[np.ndarray, np.ndarray]:
        docs = np.asarray(docs, np.int64)
        return take(self._starts, docs).astype(np.int64), take(self._lengths, docs).astype(np.int64)  # positioned reads

    def __repr__(self) -> str:
        return f"ForeignStore({len(self)} documents, {self.num_tokens} tokens, path={self.path})"
