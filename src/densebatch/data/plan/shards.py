"""Sharded planning: one epoch's plan built shard by shard, holding a compact index, never all the pieces.

The epoch's documents (every document once, or a mixture's ``Selection``) are dealt into shards of
``settings.shard_docs`` documents along a seeded pseudo-random order of blocks of up to 64 documents
(a ``Bijection``: no stored permutation), so each shard is a random sample of the epoch. Each shard
is planned on its own lengths by the whole-corpus planner with its own seed (seed, epoch, shard);
the epoch's batches are shard 0's, then shard 1's, ...::

    virtual order  0 1 2 3 | 4 5 6 7 | 8 9 ...      blocks of documents (or of a mixture's selection)
    shard 0        blocks 5 2 9 ...  -> plan -> batches 0 .. b0-1
    shard 1        blocks 1 7 3 ...  -> plan -> batches b0 .. b0+b1-1

Since every shard is a random sample and every planner shuffles its own batches, this order is as
random as a whole-corpus plan's; only which documents may share a batch is limited to a shard.
Shard sizes are multiples of ``rows_per_batch`` (random) or of a mega-batch (length_grouped), so
those plans are the whole-corpus algorithm on the shuffled order, with one partial batch at the end
(length_grouped with bundles, like packed and token_budget, ends each shard with a partial batch).
A corpus of at most ``shard_docs`` documents is one shard, planned exactly as ``plan_epoch``.

Held per epoch: per batch its real tokens, slots and rows (int32 unless a value needs int64), 12
bytes (about 0.7 bytes per document for packed rows of 1024 at 8192 slots, 1.5 for random batches of 8 rows); per
shard a few counters; nothing per document. A shard's plan (pieces, rows, batches: tens of bytes per
document of the shard) is rebuilt from (seed, epoch, shard) when one of its batches is asked for;
the two most recently used are cached. A store's lengths are read shard by shard by positioned reads
(``store.take``), never held. Peak memory is therefore the index and
a fixed budget set by ``shard_docs`` (measured in docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

import numpy as np

from densebatch.data.plan.bijection import Bijection
from densebatch.data.plan.mixture import Selection
from densebatch.data.plan.packing import ranges
from densebatch.data.plan.planner import Plan, PlanSettings, join_plans, plan_documents, plan_epoch, plan_stats
from densebatch.data.plan.strategies import STRATEGIES
from densebatch.data.store.joined import JoinedArray
from densebatch.data.store.store import take, windows

_SHARD_TAG = 0x534844  # keeps the shard order's stream apart from the planners' streams of the same seed
_MAX_BLOCK = 64  # documents kept together when dealt into shards: contiguous reads of the lengths


def plan_epoch_sharded(
    lengths, *, settings: PlanSettings, seed: int, epoch: int, selection: Selection | None = None
) -> ShardedPlan:
    """Plan one epoch of ``lengths`` (or of ``selection``'s documents) in shards of ``settings.shard_docs``."""
    return ShardedPlan(lengths, settings=settings, seed=seed, epoch=epoch, selection=selection)


class ShardedPlan:
    """An epoch's ordered batches, each rows of (doc, start, stop) with global document ids.

    Same reading interface as ``Plan``: ``num_batches``, ``batch(i)``, ``batch_docs(i)``,
    ``batch_stats()``, ``stats()``, ``iter_batches(start)``; plus ``shard(k)`` (a ``Plan``) and
    ``locate(i)`` (shard, batch inside it). Building it plans every shard once for the index;
    ``batch(i)`` then rebuilds only the shard that holds batch i."""

    def __init__(self, lengths, *, settings: PlanSettings, seed: int, epoch: int, selection: Selection | None = None):
        self.lengths = _checked(lengths)
        self.settings, self.seed, self.epoch, self.selection = settings, int(seed), int(epoch), selection
        self.pad_to_multiple_of = settings.pad_to_multiple_of
        if selection is not None and int(selection.offsets[-1]) != len(self.lengths):
            raise ValueError(
                f"selection covers {int(selection.offsets[-1])} documents but lengths has {len(self.lengths)}: "
                "the sources' lengths must be laid end to end in the order of the selection"
            )
        n = len(self.lengths) if selection is None else selection.num_docs
        u = STRATEGIES[settings.strategy].shard_unit(settings)
        self.num_docs = n
        self.shard_docs = max(u, settings.shard_docs // u * u)
        self.num_shards = max(1, -(-n // self.shard_docs))
        self.block = min(_MAX_BLOCK, max(1, self.shard_docs // 4096))
        self._order = Bijection(n // self.block, [self.seed, self.epoch, _SHARD_TAG])
        self._cache: OrderedDict[int, Plan] = OrderedDict()
        self._lock = threading.Lock()  # a loader's prefetch thread reads batches too
        self._build_index()

    # ------------------------------------------------------------------------------- shards
    def members(self, k: int) -> np.ndarray:
        """Global document ids of shard ``k`` (a document repeated by a mixture appears once per repeat)."""
        if not 0 <= k < self.num_shards:
            raise IndexError(f"shard {k} out of range (0 .. {self.num_shards - 1})")
        n, b = self.num_docs, self.block
        p0, p1 = k * self.shard_docs, min(n, (k + 1) * self.shard_docs)
        if self.num_shards == 1:
            v = np.arange(p0, p1, dtype=np.int64)
        else:  # positions p0 .. p1-1 of the shuffled block order; the last partial block stays in place
            full = n // b
            q = np.arange(p0 // b, -(-p1 // b), dtype=np.int64)
            first = q.copy()
            first[q < full] = self._order(q[q < full])
            first *= b
            size = np.where(q < full, b, n - full * b)
            v = ranges(first, first + size)[p0 - q[0] * b : p0 - q[0] * b + (p1 - p0)]
        return v if self.selection is None else self.selection.docs(v)

    def shard(self, k: int) -> Plan:
        """Shard ``k``'s plan with global document ids (cached: the two most recently used)."""
        with self._lock:
            if k in self._cache:
                self._cache.move_to_end(k)
                return self._cache[k]
            plan = self._build(k)
            self._cache[k] = plan
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
            return plan

    def _build(self, k: int) -> Plan:
        if self.num_shards == 1 and self.selection is None:
            return plan_epoch(np.asarray(self.lengths, np.int64), settings=self.settings, seed=self.seed, epoch=self.epoch)
        docs = self.members(k)
        lengths = take(self.lengths, docs).astype(np.int64)  # positioned reads of its blocks: nothing stays resident
        if self.num_shards == 1:
            p = plan_epoch(lengths, settings=self.settings, seed=self.seed, epoch=self.epoch)
        else:
            key = [self.seed % 2**63, self.epoch % 2**63, STRATEGIES[self.settings.strategy].seed_tag, _SHARD_TAG, k]
            p = plan_documents(lengths, self.settings, np.random.default_rng(np.random.SeedSequence(key)))
        return dataclasses.replace(p, doc=docs[p.doc], split=docs[p.split], truncated=docs[p.truncated], dropped=docs[p.dropped])

    def _build_index(self) -> None:
        real, slots, rows, counts = [], [], [], np.zeros(3, np.int64)
        k_src = self.selection.num_sources if self.selection is not None else 0
        self.source_tokens = np.zeros(k_src, np.int64) if k_src else None
        self.source_documents = np.zeros(k_src, np.int64) if k_src else None
        for k in range(self.num_shards):
            p = self._build(k)
            r, s = p.batch_stats()
            real.append(_narrow(r))
            slots.append(_narrow(s))
            rows.append(_narrow(p.batch_rows()))
            counts += [len(p.split), len(p.truncated), len(p.dropped)]
            if k_src:
                src = self.selection.source_of(p.doc)
                self.source_tokens += np.bincount(src, weights=p.stop - p.start, minlength=k_src).astype(np.int64)
                self.source_documents += np.bincount(src[p.start == 0], minlength=k_src)
            if k in (0, self.num_shards - 1):  # the first is read next; the last is free to keep
                self._cache[k] = p
            del p
        self.batch_offsets = np.concatenate([[0], np.cumsum([len(r) for r in real])]).astype(np.int64)
        self._real = np.concatenate(real)  # one field at a time: the pieces and the whole coexist briefly
        del real
        self._slots = np.concatenate(slots)
        del slots
        self._rows = np.concatenate(rows)
        self.num_split, self.num_truncated, self.num_dropped = (int(c) for c in counts)

    # ---------------------------------------------------------------------------- reading
    @property
    def num_batches(self) -> int:
        return int(self.batch_offsets[-1])

    @property
    def num_rows(self) -> int:
        return int(self._rows.sum())

    def __len__(self) -> int:
        return self.num_batches

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, batch inside the shard) of global batch ``i``."""
        if not 0 <= i < self.num_batches:
            raise IndexError(f"batch {i} out of range (0 .. {self.num_batches - 1})")
        k = int(np.searchsorted(self.batch_offsets, i, side="right")) - 1
        return k, i - int(self.batch_offsets[k])

    def batch(self, i: int) -> list[list[tuple[int, int, int]]]:
        k, j = self.locate(i)
        return self.shard(k).batch(j)

    def batch_docs(self, i: int) -> list[int]:
        k, j = self.locate(i)
        return self.shard(k).batch_docs(j)

    def iter_batches(self, start: int = 0):
        """Batches ``start``, ``start + 1``, ... in order, building one shard at a time."""
        if start >= self.num_batches:
            return
        k, j = self.locate(start)
        for kk in range(k, self.num_shards):
            p = self.shard(kk)
            for jj in range(j if kk == k else 0, p.num_batches):
                yield p.batch(jj)

    def batch_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """(real tokens, token slots) per batch, from the index."""
        return self._real, self._slots

    def batch_rows(self) -> np.ndarray:
        return self._rows

    def doc_lists(self) -> list[list[list[int]]]:
        """Batches → rows → document indices (small plans: this materialises every batch)."""
        return [[[d for d, _, _ in row] for row in b] for b in self.iter_batches()]

    def stats(self) -> dict:
        report = plan_stats(
            self._real,
            slots=self._slots,
            rows=self.num_rows,
            split=self.num_split,
            truncated=self.num_truncated,
            dropped=self.num_dropped,
        )
        return {**report, "shards": self.num_shards}


def _narrow(x: np.ndarray) -> np.ndarray:
    """int32 when every value fits (the index's 12 bytes per batch), else int64; concatenation widens."""
    return x.astype(np.int32) if x.max(initial=0) < 2**31 else x


def _checked(lengths) -> np.ndarray:
    """Lengths as given (any integer dtype; a store's memory-mapped files are read window by window, never
    copied whole or left resident), validated."""
    on_disk = isinstance(lengths, np.memmap | JoinedArray)
    x = lengths if on_disk or isinstance(lengths, np.ndarray) else np.asarray(lengths, dtype=np.int64)
    if len(x.shape) != 1:
        raise ValueError("lengths: expected a one-dimensional array of token counts")
    if len(x) and not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"lengths: expected integer token counts; got {x.dtype}")
    for a, w in windows(x, 1 << 22) if on_disk else [(0, x)]:  # in memory: checked in place
        if len(w) and int(w.min()) < 1:
            raise ValueError(
                f"lengths: every document needs at least one token; document {a + int(np.argmin(w))} has {int(w.min())}"
            )
    return x


class EpochRows:
    """A ``ShardedPlan`` read row by row, as the step planner and the loader read a ``Plan``, without the
    epoch's pieces ever being held at once.

    ``batch_ptr`` (rows before each batch: 8 bytes per batch) is global; ``rows(a, b)`` assembles the
    pieces of rows ``[a, b)`` from the shards that hold them (the shard plan's two-entry cache makes
    a forward pass through the epoch build each shard once). The rows and their order are those of
    ``mixing.materialise(sharded)``, so a loader position means the same with either.
    """

    def __init__(self, sharded: ShardedPlan):
        self.sharded = sharded
        self.pad_to_multiple_of = sharded.pad_to_multiple_of
        self.batch_ptr = np.concatenate([[0], np.cumsum(sharded.batch_rows(), dtype=np.int64)])
        self.shard_rows = self.batch_ptr[sharded.batch_offsets]  # (shards + 1,) first row of each shard

    @property
    def num_batches(self) -> int:
        return len(self.batch_ptr) - 1

    @property
    def num_rows(self) -> int:
        return int(self.batch_ptr[-1])

    def __len__(self) -> int:
        return self.num_batches

    def shard_plans(self):
        """Each shard's ``Plan`` in order (rows end to end make the epoch)."""
        return (self.sharded.shard(k) for k in range(self.sharded.num_shards))

    def rows(self, a: int, b: int) -> Plan:
        """Rows ``[a, b)`` as one small ``Plan`` (row 0 is row ``a``; one batch)."""
        if not 0 <= a <= b <= self.num_rows:
            raise IndexError(f"rows [{a}, {b}) out of range (0 .. {self.num_rows})")
        k = max(0, int(np.searchsorted(self.shard_rows, a, side="right")) - 1)
        parts = []
        while k < self.sharded.num_shards and self.shard_rows[k] < b:
            lo, hi = int(self.shard_rows[k]), int(self.shard_rows[k + 1])
            if min(b, hi) > max(a, lo):
                parts.append(self.sharded.shard(k).rows(max(a, lo) - lo, min(b, hi) - lo))
            k += 1
        if len(parts) == 1:
            return parts[0]
        return dataclasses.replace(join_plans(parts, self.pad_to_multiple_of), batch_ptr=np.array([0, b - a], np.int64))

    def stats(self) -> dict:
        return self.sharded.stats()
