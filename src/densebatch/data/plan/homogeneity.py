"""How alike the documents of a batch are, against the epoch: the hazard of dense plans, measured.

Sorting by length makes a batch of one length, and in instruction data documents of one length are
often of one task or one source: a step then teaches one thing, and such steps train worse than
random ones (docs/benchmarks.md, time to quality). Two numbers, each 0 for batches drawn at random
and 1 for batches whose documents are all alike:

- ``length``: 1 - (pooled within-batch variance of the documents' length quantiles) / (the epoch's
  variance), both unbiased, so random batches score about 0 whatever their size; quantiles (mid-ranks
  in [0, 1]) rather than tokens, so that rows of a long document and short fillers, as best-fit leaves
  them, do not hide batches that are all of one length;
- ``source``: the same with the chance that two documents of a batch come from different sources
  (Gini impurity, unbiased) against the epoch's; None with one source.

A document is counted once per piece, with its whole length. Batches of one piece carry no spread
and are left out. numpy only; one pass over the plan's pieces (a sharded plan shard by shard).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from densebatch.data.plan.strategies import STRATEGIES
from densebatch.data.store.joined import JoinedArray
from densebatch.data.store.store import take, windows

HOMOGENEOUS = 0.3  # above this (length or source), a run warns that its batches are far from random samples


def _parts(plan) -> Iterable:
    if hasattr(plan, "shard_plans"):  # EpochRows
        return plan.shard_plans()
    if hasattr(plan, "num_shards"):  # ShardedPlan
        return (plan.shard(k) for k in range(plan.num_shards))
    return (plan,)


def _quantile_table(lengths) -> np.ndarray:
    """``table[v]``: the mid-rank of length ``v`` among all, in [0, 1] (a few very long documents do not swamp
    the spread). From a histogram of the lengths read window by window: memory grows with the longest
    document, not with the corpus (a store's lengths stay on disk)."""
    n = len(lengths)
    counts = np.zeros(1, np.int64)
    for _, w in windows(lengths, 1 << 22):
        h = np.bincount(w.astype(np.int64))
        counts = np.pad(counts, (0, max(0, len(h) - len(counts))))
        counts[: len(h)] += h
    below = np.cumsum(counts) - counts
    return (below + (counts - 1) / 2) / max(1, n - 1)


def homogeneity(
    plan,
    *,
    lengths: np.ndarray,
    source_of: Callable[[np.ndarray], np.ndarray] | None = None,
    num_sources: int = 1,
    max_shards: int | None = None,
) -> dict:
    """``{"length": h, "source": h or None}`` of ``plan`` (a ``Plan``, ``ShardedPlan`` or ``EpochRows``);
    ``source_of(docs)`` gives each document's source, one of ``num_sources`` (None: one source).
    ``max_shards``: measure a sharded plan on its first shards only (each is a sample of the epoch)."""
    if not isinstance(lengths, np.ndarray | JoinedArray):
        lengths = np.asarray(lengths, np.int64)
    table = _quantile_table(lengths)
    within_ss = within_df = 0.0  # lengths: pooled sum of squares and degrees of freedom
    n_all, s1_all, s2_all = 0, 0.0, 0.0
    pair_diff = pair_all = 0.0  # sources: unordered pairs of a batch from different sources, all pairs
    k = max(1, int(num_sources))
    counts_all = np.zeros(k, np.int64)
    for i, p in enumerate(_parts(plan)):
        if max_shards is not None and i >= max_shards:
            break
        if len(p.doc) == 0:
            continue
        batch = np.repeat(np.repeat(np.arange(p.num_batches), np.diff(p.batch_ptr)), np.diff(p.row_ptr))
        x = table[take(lengths, p.doc).astype(np.int64)]
        n = np.bincount(batch, minlength=p.num_batches).astype(np.float64)
        s1 = np.bincount(batch, weights=x, minlength=p.num_batches)
        s2 = np.bincount(batch, weights=x * x, minlength=p.num_batches)
        many = n >= 2
        within_ss += float(np.sum(s2[many] - s1[many] ** 2 / n[many]))
        within_df += float(np.sum(n[many] - 1))
        n_all, s1_all, s2_all = n_all + len(x), s1_all + float(x.sum()), s2_all + float((x * x).sum())
        if source_of is not None and k > 1:
            src = np.asarray(source_of(p.doc), np.int64)
            per = np.bincount(batch * k + src, minlength=p.num_batches * k).reshape(p.num_batches, k).astype(np.float64)
            same = (per * (per - 1)).sum(axis=1) / 2
            pairs = n * (n - 1) / 2
            pair_diff += float(np.sum(pairs[many] - same[many]))
            pair_all += float(np.sum(pairs[many]))
            counts_all += np.bincount(src, minlength=k)
    out: dict = {"length": None, "source": None}
    if n_all >= 2 and within_df > 0:
        total_var = (s2_all - s1_all**2 / n_all) / (n_all - 1)
        out["length"] = 1.0 - (within_ss / within_df) / total_var if total_var > 0 else 0.0
    if (counts_all > 0).sum() > 1 and pair_all > 0:
        c = counts_all.astype(np.float64)
        epoch_diff = 1.0 - float((c * (c - 1)).sum()) / (n_all * (n_all - 1))  # two distinct documents differ
        out["source"] = 1.0 - (pair_diff / pair_all) / epoch_diff
    return out


def warning(h: dict, strategy: str, bundle_tokens: int | str = "auto") -> str | None:
    """The run's one warning when its batches are far more alike than random ones (None otherwise), with
    the change that mixes them for this strategy and ``batching.bundle_tokens``."""
    alike = {k: v for k, v in h.items() if v is not None and v > HOMOGENEOUS}
    if not alike:
        return None
    what = " and ".join(f"{k} (homogeneity {v:.2f}; random batches: 0)" for k, v in alike.items())
    fix = STRATEGIES[strategy].homogeneity_advice(bundle_tokens)
    return (
        f"warning: {strategy} batches are far more alike than random ones in {what}: steps of one length are often "
        "steps of one task or source, which can train worse than random batches (docs/benchmarks.md, time to "
        f"quality); {fix}"
    )
