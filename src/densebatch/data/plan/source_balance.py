"""How much each source of a mixture weighs in the gradient: ``train.source_balance``.

Random padded batches trained one batch a step, the loss averaged over that batch's own loss tokens
(Hugging Face's Trainer, and densebatch's ``random`` strategy with one batch a step), weigh a loss
token by 1 / (its batch's loss tokens): a batch of short documents weighs each of its tokens more, so a
source of short answers gets more of the average step's gradient than its share of the loss tokens.
Dense plans hold about as many loss tokens in every step, so they weigh every loss token alike, and a
mixture trained on them learns its shortest source more slowly than on random batches at the same
tokens (docs/benchmarks.md, "Time to quality").

``batch_balance`` measures that weighting on the run's own data and returns one factor per source: the
mean share of a random batch's loss tokens that the source holds, over its share of all loss tokens.
Weighting each source's loss tokens by its factor (``train/per_source.py``) gives every source,
in token-exact steps of any plan, the share of the gradient random batches of ``rows`` documents give
it. A single source's factor is 1 (nothing changes).

The batches are drawn from the seed (``SAMPLE_BATCHES`` batches of ``rows`` documents, uniform over
the epoch's documents, a weighted mixture's selection included), so the factors depend on the data,
the weights, the seed and ``rows`` only: not on the strategy, the batch layout or the ranks.
"""

from __future__ import annotations

import numpy as np

from densebatch.data.plan.store_epochs import select
from densebatch.data.store.store_io import take

SAMPLE_BATCHES = 20_000  # ~0.5% sampling error on a source with 3% of the loss tokens
_TAG = 0x42414C  # keeps this draw apart from the planner's streams of the same seed


def batch_balance(
    store, *, weights, seed: int, rows: int, batches: int = SAMPLE_BATCHES, counts=None, selection=None
) -> np.ndarray | None:
    """Per-source loss-token factors (float64, one per source) of random batches of ``rows`` documents
    over epoch 0's documents of ``store`` mixed by ``weights`` (None: natural shares); None for a
    store of one source. A source without loss tokens gets 1. ``counts``: loss tokens per document
    (default ``store.doc_loss_tokens``, the causal targets; masked-LM targets are a share of every
    token, so pass ``store.lengths``). ``selection``: epoch 0's ``Selection``, when the caller already drew it."""
    k = len(store.source_names)
    if k < 2 or len(store) == 0:
        return None
    rng = np.random.default_rng([seed, _TAG])
    if weights is None:
        docs = rng.integers(0, len(store), size=batches * rows)
    else:
        selection = selection if selection is not None else select(store, weights=weights, seed=seed, epoch=0)
        docs = selection.docs(rng.integers(0, selection.num_docs, size=batches * rows))
    loss = take(store.doc_loss_tokens if counts is None else counts, docs).astype(np.float64)
    cell = np.repeat(np.arange(batches, dtype=np.int64), rows) * k + store.sources_of(docs)  # (batch, source)
    per = np.bincount(cell, weights=loss, minlength=batches * k).reshape(batches, k)
    total = per.sum(axis=1)
    kept = per[total > 0] / total[total > 0, None]  # each batch's shares of its own loss tokens
    natural = per.sum(axis=0) / max(per.sum(), 1.0)
    if not len(kept):
        return np.ones(k)
    mean = kept.mean(axis=0)
    return np.where(natural > 0, mean / np.where(natural > 0, natural, 1.0), 1.0)


def balance_line(names, factors) -> str:
    """One line: each source's factor."""
    return ", ".join(f"{n} {f:.2f}" for n, f in zip(names, factors))
