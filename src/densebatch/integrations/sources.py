"""Each source's weight of its loss tokens for a trainer's dataset (``dense_batches(source_column=...)``), as ``densebatch train`` weighs a mixture.

``source_factors(docs, strategy, seed, rows)`` gives ``data/plan/source_balance.py``'s factors
(``train.source_balance: batches``, ``run/build.py``'s ``source_weights``) over the trainer's documents laid
out source after source, as a prepared mixture's store holds them.
"""

from __future__ import annotations

import numpy as np

from densebatch.data.plan.rules import sized_by_budget
from densebatch.data.plan.source_balance import batch_balance
from densebatch.data.torch_loader import Documents


class _SourceView:
    """What ``batch_balance`` reads of a store, over ``Documents`` laid out source after source (as a
    prepared mixture's store holds them, each source's documents in dataset order)."""

    def __init__(self, docs: Documents) -> None:
        order = np.argsort(docs.sources, kind="stable")
        self.source_names = docs.source_names
        self.doc_loss_tokens = docs.doc_loss_tokens()[order]
        self._sources = docs.sources[order]

    def __len__(self) -> int:
        return len(self._sources)

    def sources_of(self, docs) -> np.ndarray:
        return self._sources[np.asarray(docs, np.int64)]


def source_factors(docs: Documents, strategy: str, seed: int, rows_per_batch: int = 8) -> list[float] | None:
    """Each source's weight of its loss tokens: ``batch_balance``'s factors for plans sized by a token budget
    (packed, token_budget), None for one source or for random / length_grouped batches (which weigh sources
    as random batches do). The same documents, source by source, seed and rows give the factors
    ``densebatch train`` uses."""
    if not sized_by_budget(strategy) or len(docs.source_names) < 2:
        return None
    factors = batch_balance(_SourceView(docs), weights=None, seed=seed, rows=rows_per_batch)
    return None if factors is None else [float(f) for f in factors]
