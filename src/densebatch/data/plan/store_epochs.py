"""Epochs of a prepared store: the documents one epoch of a (multi-source) store selects and their plan
(``mixture.select_mixture`` decides which documents, the planners how).

A prepared store keeps its sources end to end (``store.source``, ``store.source_offsets()``,
``meta["sources"]``), which is the layout a ``Selection`` plans from. With no weights (every
``data.sources[i].weight`` unset, or ``data.path``) an epoch is every document once, planned exactly
as ``plan_epoch`` plans a single corpus; with weights, each source's share of the epoch's tokens is
its weight's share (semantics in ``mixture``: whole passes, then a seeded sample without repetition).
"""

from __future__ import annotations

import numpy as np

from densebatch.data.plan.mixture import Selection, select_mixture
from densebatch.data.plan.planner import Plan, PlanSettings, join_plans, plan_epoch
from densebatch.data.plan.shards import EpochRows, ShardedPlan, plan_epoch_sharded
from densebatch.data.store.spans import source_lengths
from densebatch.errors import DataError


def select(store, *, weights, seed: int, epoch: int, lengths=None) -> Selection:
    """The ``Selection`` of ``epoch`` (``weights`` None: natural shares, every document once)."""
    names = store.source_names
    if weights is not None and len(weights) != len(names):
        raise DataError(
            f"data.sources: {len(weights)} weights for prepared documents of {len(names)} sources ({', '.join(names)})"
        )
    try:
        return select_mixture(source_lengths(store, lengths), weights=weights, seed=seed, epoch=epoch, names=names)
    except ValueError as e:
        raise DataError(f"data.sources: {e}") from None


def epoch_selection(store, *, weights, seed: int, epoch: int, lengths=None) -> Selection | None:
    """The documents epoch ``epoch`` plans, or None when it is every document once (no weights)."""
    return None if weights is None else select(store, weights=weights, seed=seed, epoch=epoch, lengths=lengths)


def plan_store_epoch(store, *, settings: PlanSettings, seed: int, epoch: int, weights=None, lengths=None) -> Plan:
    """One epoch's whole plan (all ranks) of ``store``'s documents mixed by ``weights``, as one ``Plan`` with
    store document ids (a document an up-weighted source repeats appears once per repeat). Without
    weights: ``plan_epoch`` itself. With weights: the sharded planner on the epoch's selection, its
    shards laid end to end (memory as ``plan_epoch``'s: every piece of the epoch)."""
    lengths = store.lengths if lengths is None else lengths
    selection = epoch_selection(store, weights=weights, seed=seed, epoch=epoch, lengths=lengths)
    if selection is None and len(lengths) <= settings.shard_docs:
        return plan_epoch(
            np.asarray(lengths, np.int64), settings=settings, seed=seed, epoch=epoch
        )  # one shard: the sharded plan is this one
    # Large corpora are planned shard by shard (bounded planning memory, the plan `analyze` reports).
    return materialise(plan_epoch_sharded(lengths, settings=settings, seed=seed, epoch=epoch, selection=selection))


def rows_of_epoch(
    lengths, *, settings: PlanSettings, seed: int, epoch: int, selection: Selection | None = None
) -> Plan | EpochRows:
    """The rows of one epoch of ``lengths`` (or of ``selection``'s documents: ``select``) as a loader reads
    them: the whole ``Plan`` up to ``shard_docs`` documents, else an ``EpochRows`` of the sharded plan,
    which holds the shards' index, not their pieces (bounded memory)."""
    if selection is None and len(lengths) <= settings.shard_docs:
        return plan_epoch(np.asarray(lengths, np.int64), settings=settings, seed=seed, epoch=epoch)
    return EpochRows(plan_epoch_sharded(lengths, settings=settings, seed=seed, epoch=epoch, selection=selection))


def materialise(sharded: ShardedPlan) -> Plan:
    """A ``ShardedPlan`` as one ``Plan``: its shards' pieces, rows and batches end to end (same batch order)."""
    return join_plans([sharded.shard(k) for k in range(sharded.num_shards)], sharded.pad_to_multiple_of)


def epoch_shares(store, weights, seed: int, epoch: int = 0) -> dict[str, dict]:
    """{source: documents, tokens, share} of the tokens epoch ``epoch`` selects (before planning)."""
    return select(store, weights=weights, seed=seed, epoch=epoch).stats()


EVAL_STREAM = 0xE7A1  # the eval selection's own random stream: no other draw of the run moves it


def eval_documents(lengths: np.ndarray, max_tokens: int | None, seed: int) -> np.ndarray | None:
    """The held-out documents every evaluation scores under ``eval.max_tokens``: a seeded random
    selection (the run's seed), the same at every evaluation and on every number of ranks, taken in
    that order while their tokens fit the cap (at least one document), returned in store order; None
    when the whole split fits."""
    lengths = np.asarray(lengths, np.int64)
    if max_tokens is None or int(lengths.sum()) <= max_tokens:
        return None
    order = np.random.default_rng([seed, EVAL_STREAM]).permutation(len(lengths))
    k = max(1, int(np.searchsorted(np.cumsum(lengths[order]), max_tokens, side="right")))
    return np.sort(order[:k])
