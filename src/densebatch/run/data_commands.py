"""``densebatch prepare`` and ``inspect``: the data layer only (no torch import), so a cache hit costs what
reading the cache entry costs, not the seconds torch takes to import."""

from __future__ import annotations

import sys

from densebatch.config import DataConfig, RunConfig
from densebatch.data.inspect import render_cleaning, render_documents
from densebatch.data.plan.store_epochs import epoch_shares
from densebatch.data.prepare.pipeline import Prepared, prepare
from densebatch.data.prepare.vocab import added_tokens_line
from densebatch.errors import UserError


def prepare_data(cfg: DataConfig, seed: int = 0) -> Prepared:
    """``prepare``, with each source's ``share`` in the summary: of epoch 0's tokens at ``seed`` under the configured
    weights (``store_epochs.epoch_shares``: what the plans select, which the prepare stage knows nothing of)."""
    prepared = prepare(cfg)
    shares = epoch_shares(prepared.train, prepared.weights, seed)
    for x, share in zip(prepared.summary.sources, shares.values()):
        x["share"] = share["share"]
    return prepared


def prepare_command(cfg: RunConfig, args) -> int:
    prepared = prepare_data(cfg.data, cfg.seed)
    print(prepared.summary)
    if (line := added_tokens_line(prepared.tokenizer.added)) is not None:
        print(line)
    print(f"documents: {prepared.cache_dir}")
    return 0


def inspect_command(cfg: RunConfig, args) -> int:
    """Prepared documents decoded, loss tokens marked; then, with cleaning on, records before and after it."""
    prepared = prepare_data(cfg.data)
    store = prepared.train if args.split == "train" else prepared.eval
    if store is None:
        raise UserError("there is no eval split: set data.eval_path or data.eval_fraction > 0")
    if not 0 <= args.start < len(store):
        raise UserError(f"--start {args.start}: the {args.split} split holds documents 0 to {len(store) - 1}")
    stop = min(len(store), args.start + max(0, args.num))
    print(render_documents(store, prepared.tokenizer, range(args.start, stop), color=sys.stdout.isatty()), end="")
    print(render_cleaning(cfg.data, max(1, args.num)), end="")
    return 0
