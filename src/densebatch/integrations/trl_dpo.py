"""TRL's ``DPOTrainer`` on densebatch's plans: pairs planned as units by a token budget, TRL's collator and loss kept.

    trainer = DPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
    densebatch.dense_batches(trainer, max_tokens_per_batch=16384)   # token_budget batches of whole pairs
    trainer.train()

TRL's loss reads a batch as TRL's ``DataCollatorForPreference`` lays it: one padded row per answer (prompt +
chosen, then prompt + rejected), a pair's two rows as wide as the batch's widest. So what densebatch can give
it is the plan: ``dense_batches`` replaces the trainer's training ``DataLoader`` by one whose batches are
densebatch's plan of the pairs (``token_budget`` by default: sorted by width, as many pairs a batch as fit
``max_tokens_per_batch`` slots of padded rows, two a pair, batches in random order; ``length_grouped`` or
``random`` with ``rows_per_batch`` pairs), each pair whole, this process's share of each step
(``args.process_index`` of ``args.world_size``), seeded by ``args.seed``, epoch by epoch. The batches go through
the trainer's own collator and loss, unchanged. Packing pairs, with each prompt laid once, needs densebatch's
own loss: ``densebatch train`` with ``train.objective: dpo`` (docs/preference.md).

Refused in one line naming what is missing: a dataset that is not tokenised into ``prompt_ids`` /
``chosen_ids`` / ``rejected_ids`` (TRL prepares vision datasets on the fly), an ``IterableDataset`` (no lengths
to plan), a collator other than TRL's (the rows TRL's loss reads), ``packed`` rows, and the trainer's own
``group_by_length``.
"""

from __future__ import annotations

import numpy as np

from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.strategies import STRATEGIES, TokenBudget
from densebatch.data.torch_sampler import DenseBatchSampler

COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def is_dpo_trainer(trainer) -> bool:
    """True for TRL's ``DPOTrainer`` (or a subclass), without importing TRL when it is absent."""
    return any(c.__name__ == "DPOTrainer" and c.__module__.startswith("trl.") for c in type(trainer).__mro__)


class PairBatches:
    """A batch sampler of pair indices: this rank's pairs of each planned batch (``DenseBatchSampler`` over the
    pairs' widths, one pair a row), epoch by epoch (``set_epoch``)."""

    def __init__(self, sampler: DenseBatchSampler):
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for pieces in self.sampler:
            yield [p.doc for p in pieces]

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def pair_widths(dataset) -> np.ndarray:
    """Each pair's padded row width in TRL's layout: its prompt and longer answer."""
    p, c, r = (np.array([len(x) for x in dataset[k]], np.int64) for k in COLUMNS)
    return p + np.maximum(c, r)


def dense_dpo_batches(trainer, strategy: str = TokenBudget.name, max_tokens_per_batch: int = 8192, **settings):
    """``dense_batches`` for a ``DPOTrainer`` (the module docstring); returns the trainer."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    args, ds = trainer.args, trainer.train_dataset
    if getattr(args, "train_sampling_strategy", None) == "group_by_length" or getattr(args, "group_by_length", False) is True:
        raise ValueError("dense_batches: the trainer's group_by_length would be ignored (densebatch plans the batches): drop it")
    if ds is None or not hasattr(ds, "column_names") or not hasattr(ds, "__len__"):
        raise ValueError(
            "dense_batches: DPOTrainer: the train_dataset has no lengths to plan (an IterableDataset, or none): give a "
            "datasets.Dataset"
        )
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise ValueError(
            f"dense_batches: DPOTrainer: the train_dataset has no {', '.join(missing)} (TRL tokenises text pairs when it is "
            "built; a vision dataset is prepared on the fly): give text pairs (prompt, chosen, rejected)"
        )
    if not isinstance(trainer.data_collator, DataCollatorForPreference):
        raise ValueError(
            f"dense_batches: DPOTrainer: the data collator is {type(trainer.data_collator).__name__}, not TRL's "
            "DataCollatorForPreference, whose rows TRL's loss reads: leave data_collator unset"
        )
    widths = pair_widths(ds)
    budget = max_tokens_per_batch // 2  # two padded rows a pair: the plan counts a pair's width once
    try:
        PlanSettings(strategy=strategy, max_tokens_per_batch=budget, seq_len=budget)
    except ValueError as e:
        raise ValueError(f"dense_batches: {e}") from None
    if STRATEGIES[strategy].sized_by_budget and int(widths.max()) > budget:
        raise ValueError(
            f"dense_batches: DPOTrainer: a pair's two rows take up to 2 x {int(widths.max())} slots: pass "
            f"max_tokens_per_batch={2 * int(widths.max())} or more (pairs are never split)"
        )
    settings.setdefault("bundle_tokens", 0)  # one pair a row: TRL pads each answer's row on its own
    probe = DenseBatchSampler(widths, strategy=strategy, max_tokens_per_batch=budget, seq_len=budget, seed=args.seed, rank=0, world_size=1, **settings)  # fmt: skip
    plan = probe.plan(0)
    if hasattr(plan, "row_ptr") and int(np.diff(plan.row_ptr).max(initial=1)) > 1:
        raise ValueError(
            f"dense_batches: DPOTrainer: strategy {strategy!r} packs several pairs into a row, which needs densebatch's own "
            "loss (TRL's reads one padded row per answer): use token_budget, or densebatch train with train.objective: dpo"
        )

    def get_train_dataloader():
        import torch

        sampler = DenseBatchSampler(
            widths, strategy=strategy, max_tokens_per_batch=budget, seq_len=budget, seed=args.seed,
            rank=args.process_index, world_size=args.world_size, **settings,
        )  # fmt: skip
        return torch.utils.data.DataLoader(
            trainer.train_dataset, batch_sampler=PairBatches(sampler), collate_fn=trainer.data_collator,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
        )  # fmt: skip

    trainer.get_train_dataloader = get_train_dataloader
    trainer.densebatch_loss = "TRL's own DPO loss (densebatch plans the pairs)"
    return trainer
