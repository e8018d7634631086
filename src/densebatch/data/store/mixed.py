"""MixedStore: several sources' stores read as one store, source after source (a mixture holding a foreign corpus).

A mixture of sources densebatch tokenised itself is one store on disk whose index points at each
source's shards (``joined.write_mixture_index``). A corpus another engine wrote has no shards of ours:
its documents are found by their starts in the writer's own files (``formats/view.ForeignStore``). A
mixture that holds such a source is therefore read through this store, made in memory when the
mixture is opened from its sources' stores (its *parts*: each a ``ForeignStore`` or a ``DocumentStore``
of our shards, of one source; a source of several files is several parts), in source order. What the
planner, loader and collator read is the parts', shifted, and nothing is copied::

    lengths, doc_loss_tokens   the parts' arrays read as one (``JoinedArray``): document d of part p is
                               document doc_base[p] + d
    tokens, loss_mask          the parts' token spaces end to end: token t of part p is token_base[p] + t
    doc_spans(docs)            each part's ``doc_spans`` of its documents, shifted by its token base
    sources_of(docs)           the source of each document (the first document of each source is held)

Nothing is held per document or per token: a few integers a part. The documents of a source are not
laid end to end (a foreign corpus's split skips the other split's), so ``offsets`` does not exist;
``doc_spans`` finds every document.
"""

from __future__ import annotations

import numpy as np

from densebatch.data.store.joined import read_as_one
from densebatch.data.store.store import DocumentStore


class MixedStore(DocumentStore):
    """The documents of ``parts`` (``(store, source)`` pairs, sources ascending) read as one store with the
    sources ``meta["sources"]`` names (see the module docstring). ``meta``: the split's meta (tokenizer ids,
    names); the counts are the parts'."""

    def __init__(self, parts: list[tuple[DocumentStore, int]], meta: dict) -> None:  # noqa: D107 (no super(): nothing in memory)
        stores, ids = [s for s, _ in parts], [int(k) for _, k in parts]
        if not stores or ids != sorted(ids):
            raise ValueError(f"MixedStore: parts must be given source after source (got sources {ids})")
        self.parts = stores
        self._doc_base = np.concatenate([[0], np.cumsum([len(s) for s in stores])]).astype(np.int64)
        self._token_base = np.concatenate([[0], np.cumsum([len(s.tokens) for s in stores])]).astype(np.int64)
        self.tokens = read_as_one([s.tokens for s in stores])
        self.loss_mask = read_as_one([s.loss_mask for s in stores], np.uint8)
        self.lengths = read_as_one([s.lengths for s in stores], np.uint32)
        self.__dict__["doc_loss_tokens"] = read_as_one([s.doc_loss_tokens for s in stores], np.uint32)
        k = max(len(meta.get("sources") or [0]), 1 + ids[-1])
        counts = np.bincount(ids, weights=[len(s) for s in stores], minlength=k).astype(np.int64)
        self._source_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.meta = dict(
            meta,
            num_documents=int(self._doc_base[-1]),
            num_tokens=sum(s.num_tokens for s in stores),
            num_loss_tokens=sum(int(s.meta.get("num_loss_tokens", np.sum(s.doc_loss_tokens, dtype=np.int64))) for s in stores),
            max_length=max(s.max_length for s in stores),
            source_documents=counts.tolist(),
        )
        self.path = None

    @property
    def offsets(self) -> np.ndarray:  # type: ignore[override]
        raise TypeError("a MixedStore's documents are not laid end to end: read them through doc_spans")

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    @property
    def max_length(self) -> int:
        return int(self.meta["max_length"])

    def doc_spans(self, docs) -> tuple[np.ndarray, np.ndarray]:
        docs = np.asarray(docs, np.int64)
        starts, lengths = np.zeros(docs.shape, np.int64), np.zeros(docs.shape, np.int64)
        part = np.searchsorted(self._doc_base, docs, side="right") - 1  # an empty part is never found
        for p in np.unique(part):
            sel = part == p
            a, n = self.parts[p].doc_spans(docs[sel] - self._doc_base[p])
            starts[sel], lengths[sel] = a + self._token_base[p], n
        return starts, lengths

    def __repr__(self) -> str:
        return f"MixedStore({len(self)} documents of {len(self.source_names)} sources, {self.num_tokens} tokens)"
