"""What each strategy implies beyond its planner: the longest row, the budgets it can take, the worst
batch at a budget, full-context evaluation and the checks on its settings.

Every rule that depends on the strategy lives here or in ``planner``; the wiring (``run/``), the
loader and the finders ask these functions instead of comparing strategy names themselves.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.steps import rows_of
from densebatch.data.prepare.store import read_ranges, windows
from densebatch.errors import ConfigError

BUDGETED = ("token_budget", "packed")  # sized by max_tokens_per_batch (the others by rows_per_batch)


def _up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def sized_by_budget(strategy: str) -> bool:
    """Whether ``strategy``'s batches are sized by ``max_tokens_per_batch`` (the budget finder's strategies)."""
    return strategy in BUDGETED


def check_batching(b) -> None:
    """``ConfigError`` naming the key when a ``BatchingConfig``'s numbers cannot work for its strategy
    (``max_tokens_per_batch`` may still be ``auto``)."""
    if b.strategy == "packed" and b.bundle_tokens != "auto" and b.bundle_tokens > b.seq_len // 2:
        raise ConfigError(
            f"batching.bundle_tokens: packed: expected 0 (off) up to half of batching.seq_len ({b.seq_len // 2}) so two bundles "
            f"share a row; got {b.bundle_tokens}"
        )
    if b.max_tokens_per_batch == "auto":
        if not sized_by_budget(b.strategy):
            raise ConfigError(
                f"batching.max_tokens_per_batch: auto sizes token_budget and packed batches; {b.strategy} batches hold "
                "batching.rows_per_batch rows: set a number, or use batching.strategy token_budget or packed"
            )
        return
    if b.strategy == "packed" and b.seq_len > b.max_tokens_per_batch:
        raise ConfigError(
            f"batching.max_tokens_per_batch: expected at least batching.seq_len ({b.seq_len}) so one packed row fits; got {b.max_tokens_per_batch}"
        )
    try:
        PlanSettings.from_config(b)
    except ValueError as e:  # the planner's own rules (a row rounded up to pad_to_multiple_of, ...)
        raise ConfigError(f"batching.{e}") from None


def longest_train_row(b, longest_doc: int) -> tuple[int, str]:
    """(the longest row a training batch of ``b`` (a ``BatchingConfig``) can hold before rounding, the key that
    sets it). Packed rows are ``seq_len``; token-budget rows that split long documents stop at the budget
    (``auto``: not known yet, so the longest document); other rows hold a whole document (``data.max_seq_len``
    bounds it)."""
    if b.strategy == "packed":
        return b.seq_len, "batching.seq_len"
    if b.strategy == "token_budget" and b.long_docs == "split" and b.max_tokens_per_batch != "auto":
        return min(int(longest_doc), int(b.max_tokens_per_batch)), "data.max_seq_len"
    return int(longest_doc), "data.max_seq_len"


def truncation_cap(b) -> tuple[int, str] | None:
    """(the length past which ``long_docs: truncate`` cuts a document's tail, the key that sets it) for ``b``
    (a ``BatchingConfig``); None when nothing is cut (``split``, strategies whose rows hold whole documents,
    a budget still ``auto``)."""
    if b.long_docs != "truncate":
        return None
    if b.strategy == "packed":
        return int(b.seq_len), "batching.seq_len"
    if b.strategy == "token_budget" and b.max_tokens_per_batch != "auto":
        m = b.pad_to_multiple_of
        return int(b.max_tokens_per_batch) // m * m, "batching.max_tokens_per_batch"
    return None


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
    m = settings.pad_to_multiple_of
    row = _up(max(settings.seq_len, int(longest)), m)
    packed = settings.strategy == "packed"
    budget = max(settings.max_tokens_per_batch, row if packed else _up(longest, m))
    return replace(settings, seq_len=row if packed else settings.seq_len, max_tokens_per_batch=budget)


def budget_range(b, lengths: np.ndarray) -> tuple[int, int, int]:
    """(unit, lowest, highest) budget worth trying for ``b`` (a ``BatchingConfig``) on ``lengths``: packed
    budgets hold whole rows, from one row to every token at once; token budgets from one longest document
    to all documents at once."""
    m = b.pad_to_multiple_of
    lengths = np.asarray(lengths, dtype=np.int64)
    if b.strategy == "packed":
        unit = _up(b.seq_len, m)
        return unit, unit, unit * (int(lengths.sum()) // unit + len(lengths) // 8 + 2)
    if b.strategy == "token_budget":
        longest = _up(lengths.max(), m)
        return m, longest, longest * len(lengths)
    raise ConfigError(f"batching.strategy: a token budget sizes token_budget and packed batches, not {b.strategy}")


def worst_batches(lengths: np.ndarray, settings: PlanSettings, seed: int) -> list[tuple[list, int]]:
    """(rows, the plan's index of the first row) of the batches that need the most memory at
    ``settings.max_tokens_per_batch`` (a row: its pieces ``(doc, start, stop)``): the plan's
    batch with the most slots and, for token budgets, ``budget // longest`` rows of the longest
    documents. Which long documents meet in one batch changes with the budget and the epoch; the
    second bound holds for every epoch."""
    lengths = np.asarray(lengths, dtype=np.int64)
    plan = plan_epoch(lengths, settings, seed, 0)
    _, slots = plan.batch_stats()
    i = int(np.argmax(slots))
    rows = np.arange(plan.batch_ptr[i], plan.batch_ptr[i + 1], dtype=np.int64)
    out = [(rows_of(plan, rows), int(rows[0]))]
    if settings.strategy == "token_budget":
        order = np.argsort(-lengths, kind="stable")  # documents, longest first
        n = max(1, settings.max_tokens_per_batch // _up(lengths.max(), settings.pad_to_multiple_of))
        out.append(([[(int(d), 0, int(lengths[d]))] for d in order[:n]], 0))
    return out


def longest_row(settings, longest: int) -> tuple[int, str | None]:
    """(the longest row a plan of ``settings`` lays out for documents of at most ``longest`` tokens, the setting
    that bounds it): packed rows are ``seq_len`` long, token_budget rows at most the budget (a longer document
    is split or cut), random and length_grouped rows the longest document (None: no setting bounds them)."""
    if settings.strategy == "packed":
        return int(settings.seq_len), "seq_len"
    if settings.strategy == "token_budget":
        return min(int(longest), int(settings.max_tokens_per_batch)), "max_tokens_per_batch"
    return int(longest), None
