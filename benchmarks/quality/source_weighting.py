"""How much of the gradient each source of a mixture gets under each batching plan, against its share of
the loss tokens.

    .venv/bin/python -m benchmarks.quality.source_weighting [--strategies random,packed] [--seed 0]

One batch a step with the loss averaged over that batch's own loss tokens (what random padded batches
do in the time-to-quality mixture, and what Hugging Face's Trainer does) weighs a loss token by
1 / (its batch's loss tokens): a batch of short documents weighs each of its tokens more. Dense plans
hold about as many tokens in every batch, so they weigh every loss token alike. Printed per strategy,
over epoch 0's plan of the mixture of ``time_to_quality --set mixture`` (its packed setup's rows of
1,408, two a batch; random's 8 rows): the natural share of each source's loss tokens, its mean share of
a batch's loss tokens (its weight in the average step's gradient) and their ratio. The ``*-w`` setups'
``RANDOM_LIKE_WEIGHTS`` come from the random row.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from benchmarks.common import require_shared_data
from benchmarks.quality.time_to_quality import MIXTURE_SETUPS, mixture_args
from densebatch.config import load_config
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.shards import plan_epoch_sharded
from densebatch.data.plan.store_epochs import select
from densebatch.data.prepare.pipeline import prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="random,packed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args()
    args = mixture_args(require_shared_data(a.data_dir)) + MIXTURE_SETUPS["packed-2816"]
    cfg = load_config(None, [*args, f"--seed={a.seed}"])
    prepared = prepare(cfg.data)
    store = prepared.train
    lengths = np.asarray(store.lengths, dtype=np.int64)
    selection = select(store, weights=prepared.weights, seed=cfg.seed, epoch=0, lengths=lengths)
    source = selection.source_of(np.arange(len(lengths)))
    loss = np.asarray(store.doc_loss_tokens, dtype=np.float64)
    k = len(store.source_names)
    natural = np.bincount(source, weights=loss, minlength=k) / loss.sum()
    print("sources:", ", ".join(store.source_names))
    print(f"natural share of the loss tokens: {np.round(natural, 4).tolist()}")
    for name in a.strategies.split(","):
        settings = dataclasses.replace(PlanSettings.from_config(cfg.batching), strategy=name)
        plan = plan_epoch_sharded(lengths, settings=settings, seed=cfg.seed, epoch=0, selection=selection)
        shares = []
        for batch in plan.doc_lists():
            docs = np.array([d for row in batch for d in row], dtype=np.int64)
            got = np.bincount(source[docs], weights=loss[docs], minlength=k)
            if got.sum() > 0:
                shares.append(got / got.sum())
        mean = np.mean(shares, axis=0)
        print(
            f"{name}: mean share of a batch's loss tokens {np.round(mean, 4).tolist()}, ratio {np.round(mean / natural, 3).tolist()}"
        )


if __name__ == "__main__":
    main()
