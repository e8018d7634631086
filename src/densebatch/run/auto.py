"""``auto`` values, resolved in one place: the token budget and the learning rate a run (or a finder) uses.

- ``batching.max_tokens_per_batch: auto`` is resolved right after the model is built and moved to
  its device, before DDP wrapping, or under FSDP once it is sharded, through the sharded module, so
  that the probes measure what a rank holds (``resolve_budget``: ``train/finders/budget_finder.py``,
  with the worst batches of the run's own plan at each probed budget).
- ``train.lr: auto`` is resolved once the trainer exists (``resolve_lr``: ``train/finders/lr_finder.py``
  on the trainer's own model, optimizer and data, which it leaves as they were). The trainer is
  built with ``lr: auto`` and takes the rate found (``Trainer.set_lr``); it refuses to train before.

Both values are written into the run's configuration (``output_dir/config.yaml`` and every
checkpoint), so a resumed run reuses them: ``keep_resolved`` maps a requested ``auto`` onto the
saved number before the resume rules compare configurations; ``resolved_budget`` gives the commands
that only plan (analyze, eval) the budget a run found.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from densebatch.config import RunConfig, config_from_dict
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.rules import budget_range, worst_batches
from densebatch.data.prepare.pipeline import Prepared
from densebatch.errors import ConfigError
from densebatch.run.build import collation
from densebatch.train.distributed import Distributed
from densebatch.train.finders.budget_finder import BudgetResult, find_budget
from densebatch.train.finders.lr_finder import lr_range_test, write_outputs
from densebatch.train.loop import Trainer
from densebatch.train.optim import build_optimizer


def say(dist: Distributed, text: str) -> None:
    """Print on rank 0 only."""
    if dist.is_main:
        print(text, flush=True)


# ------------------------------------------------------------------------------------- budget
def budget_search(cfg: RunConfig, prepared: Prepared):
    """(worst, snap, low, high) for ``find_budget``: the worst batches of the run's plan at a budget
    (``rules.worst_batches``, collated), the rounding of a budget to a valid one, and the range searched."""
    b = cfg.batching
    store = prepared.train
    collator, laid = collation(cfg, store)  # preference pairs: their collator and the lengths as laid
    lengths = np.asarray(store.lengths if laid is None else laid, dtype=np.int64)
    unit, low, high = budget_range(b, lengths)

    def snap(budget: int) -> int:
        return int(min(high, max(low, budget // unit * unit)))

    def worst(budget: int) -> list:
        settings = PlanSettings.from_config(b, max_tokens_per_batch=budget)
        return [collator(store, rows, step=(0, first)) for rows, first in worst_batches(lengths, settings, cfg.seed)]

    return worst, snap, low, high


def fit_budget(cfg: RunConfig, *, model, prepared: Prepared, dist: Distributed, forward=None) -> BudgetResult:
    """Run the budget finder on ``model`` (on its device) with a throw-away optimizer; ``forward``: the
    sharded module training goes through (FSDP), so the probes measure the sharded step."""
    worst, snap, low, high = budget_search(cfg, prepared)
    optimizer = build_optimizer(model, replace(cfg.train, lr=0.0))
    t, f = cfg.train, cfg.finder
    say(dist, "finding the token budget (batching.max_tokens_per_batch: auto):")
    result = find_budget(
        model, optimizer=optimizer, worst=worst, snap=snap, low=low, high=high, limit_gb=t.memory_limit_gb, margin=f.memory_reserve, precision=t.precision,
        dist=dist, max_probes=f.max_probes, throughput_share=f.throughput_share, log=(lambda s: say(dist, s)), forward=forward,
    )  # fmt: skip
    del optimizer  # its state went back to empty; the trainer builds its own
    return result


def resolve_budget(cfg: RunConfig, *, model, prepared: Prepared, dist: Distributed, forward=None) -> RunConfig:
    """``cfg`` with ``batching.max_tokens_per_batch: auto`` replaced by the budget found (printed); under
    FSDP, found on the sharded model through ``forward``."""
    if cfg.batching.max_tokens_per_batch != "auto":
        return cfg
    result = fit_budget(cfg, model=model, prepared=prepared, dist=dist, forward=forward)
    say(dist, result.report())
    say(dist, f"batching.max_tokens_per_batch: auto → {result.budget} (written to {Path(cfg.output_dir) / 'config.yaml'})")
    return replace(cfg, batching=replace(cfg.batching, max_tokens_per_batch=result.budget))


# ---------------------------------------------------------------------------------------- lr
def resolve_lr(cfg: RunConfig, trainer: Trainer, dist: Distributed) -> RunConfig:
    """``cfg`` with ``train.lr: auto`` replaced by the range test's suggestion (the trainer takes it too)."""
    if cfg.train.lr != "auto":
        return cfg
    say(dist, "running the learning-rate range test (train.lr: auto):")
    result = lr_range_test(trainer, cfg.finder, log=(lambda s: say(dist, s)))
    if dist.is_main:
        write_outputs(result, cfg.output_dir)
    say(dist, f"train.lr: auto → {result.suggested_lr:.4g} (curve: {Path(cfg.output_dir) / 'lr_finder.png'})")
    cfg = replace(cfg, train=replace(cfg.train, lr=result.suggested_lr))
    trainer.set_lr(result.suggested_lr)
    return cfg


def keep_resolved(requested: RunConfig, saved: dict) -> RunConfig:
    """A resume asked for ``auto`` where the saved run holds the number it resolved: keep the number."""
    t, b = requested.train, requested.batching
    if t.lr == "auto" and saved.get("train", {}).get("lr") not in (None, "auto"):
        t = replace(t, lr=float(saved["train"]["lr"]))
    if b.max_tokens_per_batch == "auto" and saved.get("batching", {}).get("max_tokens_per_batch") not in (None, "auto"):
        b = replace(b, max_tokens_per_batch=int(saved["batching"]["max_tokens_per_batch"]))
    return replace(requested, train=t, batching=b)


def resolved_budget(cfg: RunConfig) -> RunConfig:
    """For commands that only plan (analyze, eval): ``auto`` becomes the budget a run in ``output_dir`` found."""
    if cfg.batching.max_tokens_per_batch != "auto":
        return cfg
    saved = Path(cfg.output_dir) / "config.yaml"
    if saved.is_file():
        budget = config_from_dict(yaml.safe_load(saved.read_text(encoding="utf-8")), saved=True).batching.max_tokens_per_batch
        if budget != "auto":
            return replace(cfg, batching=replace(cfg.batching, max_tokens_per_batch=budget))
    raise ConfigError(
        f"batching.max_tokens_per_batch: auto is found by densebatch train or find-batch and written to {saved}; "
        "run one of them first, or give a number"
    )
