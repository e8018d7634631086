"""The lines a training run reports before its first step: what the configuration makes of these documents.

Each line comes from the run's plan, documents and source weights (None when it has nothing to say):
the homogeneity warning (``data/plan/homogeneity.py``), the batches a loss-token step takes on average,
the share of the eval split ``eval.max_tokens`` keeps, the sources' weights (``train.source_balance``), and
when preference pairs are laid with their prompt twice, why (``run/preference.py``).
``report_lines`` gives them in that order; ``run/training.py`` prints them once, on rank 0.
"""

from __future__ import annotations

import numpy as np

from densebatch.config import RunConfig
from densebatch.data.load.loader import StepLoader
from densebatch.data.plan.homogeneity import homogeneity
from densebatch.data.plan.homogeneity import warning as homogeneity_warning_line
from densebatch.data.plan.source_balance import balance_line
from densebatch.data.plan.store_epochs import eval_documents
from densebatch.data.prepare.pipeline import Prepared
from densebatch.data.store.store import DocumentStore
from densebatch.run.preference import is_pairs, prompt_layout


def report_lines(cfg: RunConfig, prepared: Prepared, loader: StepLoader, weights: list[float] | None) -> list[str]:
    """The run's report, line by line, in the order it is printed."""
    lines = [
        homogeneity_warning(cfg, prepared, loader),
        step_size_line(loader),
        eval_cap_line(cfg, prepared.eval) if prepared.eval is not None else None,
        source_weights_line(prepared, weights, cfg.batching.rows_per_batch),
        prompt_layout(cfg)[1] if is_pairs(prepared.train) else None,  # prompts laid twice: said once
    ]
    return [line for line in lines if line is not None]


def eval_cap_line(cfg: RunConfig, store: DocumentStore) -> str | None:
    """The line a run prints when ``eval.max_tokens`` leaves part of the eval split out (None: it scores all)."""
    docs = eval_documents(store.lengths, cfg.eval.max_tokens, cfg.seed)
    if docs is None:
        return None
    kept = int(np.asarray(store.lengths)[docs].sum())
    return (
        f"eval.max_tokens {cfg.eval.max_tokens:,}: every evaluation scores the same {len(docs):,} of {len(store):,} "
        f"held-out documents ({kept:,} of {store.num_tokens:,} tokens, chosen by the seed)"
    )


def source_weights_line(prepared: Prepared, weights: list[float] | None, rows: int) -> str | None:
    if weights is None:
        return None
    return (
        f"train.source_balance batches: loss tokens weighted by source as random batches of {rows} documents weigh "
        f"them: {balance_line(prepared.train.source_names, weights)}"
    )


def homogeneity_warning(cfg: RunConfig, prepared: Prepared, loader: StepLoader) -> str | None:
    """The one warning a run gives when its batches are far more alike, in length or source, than random
    ones (``data/plan/homogeneity.py``), measured on epoch 0's plan (its first shard when sharded)."""
    store = prepared.train
    source_of = store.sources_of if store.sources_of([]) is not None else None  # plans hold store document ids
    h = homogeneity(
        loader.plan(0), lengths=loader.lengths, source_of=source_of, num_sources=len(store.source_names), max_shards=1
    )
    return homogeneity_warning_line(h, cfg.batching.strategy, cfg.batching.bundle_tokens)


def step_size_line(loader: StepLoader) -> str | None:
    """What ``train.loss_tokens_per_step`` makes of a step on this plan: batches a step on average (the
    step is chosen in loss tokens, the batch by memory, so the batching flags alone do not say it)."""
    target = loader.loss_tokens_per_step
    if not target:
        return None
    steps, batches = loader.steps_per_epoch(), loader.batches_per_epoch
    return (
        f"train.loss_tokens_per_step {target}: {batches / max(1, steps):.1f} batches a step on average "
        f"({steps} steps an epoch of {batches} batches)"
    )
