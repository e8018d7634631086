"""The batching strategies, one object each: what a strategy plans and every rule that depends on it.

A ``Strategy`` owns its name (the ``batching.strategy`` value), a seed tag that keeps its random stream
apart from the others' (fixed per strategy, never a position in a list, so adding a strategy moves no
plan), the checks on its settings, its planner, and what the wiring asks of it: the longest row, the
truncation cap, full-context evaluation settings, the budgets worth trying, the worst batches, the unit
a sharded plan's shards are multiples of, and the advice when its batches come out too alike.
``STRATEGIES`` is the registry, by name; no other module compares strategy names.

Settings are read by attribute (a ``planner.PlanSettings``, or a ``BatchingConfig`` whose
``max_tokens_per_batch`` may still be ``auto``), so this module imports neither. numpy only.
"""

from __future__ import annotations

from dataclasses import replace

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
from densebatch.data.plan.plan import Plan, round_up
from densebatch.data.plan.steps import rows_of

GROUPED_BUNDLE_QUANTILE = 0.9  # length_grouped, bundle_tokens auto: bundle documents up to this quantile of lengths
_EXACT_TOKEN_BUDGET_MAX = 20_000  # exact DP up to this many pieces (and work below); greedy (gap -> 0 with n) above
_EXACT_TOKEN_BUDGET_WORK = 40_000_000  # pieces x DP window: ~0.5 s of numpy

Row = tuple[int, str | None]  # (tokens, the setting that bounds them; None: the longest document does)


def _budget(s) -> int | None:
    """The token budget, or None while it is still ``auto`` (a configuration before the finder ran)."""
    return None if s.max_tokens_per_batch == "auto" else int(s.max_tokens_per_batch)


class Strategy:
    """One batching strategy. Subclasses set ``name``, ``seed_tag`` and ``plan``, and override the rules
    that differ from these defaults (rows of whole documents, sized by ``rows_per_batch``)."""

    name: str
    seed_tag: int  # the third word of every plan's seed: (seed, epoch, seed_tag); never reused
    sized_by_budget = False  # batches sized by max_tokens_per_batch (the budget finder's strategies)
    # The batching keys its plan reads of those only some strategies read (rules.unread_keys: a key set for
    # another strategy is noted, not silently ignored); sized_by_budget strategies also read rows_per_batch
    # where a mixture's sources are weighted as random batches of that many documents (train.source_balance).
    reads: tuple[str, ...] = ("rows_per_batch",)

    def check(self, s) -> None:
        """``ValueError`` (the setting's name first) when ``s``'s numbers cannot work for this strategy."""

    def plan(self, lengths: np.ndarray, s, rng: np.random.Generator) -> Plan:
        """One plan of ``lengths`` (int64, each >= 1) drawing its randomness from ``rng``."""
        raise NotImplementedError

    def longest_row(self, s, longest_doc: int) -> Row:
        """The longest row a plan of ``s`` lays out for documents of at most ``longest_doc`` tokens (before
        rounding to ``pad_to_multiple_of``), and the setting that bounds it."""
        return int(longest_doc), None

    def truncation_cap(self, s) -> Row | None:
        """(the length past which ``long_docs: truncate`` cuts a document, the setting that sets it); None when
        this strategy's rows hold whole documents (or its budget is still ``auto``)."""
        return None

    def bundle_cap(self, s, lengths: np.ndarray) -> int:
        """Pieces up to this many tokens are bundled before they are laid out (0: none are), for an epoch of
        documents of ``lengths``."""
        return 0

    def eval_settings(self, s, longest: int):
        """``s`` with a budget that holds one longest document: evaluation never splits or truncates one."""
        return replace(s, max_tokens_per_batch=max(s.max_tokens_per_batch, int(round_up(longest, s.pad_to_multiple_of))))

    def budget_range(self, s, lengths: np.ndarray) -> tuple[int, int, int]:
        """(unit, lowest, highest) budget worth trying on ``lengths``; ``ValueError`` for rows sized by count."""
        raise ValueError(f"strategy: a token budget sizes token_budget and packed batches, not {self.name}")

    def worst_batches(self, plan: Plan, lengths: np.ndarray, s) -> list[tuple[list, int]]:
        """(rows, the plan's index of the first row) of the batches that need the most memory: ``plan``'s
        batch with the most slots."""
        _, slots = plan.batch_stats()
        i = int(np.argmax(slots))
        rows = np.arange(plan.batch_ptr[i], plan.batch_ptr[i + 1], dtype=np.int64)
        return [(rows_of(plan, rows), int(rows[0]))]

    def shard_unit(self, s) -> int:
        """Shards of a sharded plan hold a multiple of this many documents (its plans then match the whole
        corpus's up to a shard's last batch)."""
        return 1

    def homogeneity_advice(self, bundle_tokens) -> str:
        """What mixes this strategy's batches when they come out far more alike than random ones."""
        if bundle_tokens == 0:
            return "bundled plans mix them: set batching.bundle_tokens: auto (or more tokens)"
        return (
            f"bundled plans mix them: raise batching.bundle_tokens ({bundle_tokens} now) so that more documents are "
            "bundled at random"
        )


class Random(Strategy):
    """``rows_per_batch`` documents a batch, in a random order, one per row."""

    name, seed_tag = "random", 0
    reads = ("rows_per_batch", "drop_last")

    def plan(self, lengths, s, rng) -> Plan:
        return _one_item_per_row(rng.permutation(len(lengths)), lengths, s)

    def shard_unit(self, s) -> int:
        return s.rows_per_batch

    def homogeneity_advice(self, bundle_tokens) -> str:
        return "random batches this alike are the data's own order of lengths and sources"


class LengthGrouped(Strategy):
    """Rows of one item each, ``rows_per_batch`` rows a batch, grouped by length as Hugging Face's
    ``get_length_grouped_indices`` does (``_grouped_order``).

    An item is a document, or, with bundling (``bundle_tokens``, auto: ``bundle_cap``), a bundle of short
    documents drawn at random (``packing.bundle``) whose documents attend only to themselves, as in packed
    rows. With one document per row (``bundle_tokens: 0``, Hugging Face's ``group_by_length``), a batch is
    documents of one length, which in instruction data means one task, even one answer: on the embedded
    default such steps train far worse than random batches (0.76 exact match after 500 steps against 1.0;
    docs/benchmarks.md, time to quality). Bundles are about as long as the longer documents, so rows still
    group by length, while a bundle's documents are a random sample of the epoch."""

    name, seed_tag = "length_grouped", 1
    reads = ("rows_per_batch", "mega_batch_mult", "bundle_tokens", "drop_last")

    def bundle_cap(self, s, lengths: np.ndarray) -> int:
        """Documents up to this many tokens are bundled (0: none are). auto = the 90th percentile of the
        lengths, at most half the longest: bundles (``cap`` to ``2 cap`` tokens) are then about as long as
        the longer tenth of the documents, so batches still group rows of one length, and no row is longer
        than the longest document, so the largest batch is no larger than with one document per row. On
        the embedded default: cap 133 tokens, 1.7 documents a row."""
        if s.bundle_tokens != "auto":
            return int(s.bundle_tokens)
        if len(lengths) == 0:
            return 0
        return int(min(np.quantile(lengths, GROUPED_BUNDLE_QUANTILE), lengths.max() // 2))

    def plan(self, lengths, s, rng) -> Plan:
        cap = self.bundle_cap(s, lengths)
        if cap < 1:
            return _one_item_per_row(_grouped_order(lengths, s, rng), lengths, s)
        items = bundle(lengths, cap, rng, fillers=0.0)
        return _one_item_per_row(_grouped_order(items.length, s, rng), lengths, s, items)

    def shard_unit(self, s) -> int:
        return s.rows_per_batch * s.mega_batch_mult


class TokenBudget(Strategy):
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

    name, seed_tag = "token_budget", 2
    sized_by_budget = True
    reads = ("max_tokens_per_batch", "bundle_tokens", "long_docs")

    @staticmethod
    def row_cap(s) -> int:
        """The longest row (and piece) a plan lays out: the budget rounded down to ``pad_to_multiple_of``, so that
        one row's padded slots fit the budget. Longer documents are split or truncated to it."""
        return s.max_tokens_per_batch // s.pad_to_multiple_of * s.pad_to_multiple_of

    def bundle_cap(self, s, lengths: np.ndarray) -> int:
        """Pieces up to this many tokens are bundled: auto = a fifth of the budget (bundles under two fifths, so
        a batch holds two or more), and never more than half a row (``row_cap``), so that a bundle fits one. A
        fifth: on oasst-threads at 8,192, batches then hold 0.85 of the budget in real tokens (a quarter: 0.82,
        an eighth: 0.88), while batches of two tasks of different lengths stay mixed (homogeneity 0.07; an
        eighth: 0.38)."""
        cap = s.max_tokens_per_batch // 5 if s.bundle_tokens == "auto" else int(s.bundle_tokens)
        return min(cap, self.row_cap(s) // 2)

    def plan(self, lengths, s, rng) -> Plan:
        pc = cut_long(lengths, self.row_cap(s), s.long_docs)
        bundled = self.bundle_cap(s, lengths)
        items = bundle(pc.plen, bundled, rng, fillers=0.0) if bundled else None
        ilen = pc.plen if items is None else items.length
        order = desc_random_ties(ilen, rng) if items is None else desc_stable(ilen)  # items come shuffled
        sorted_len = sorted_desc(ilen)  # == ilen[order], without the gather
        n = len(sorted_len)
        widest = s.max_tokens_per_batch // max(1, int(sorted_len[-1])) if n else 0  # DP window of the shortest
        if n <= _EXACT_TOKEN_BUDGET_MAX and n * min(n, widest) <= _EXACT_TOKEN_BUDGET_WORK:
            r = round_up(sorted_len, s.pad_to_multiple_of)
            cuts = exact_cuts(r, s.max_tokens_per_batch // r)
        else:
            h = np.bincount(round_up(ilen, s.pad_to_multiple_of))[::-1]  # runs of equal rounded length
            vals = np.arange(len(h) - 1, -1, -1)[h > 0]
            cuts = greedy_cuts(np.cumsum(h[h > 0]), s.max_tokens_per_batch // vals)
        bperm = rng.permutation(len(cuts) - 1)
        at = ranges(cuts[bperm], cuts[bperm + 1])  # plan position -> sorted position
        batch_ptr = np.concatenate([[0], np.cumsum(np.diff(cuts)[bperm])]).astype(np.int64)
        if items is None:
            pieces, row_ptr = order[at], np.arange(len(at) + 1, dtype=np.int64)
            return Plan(*pc.take(pieces, sorted_len[at]), row_ptr, batch_ptr, s.pad_to_multiple_of, pc.split, pc.truncated)
        src = order[at]
        pieces = items.expand(src)
        row_ptr = np.concatenate([[0], np.cumsum(items.counts(src))]).astype(np.int64)
        return Plan(*pc.take(pieces, pc.plen[pieces]), row_ptr, batch_ptr, s.pad_to_multiple_of, pc.split, pc.truncated)

    def longest_row(self, s, longest_doc: int) -> Row:
        if _budget(s) is None:
            return int(longest_doc), None
        return min(int(longest_doc), self.row_cap(s)), "max_tokens_per_batch"

    def truncation_cap(self, s) -> Row | None:
        if s.long_docs != "truncate" or _budget(s) is None:
            return None
        return self.row_cap(s), "max_tokens_per_batch"

    def budget_range(self, s, lengths) -> tuple[int, int, int]:
        """From one longest document to all documents at once."""
        m = s.pad_to_multiple_of
        longest = int(round_up(np.asarray(lengths, np.int64).max(), m))
        return m, longest, longest * len(lengths)

    def worst_batches(self, plan, lengths, s) -> list[tuple[list, int]]:
        """Also ``budget // longest`` rows of the longest documents: which long documents meet in one batch
        changes with the budget and the epoch; this bound holds for every epoch."""
        order = np.argsort(-lengths, kind="stable")  # documents, longest first
        n = max(1, s.max_tokens_per_batch // int(round_up(lengths.max(), s.pad_to_multiple_of)))
        return [*super().worst_batches(plan, lengths, s), ([[(int(d), 0, int(lengths[d]))] for d in order[:n]], 0)]


class Packed(Strategy):
    """Best-fit decreasing into rows of ``seq_len``, run on the length histogram.

    Exact BFD over groups of identical rows (see ``packing.best_fit_decreasing``). Documents longer
    than seq_len are split into seq_len pieces or truncated. Pieces of at most ``bundle_cap`` tokens
    are first bundled at random (``packing.bundle``) and the bundles packed, so that a row is a random
    sample of the epoch rather than a run of documents of one length (one task, one source): with
    sorted rows, steps of a row or two train worse than random padded batches (docs/benchmarks.md,
    time to quality). Fill: docs/benchmarks.md. Randomness: the bundles, which equal-length items go
    where, row order (hence batch order).
    """

    name, seed_tag = "packed", 3
    sized_by_budget = True
    reads = ("max_tokens_per_batch", "seq_len", "bundle_tokens", "long_docs")

    def check(self, s) -> None:
        if s.bundle_tokens != "auto" and int(s.bundle_tokens) > s.seq_len // 2:
            raise ValueError(
                f"bundle_tokens: expected 0 (off) up to half of seq_len ({s.seq_len // 2}) so that a bundle fits a "
                f"packed row; got {s.bundle_tokens!r}"
            )
        if _budget(s) is not None and self.rows_per_batch(s) < 1:
            raise ValueError(
                f"max_tokens_per_batch: expected at least one packed row of {round_up(s.seq_len, s.pad_to_multiple_of)} "
                f"slots (seq_len rounded up to pad_to_multiple_of); got {s.max_tokens_per_batch}"
            )

    @staticmethod
    def rows_per_batch(s) -> int:
        return s.max_tokens_per_batch // round_up(s.seq_len, s.pad_to_multiple_of)

    def bundle_cap(self, s, lengths: np.ndarray) -> int:
        """Pieces up to this many tokens are bundled before packing (0: none are): auto = a quarter of a row."""
        return s.seq_len // 4 if s.bundle_tokens == "auto" else int(s.bundle_tokens)

    def plan(self, lengths, s, rng) -> Plan:
        S = s.seq_len
        pc = cut_long(lengths, S, s.long_docs)
        plen = pc.plen
        rows = self.rows_per_batch(s)
        cap = self.bundle_cap(s, lengths)
        if cap < 1:
            order = desc_random_ties(plen, rng)
            groups = best_fit_decreasing(np.bincount(plen, minlength=S + 1), S)
            src, src_len, row_ptr, batch_ptr = layout_rows(groups, order=order, seq_len=S, rows_per_batch=rows, rng=rng)
            return Plan(*pc.take(src, src_len), row_ptr, batch_ptr, s.pad_to_multiple_of, pc.split, pc.truncated)
        items = bundle(plen, cap, rng)
        order = desc_stable(items.length)  # bundles and single pieces come shuffled: ties need no more randomness
        groups = best_fit_decreasing(np.bincount(items.length, minlength=S + 1), S)
        src, _, item_row_ptr, batch_ptr = layout_rows(groups, order=order, seq_len=S, rows_per_batch=rows, rng=rng)
        pieces = items.expand(src)
        row_ptr = np.concatenate([[0], np.cumsum(items.counts(src))])[item_row_ptr].astype(np.int64)
        return Plan(*pc.take(pieces, plen[pieces]), row_ptr, batch_ptr, s.pad_to_multiple_of, pc.split, pc.truncated)

    def longest_row(self, s, longest_doc: int) -> Row:
        return int(s.seq_len), "seq_len"

    def truncation_cap(self, s) -> Row | None:
        return (int(s.seq_len), "seq_len") if s.long_docs == "truncate" else None

    def eval_settings(self, s, longest: int):
        """Rows at least as long as the longest document, and a budget that holds one such row."""
        row = int(round_up(max(s.seq_len, int(longest)), s.pad_to_multiple_of))
        return replace(s, seq_len=row, max_tokens_per_batch=max(s.max_tokens_per_batch, row))

    def budget_range(self, s, lengths) -> tuple[int, int, int]:
        """Whole rows, from one row to every token at once."""
        unit = int(round_up(s.seq_len, s.pad_to_multiple_of))
        return unit, unit, unit * (int(np.asarray(lengths, np.int64).sum()) // unit + len(lengths) // 8 + 2)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Random(), LengthGrouped(), TokenBudget(), Packed())}
assert len({s.seed_tag for s in STRATEGIES.values()}) == len(STRATEGIES), "every strategy needs its own seed tag"
DEFAULT_STRATEGY = Packed.name  # batching.strategy's default, and the Python API's


# ---------------------------------------------------------------------------------- helpers
def _one_item_per_row(order, lengths, s, items: Bundles | None = None) -> Plan:
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


def _grouped_order(lengths, s, rng) -> np.ndarray:
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
