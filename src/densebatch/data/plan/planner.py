"""Batch planning: decide which document pieces go in which row and batch, from lengths only.

Pure functions of (lengths, settings, seed, epoch): numpy only, no torch, no I/O. A ``Plan`` is
CSR-shaped: pieces ``(doc, start, stop)`` → rows (``row_ptr``) → batches (``batch_ptr``)::

    pieces     (7,0,5) (2,0,3) | (4,0,8) | (4,8,11) (9,0,4)     document 4 split into two pieces
    row_ptr    0 2 3 5                                         row 0 = pieces 0-1, row 1 = piece 2, ...
    batch_ptr  0 2 3                                           batch 0 = rows 0-1, batch 1 = row 2

A piece of a split document (``start > 0``) is its own segment: positions restart at 0 there and
its first token has no context from the previous piece (which keeps that token as its last target,
so a cut loses no target: see ``collate``). Every planner places every document
exactly once per epoch; what the policy changed is reported in ``split``, ``truncated``, ``dropped``.
``plan_epoch`` plans the whole corpus at once (memory grows with every piece); for corpora
larger than ``shard_docs`` documents, ``shards.plan_epoch_sharded`` plans shard by shard in bounded
memory with these same planners. Costs: docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from densebatch.data.plan.packing import (
    Bundles,
    best_fit_decreasing,
    bundle,
    cut_long,
    desc_random_ties,
    desc_stable,
    exact_cuts,
    greedy_cuts,
    layout_rows,
    ranges,
    sorted_desc,
)
from densebatch.data.plan.plan import Plan, _round_up, join_plans, plan_stats  # noqa: F401 (re-exported)

STRATEGIES = ("random", "length_grouped", "token_budget", "packed")
GROUPED_BUNDLE_QUANTILE = 0.9  # length_grouped, bundle_tokens auto: bundle documents up to this quantile of lengths
_EXACT_TOKEN_BUDGET_MAX = 20_000  # exact DP up to this many pieces (and work below); greedy (gap -> 0 with n) above
_EXACT_TOKEN_BUDGET_WORK = 40_000_000  # pieces x DP window: ~0.5 s of numpy


@dataclass(frozen=True)
class PlanSettings:
    """Planner knobs (the planning part of ``BatchingConfig``), so planners stay config-free."""

    strategy: str = "packed"
    rows_per_batch: int = 8  # random, length_grouped
    max_tokens_per_batch: int = 8192  # token_budget, packed: rows x T slots
    seq_len: int = 1024  # packed row length
    long_docs: str = "split"  # packed / token_budget: documents longer than a row: split | truncate
    pad_to_multiple_of: int = 1
    mega_batch_mult: int = 50
    bundle_tokens: int | str = "auto"  # packed / token_budget: short documents bundled at random; 0 = off
    drop_last: bool = False
    shard_docs: int = 1 << 20  # plan_epoch_sharded: documents per shard, which bounds planning memory

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}; got {self.strategy!r}")
        if self.long_docs not in ("split", "truncate"):
            raise ValueError(f"long_docs: expected split or truncate; got {self.long_docs!r}")
        for name in ("rows_per_batch", "max_tokens_per_batch", "seq_len", "pad_to_multiple_of", "mega_batch_mult", "shard_docs"):
            v = getattr(self, name)  # an integer, not "16" or 16.5 (which failed later inside numpy)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: expected a positive integer; got {v!r}")
        if not isinstance(self.drop_last, (bool, np.bool_)):  # "no" is truthy
            raise ValueError(f"drop_last: expected true or false; got {self.drop_last!r}")
        if self.bundle_tokens != "auto" and int(self.bundle_tokens) < 0:
            raise ValueError(f"bundle_tokens: expected auto, 0 (off) or a positive number of tokens; got {self.bundle_tokens!r}")
        if self.strategy == "packed" and self.bundle_tokens != "auto" and int(self.bundle_tokens) > self.seq_len // 2:
            raise ValueError(
                f"bundle_tokens: expected 0 (off) up to half of seq_len ({self.seq_len // 2}) so that a bundle fits a "
                f"packed row; got {self.bundle_tokens!r}"
            )
        if self.max_tokens_per_batch < self.pad_to_multiple_of:
            raise ValueError(
                f"max_tokens_per_batch ({self.max_tokens_per_batch}) must be at least pad_to_multiple_of ({self.pad_to_multiple_of})"
            )
        if self.strategy == "packed" and self.rows_per_packed_batch < 1:
            raise ValueError(
                f"max_tokens_per_batch ({self.max_tokens_per_batch}) must hold one packed row of "
                f"{_round_up(self.seq_len, self.pad_to_multiple_of)} slots (seq_len rounded up to pad_to_multiple_of)"
            )

    @property
    def rows_per_packed_batch(self) -> int:
        return self.max_tokens_per_batch // _round_up(self.seq_len, self.pad_to_multiple_of)

    @property
    def bundle_cap(self) -> int:
        """packed: pieces up to this many tokens are bundled before packing (0: none are)."""
        return self.seq_len // 4 if self.bundle_tokens == "auto" else int(self.bundle_tokens)

    def grouped_bundle_cap(self, lengths: np.ndarray) -> int:
        """length_grouped: documents up to this many tokens are bundled (0: none are). auto = the 90th
        percentile of the lengths, at most half the longest: bundles (``cap`` to ``2 cap`` tokens) are then
        about as long as the longer tenth of the documents, so batches still group rows of one length,
        and no row is longer than the longest document, so the largest batch is no larger than with one
        document per row. On the embedded default: cap 133 tokens, 1.7 documents a row."""
        if self.bundle_tokens != "auto":
            return int(self.bundle_tokens)
        if len(lengths) == 0:
            return 0
        return int(min(np.quantile(lengths, GROUPED_BUNDLE_QUANTILE), lengths.max() // 2))

    def bundle_cap_for(self, row_cap: int) -> int:
        """token_budget, whose rows hold at most ``row_cap`` tokens: auto = a fifth of the budget (bundles under
        two fifths, so a batch holds two or more), and never more than half a row, so that a bundle fits one.
        A fifth: on oasst-threads at 8,192, batches then hold 0.85 of the budget in real tokens (a quarter:
        0.82, an eighth: 0.88), while batches of two tasks of different lengths stay mixed (homogeneity 0.07;
        an eighth: 0.38)."""
        cap = self.max_tokens_per_batch // 5 if self.bundle_tokens == "auto" else int(self.bundle_tokens)
        return min(cap, row_cap // 2)

    @classmethod
    def from_config(cls, cfg, **overrides) -> PlanSettings:
        """From a ``BatchingConfig``, field by field: renaming a config field fails here at once
        instead of silently leaving the planner at its default."""
        kw = dict(
            strategy=cfg.strategy,
            rows_per_batch=cfg.rows_per_batch,
            max_tokens_per_batch=cfg.max_tokens_per_batch,
            seq_len=cfg.seq_len,
            long_docs=cfg.long_docs,
            pad_to_multiple_of=cfg.pad_to_multiple_of,
            mega_batch_mult=cfg.mega_batch_mult,
            bundle_tokens=cfg.bundle_tokens,
            drop_last=cfg.drop_last,
            shard_docs=cfg.shard_docs,
        )
        kw.update(overrides)
        return cls(**kw)


def plan_epoch(lengths, settings: PlanSettings, seed: int, epoch: int, rank: int = 0, world_size: int = 1) -> Plan:
    """Plan one epoch of ``lengths`` (tokens per document) for ``rank`` of ``world_size``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError("lengths: expected a one-dimensional array of token counts")
    if len(lengths) and lengths.min() < 1:
        raise ValueError(
            f"lengths: every document needs at least one token; document {int(np.argmin(lengths))} has {int(lengths.min())}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size ({world_size}); got {rank}")
    rng = np.random.default_rng(
        np.random.SeedSequence([int(seed) % 2**63, int(epoch) % 2**63, STRATEGIES.index(settings.strategy)])
    )
    plan = plan_documents(lengths, settings, rng)
    return plan if world_size == 1 else _shard(plan, rank, world_size)


def plan_documents(lengths: np.ndarray, settings: PlanSettings, rng: np.random.Generator) -> Plan:
    """One plan of ``lengths`` (int64, each >= 1, not checked here) drawing randomness from ``rng``."""
    return _PLANNERS[settings.strategy](lengths, settings, rng)


# ------------------------------------------------------------------------------ the planners
def _plan_random(lengths, s: PlanSettings, rng) -> Plan:
    return _one_item_per_row(rng.permutation(len(lengths)), lengths, s)


def _plan_length_grouped(lengths, s: PlanSettings, rng) -> Plan:
    """Rows of one item each, ``rows_per_batch`` rows a batch, grouped by length as Hugging Face's
    ``get_length_grouped_indices`` does (``_grouped_order``).

    An item is a document, or, with bundling (``bundle_tokens``, auto: ``grouped_bundle_cap``), a
    bundle of short documents drawn at random (``packing.bundle``) whose documents attend only to
    themselves, as in packed rows. With one document per row (``bundle_tokens: 0``, Hugging Face's
    ``group_by_length``), a batch is documents of one length, which in instruction data means one
    task, even one answer: on the embedded default such steps train far worse than random batches
    (0.76 exact match after 500 steps against 1.0; docs/benchmarks.md, time to quality). Bundles are
    about as long as the longer documents, so rows still group by length, while a bundle's documents
    are a random sample of the epoch."""
    cap = s.grouped_bundle_cap(lengths)
    if cap < 1:
        return _one_item_per_row(_grouped_order(lengths, s, rng), lengths, s)
    items = bundle(lengths, cap, rng, fillers=0.0)
    return _one_item_per_row(_grouped_order(items.length, s, rng), lengths, s, items)


def _grouped_order(lengths, s: PlanSettings, rng) -> np.ndarray:
    """Hugging Face ``get_length_grouped_indices``: shuffle, sort mega-batches of
    ``mega_batch_mult * rows_per_batch`` by length (descending, stable), then swap the longest
    into the very first slot so an out-of-memory shows at step 0."""
    order = rng.permutation(len(lengths))
    mega = s.mega_batch_mult * s.rows_per_batch
    key = np.arange(len(order)) // mega
    ls = lengths[order]
    if len(order) and ls.max() < 2**16 and key[-1] < 2**16:  # two stable 16-bit radix passes: 5x lexsort
        o = np.argsort((2**16 - 1 - ls).astype(np.uint16), kind="stable")
        o = o[np.argsort((o // mega).astype(np.uint16), kind="stable")]
    else:
        o = np.lexsort((-ls, key))  # stable: ties keep the shuffled order
    order = order[o]
    if len(order):
        heads = order[::mega]  # each mega-batch's longest
        j = int(np.argmax(lengths[heads])) * mega
        order[0], order[j] = order[j], order[0]
    return order


def _plan_token_budget(lengths, s: PlanSettings, rng) -> Plan:
    """Padding batches with rows x roundup(longest) <= max_tokens_per_batch.

    Rows are items: a document (or a piece of one longer than the budget, split or truncated), or, with
    bundling (``bundle_cap``), a bundle of short documents drawn at random (``packing.bundle``), whose
    documents attend only to themselves as in packed rows. Sorting single documents by length makes
    every batch one length, which in instruction data is one task: such steps train worse than random
    padded batches (docs/benchmarks.md, time to quality); rows of bundles have similar lengths and
    random contents. ``bundle_tokens: 0`` keeps one document per row.

    Guarantee: the fewest batches any grouping of the length-sorted items can reach (greedy is optimal
    for that), and among those, the fewest padded slots: exact DP up to 20k items; above that, or when
    short items make the DP window wide, greedy, whose gap vanishes as runs of equal lengths grow.
    oasst-threads at 8192 without bundles: 26 batches, fill 0.952 (the optimum; greedy alone 0.949).
    10M lengths: ~1.2 s. Randomness: the bundles, ties between equal lengths, and batch order.
    """
    cap = s.max_tokens_per_batch // s.pad_to_multiple_of * s.pad_to_multiple_of
    pc = cut_long(lengths, cap, s.long_docs)
    bundled = s.bundle_cap_for(cap)
    items = bundle(pc.plen, bundled, rng, fillers=0.0) if bundled else None
    ilen = pc.plen if items is None else items.length
    order = desc_random_ties(ilen, rng) if items is None else desc_stable(ilen)  # items come shuffled
    sorted_len = sorted_desc(ilen)  # == ilen[order], without the gather
    n = len(sorted_len)
    widest = s.max_tokens_per_batch // max(1, int(sorted_len[-1])) if n else 0  # DP window of the shortest
    if n <= _EXACT_TOKEN_BUDGET_MAX and n * min(n, widest) <= _EXACT_TOKEN_BUDGET_WORK:
        r = _round_up(sorted_len, s.pad_to_multiple_of)
        cuts = exact_cuts(r, s.max_tokens_per_batch // r)
    else:
        h = np.bincount(_round_up(ilen, s.pad_to_multiple_of))[::-1]  # runs of equal rounded length
        vals = np.arange(len(h) - 1, -1, -1)[h > 0]
        cuts = greedy_cuts(np.cumsum(h[h > 0]), s.max_tokens_per_batch // vals)
    bperm = rng.permutation(len(cuts) - 1)
    at = ranges(cuts[bperm], cuts[bperm + 1])  # plan position -> sorted position
    batch_ptr = np.concatenate([[0], np.cumsum(np.diff(cuts)[bperm])]).astype(np.int64)
    if items is None:
        return Plan(
            *pc.take(order[at], sorted_len[at]),
            np.arange(len(at) + 1, dtype=np.int64),
            batch_ptr,
            s.pad_to_multiple_of,
            pc.split,
            pc.truncated,
        )
    src = order[at]
    pieces = items.expand(src)
    row_ptr = np.concatenate([[0], np.cumsum(items.counts(src))]).astype(np.int64)
    return Plan(*pc.take(pieces, pc.plen[pieces]), row_ptr, batch_ptr, s.pad_to_multiple_of, pc.split, pc.truncated)


def _plan_packed(lengths, s: PlanSettings, rng) -> Plan:
    """Best-fit decreasing into rows of ``seq_len``, run on the length histogram.

    Exact BFD over groups of identical rows (see ``packing.best_fit_decreasing``). Documents longer
    than seq_len are split into seq_len pieces or truncated. Pieces of at most ``bundle_cap`` tokens
    are first bundled at random (``packing.bundle``) and the bundles packed, so that a row is a random
    sample of the epoch rather than a run of documents of one length (one task, one source): with
    sorted rows, steps of a row or two train worse than random padded batches (docs/benchmarks.md,
    time to quality). Fill: docs/benchmarks.md. Randomness: the bundles, which equal-length items go
    where, row order (hence batch order).
    """
    S = s.seq_len
    pc = cut_long(lengths, S, s.long_docs)
    plen = pc.plen
    if s.bundle_cap < 1:
        order = desc_random_ties(plen, rng)
        groups = best_fit_decreasing(np.bincount(plen, minlength=S + 1), S)
        src, src_len, row_ptr, batch_ptr = layout_rows(groups, order, S, s.rows_per_packed_batch, rng)
        return Plan(*pc.take(src, src_len), row_ptr, batch_ptr, s.pad_to_multiple_of, pc.split, pc.truncated)
    items = bundle(plen, s.bundle_cap, rng)
    order = desc_stable(items.length)  # bundles and single pieces come shuffled: ties need no more randomness
    groups = best_fit_decreasing(np.bincount(items.length, minlength=S + 1), S)
    src, _, item_row_ptr, batch_ptr = layout_rows(groups, order, S, s.rows_per_packed_batch, rng)
    pieces = items.expand(src)
    row_ptr = np.concatenate([[0], np.cumsum(items.counts(src))])[item_row_ptr].astype(np.int64)
    return Plan(*pc.take(pieces, plen[pieces]), row_ptr, batch_ptr, s.pad_to_multiple_of, pc.split, pc.truncated)


_PLANNERS = {
    "random": _plan_random,
    "length_grouped": _plan_length_grouped,
    "token_budget": _plan_token_budget,
    "packed": _plan_packed,
}


# ---------------------------------------------------------------------------------- helpers
def _one_item_per_row(order, lengths, s: PlanSettings, items: Bundles | None = None) -> Plan:
    """Rows of one item each, in ``order``, ``rows_per_batch`` rows a batch; an item is a document, or
    with ``items`` a bundle of them (``order`` then indexes the bundles)."""
    n, k = len(order), s.rows_per_batch
    dropped = np.zeros(0, np.int64)
    if s.drop_last and n % k:
        order, rest = order[: n - n % k], order[n - n % k :]
        dropped = np.sort(rest if items is None else items.expand(rest))
    n = len(order)
    docs = order.astype(np.int64, copy=False) if items is None else items.expand(order)
    row_ptr = np.arange(n + 1, dtype=np.int64) if items is None else np.concatenate([[0], np.cumsum(items.counts(order))])
    return Plan(
        docs,
        np.zeros(len(docs), np.int64),
        lengths[docs],
        row_ptr.astype(np.int64, copy=False),
        np.append(np.arange(0, n, k), n).astype(np.int64),
        s.pad_to_multiple_of,
        dropped=dropped,
    )


def _reorder_batches(p: Plan, bperm: np.ndarray, extra_rows: list[np.ndarray] | None = None) -> Plan:
    """A plan with batches ``bperm`` (then optional extra batches given as row-index arrays)."""
    rows_of = [ranges(p.batch_ptr[bperm], p.batch_ptr[bperm + 1])] + (extra_rows or [])
    rows = np.concatenate(rows_of).astype(np.int64)
    nrows = np.concatenate([np.diff(p.batch_ptr)[bperm]] + [[len(x)] for x in (extra_rows or [])]).astype(np.int64)
    pieces = ranges(p.row_ptr[rows], p.row_ptr[rows + 1])
    row_ptr = np.concatenate([[0], np.cumsum(p.row_ptr[rows + 1] - p.row_ptr[rows])]).astype(np.int64)
    return Plan(
        p.doc[pieces],
        p.start[pieces],
        p.stop[pieces],
        row_ptr,
        np.concatenate([[0], np.cumsum(nrows)]).astype(np.int64),
        p.pad_to_multiple_of,
        p.split,
        p.truncated,
        p.dropped,
    )


def _shard(p: Plan, rank: int, world: int) -> Plan:
    """This rank's share. A step is ``world`` consecutive batches, one per rank (each within its
    budget). The last, incomplete step's batches are split row-wise among all ranks (heaviest
    batch gets the spare ranks first; rows dealt longest-first round-robin, so shares stay within
    the original batch's budget and balanced in slots). A rank with nothing left gets an empty batch."""
    nb = p.num_batches
    full = nb // world * world
    mine = np.arange(rank, full, world, dtype=np.int64)
    tail = list(range(full, nb))
    if not tail:
        return _reorder_batches(p, mine)
    _, slots = p.batch_stats()
    rl = p.row_lengths()
    nrows = np.diff(p.batch_ptr)
    shares = {b: 1 for b in tail}
    for _ in range(world - len(tail)):
        cand = [b for b in tail if shares[b] < nrows[b]]
        if not cand:
            break
        b = max(cand, key=lambda b: (slots[b] / shares[b], -b))
        shares[b] += 1
    parts: list[np.ndarray] = []
    for b in tail:
        rows = np.arange(p.batch_ptr[b], p.batch_ptr[b + 1])
        rows = rows[np.argsort(-rl[rows], kind="stable")]
        parts.extend(rows[j :: shares[b]] for j in range(shares[b]))
    parts += [np.zeros(0, np.int64)] * (world - len(parts))
    return _reorder_batches(p, mine, [parts[rank]])
