"""The strategy's rules in the configuration's terms: its checks as one-line ``ConfigError``s naming the
``batching.`` key, its longest row and truncation cap with the key that sets them, its evaluation plan,
budget range and worst batches.

Each rule is the strategy object's (``strategies.STRATEGIES``); the wiring (``run/``), the loader and the
finders ask these functions instead of comparing strategy names themselves.
"""

from __future__ import annotations

import numpy as np

from densebatch.config import BatchingConfig
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.strategies import STRATEGIES
from densebatch.data.store.store import read_ranges, windows
from densebatch.errors import ConfigError


def sized_by_budget(strategy: str) -> bool:
    """Whether ``strategy``'s batches are sized by ``max_tokens_per_batch`` (the budget finder's strategies)."""
    return STRATEGIES[strategy].sized_by_budget


def check_batching(b) -> None:
    """``ConfigError`` naming the key when a ``BatchingConfig``'s numbers cannot work for its strategy
    (``max_tokens_per_batch`` may still be ``auto``): the planner's own rules, its ``ValueError`` prefixed."""
    strategy = STRATEGIES[b.strategy]
    try:
        strategy.check(b)  # what the strategy needs, the budget too unless it is still auto
        if b.max_tokens_per_batch != "auto":
            PlanSettings.from_config(b)  # every planner rule (a row rounded up to pad_to_multiple_of, ...)
    except ValueError as e:
        raise ConfigError(f"batching.{e}") from None
    if b.max_tokens_per_batch == "auto" and not strategy.sized_by_budget:
        raise ConfigError(
            f"batching.max_tokens_per_batch: auto sizes token_budget and packed batches; {b.strategy} batches hold "
            "batching.rows_per_batch rows: set a number, or use batching.strategy token_budget or packed"
        )


STRATEGY_KEYS = tuple(sorted({k for s in STRATEGIES.values() for k in s.reads}))  # read by some strategies, not all


def unread_keys(b, *, weighed: bool, base=None) -> list[str]:
    """The keys of ``b`` (a ``BatchingConfig``) that only some strategies read, set away from their defaults (or
    from ``base``'s values), that its strategy does not read (``Strategy.reads``; ``weighed``: a mixture's sources
    are weighted as random batches of ``rows_per_batch`` documents, which a budget-sized strategy then reads too)."""
    strategy = STRATEGIES[b.strategy]
    reads = set(strategy.reads) | ({"rows_per_batch"} if weighed and strategy.sized_by_budget else set())
    defaults = base or BatchingConfig()
    return [k for k in STRATEGY_KEYS if k not in reads and getattr(b, k) != getattr(defaults, k)]


def unread_notes(b, *, sources: int, source_balance: str, base=None) -> list[str]:
    """One note line for each key of the run that its batching strategy makes ignore (``unread_keys``; ``base``:
    whose values count as defaults, the demo's), and for ``train.source_balance`` set where nothing is
    reweighted (one source, or batches not sized by a budget)."""
    weighed = sources > 1 and source_balance == "batches"
    lines = []
    for key in unread_keys(b, weighed=weighed, base=base):
        readers = " or ".join(s.name for s in STRATEGIES.values() if key in s.reads)
        lines.append(
            f"batching.{key} ({getattr(b, key)!r}) has no effect: it applies under batching.strategy {readers}, "
            f"and batching.strategy is {b.strategy}: ignored"
        )
    if source_balance != "batches" and not (sources > 1 and STRATEGIES[b.strategy].sized_by_budget):
        budgeted = " or ".join(s.name for s in STRATEGIES.values() if s.sized_by_budget)
        lines.append(
            f"train.source_balance ({source_balance!r}) has no effect: it applies to 2 or more data.sources under "
            f"batching.strategy {budgeted}, and data.sources holds {sources}, batching.strategy is {b.strategy}: ignored"
        )
    return lines


def longest_row(settings, longest: int) -> tuple[int, str | None]:
    """(the longest row a plan of ``settings`` (a ``PlanSettings`` or ``BatchingConfig``) lays out for documents of
    at most ``longest`` tokens, before rounding; the setting that bounds it, None when the longest document
    does): packed rows are ``seq_len`` long, token_budget rows at most the budget (a longer document is split or
    cut), random and length_grouped rows the longest document."""
    return STRATEGIES[settings.strategy].longest_row(settings, longest)


def longest_train_row(b, longest_doc: int) -> tuple[int, str]:
    """``longest_row`` of ``b`` (a ``BatchingConfig``) with the key to lower when it is too long:
    ``batching.seq_len`` for packed rows, else ``data.max_seq_len`` (which bounds the documents)."""
    row, setting = longest_row(b, longest_doc)
    return row, "batching.seq_len" if setting == "seq_len" else "data.max_seq_len"


def truncation_cap(b) -> tuple[int, str] | None:
    """(the length past which ``long_docs: truncate`` cuts a document's tail, the key that sets it) for ``b``
    (a ``BatchingConfig``); None when nothing is cut (``split``, strategies whose rows hold whole documents,
    a budget still ``auto``)."""
    cut = STRATEGIES[b.strategy].truncation_cap(b)
    return None if cut is None else (cut[0], f"batching.{cut[1]}")


def loss_tokens_cut(store, cap: int) -> tuple[int, int]:
    """(loss tokens in the tails that truncation to ``cap`` tokens cuts, documents cut) of ``store``'s
    documents. A kept row of ``cap`` tokens keeps the targets of its tokens; the tail's targets are lost.
    The lengths and the tails' mask are read window by window (``store.windows``, ``read_ranges``)."""
    long_ids = np.concatenate(
        [a + np.flatnonzero(w > cap) for a, w in windows(store.lengths, 1 << 22)] or [np.zeros(0, np.int64)]
    )
    if not len(long_ids):
        return 0, 0
    first, n = store.doc_spans(long_ids)
    return int(read_ranges(store.loss_mask, first + cap, first + n).sum(dtype=np.int64)), len(long_ids)


def full_context_settings(settings: PlanSettings, longest: int) -> PlanSettings:
    """Plan settings for evaluation: rows long enough that no document is ever split or truncated.

    Evaluation must score every token with its whole document as context, whatever the training
    rows are; otherwise the eval loss depends on the batching strategy (a packed row of 96 tokens
    cuts a 300-token answer from its question). So a packed row is at least the longest document,
    and a token budget holds at least one longest document; every strategy then gives each token
    exactly the context it has alone, and the same loss (up to float summation order).
    """
    return STRATEGIES[settings.strategy].eval_settings(settings, longest)


def budget_range(b, lengths: np.ndarray) -> tuple[int, int, int]:
    """(unit, lowest, highest) budget worth trying for ``b`` (a ``BatchingConfig``) on ``lengths``: packed
    budgets hold whole rows, from one row to every token at once; token budgets from one longest document
    to all documents at once."""
    try:
        return STRATEGIES[b.strategy].budget_range(b, np.asarray(lengths, dtype=np.int64))
    except ValueError as e:
        raise ConfigError(f"batching.{e}") from None


def worst_batches(lengths: np.ndarray, settings: PlanSettings, seed: int) -> list[tuple[list, int]]:
    """(rows, the plan's index of the first row) of the batches that need the most memory at
    ``settings.max_tokens_per_batch`` (a row: its pieces ``(doc, start, stop)``): the plan's
    batch with the most slots and, for token budgets, ``budget // longest`` rows of the longest
    documents (``Strategy.worst_batches``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    plan = plan_epoch(lengths, settings=settings, seed=seed, epoch=0)
    return STRATEGIES[settings.strategy].worst_batches(plan, lengths, settings)
