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

from densebatch.data.plan.packing import ranges
from densebatch.data.plan.plan import Plan, join_plans, plan_stats  # noqa: F401 (re-exported)
from densebatch.data.plan.strategies import DEFAULT_STRATEGY, STRATEGIES


@dataclass(frozen=True)
class PlanSettings:
    """Planner knobs (the planning part of ``BatchingConfig``), so planners stay config-free."""

    strategy: str = DEFAULT_STRATEGY
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
        if self.max_tokens_per_batch < self.pad_to_multiple_of:
            raise ValueError(
                f"max_tokens_per_batch ({self.max_tokens_per_batch}) must be at least pad_to_multiple_of ({self.pad_to_multiple_of})"
            )
        STRATEGIES[self.strategy].check(self)

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
        np.random.SeedSequence([int(seed) % 2**63, int(epoch) % 2**63, STRATEGIES[settings.strategy].seed_tag])
    )
    plan = plan_documents(lengths, settings, rng)
    return plan if world_size == 1 else _shard(plan, rank, world_size)


def plan_documents(lengths: np.ndarray, settings: PlanSettings, rng: np.random.Generator) -> Plan:
    """One plan of ``lengths`` (int64, each >= 1, not checked here) drawing randomness from ``rng``."""
    return STRATEGIES[settings.strategy].plan(lengths, settings, rng)


# ------------------------------------------------------------------------------- ranks
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
