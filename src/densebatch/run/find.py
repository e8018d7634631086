"""The finders' wiring: the find-lr and find-batch commands, and a training run's ``auto`` values.

- ``batching.max_tokens_per_batch: auto`` is resolved right after the model is built and moved to
  its device, before any DDP / FSDP wrapping (``resolve_budget``: ``train/budget_finder.py``, with the
  worst batches of the run's own plan at each probed budget).
- ``train.lr: auto`` is resolved once the trainer exists (``resolve_lr``: ``train/lr_finder.py`` on
  the trainer's own model, optimizer and data, which it leaves as they were). The trainer is built
  with ``finder.lr_start`` as a placeholder rate until then.

Both values are written into the run's configuration (``output_dir/config.yaml`` and every
checkpoint), so a resumed run reuses them: ``keep_resolved`` maps a requested ``auto`` onto the
saved number before the resume rules compare configurations.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from densebatch.atomic import write_file
from densebatch.config import RunConfig, TrainConfig, config_from_dict
from densebatch.data.collate import collator_from_config
from densebatch.data.plan import PlanSettings, plan_epoch
from densebatch.data.prepare import Prepared, prepare
from densebatch.data.steps import rows_of
from densebatch.errors import ConfigError
from densebatch.train.budget_finder import BudgetResult, find_budget
from densebatch.train.distributed import Distributed, wrap_model
from densebatch.train.loop import Trainer, resolve_device
from densebatch.train.lr_finder import lr_range_test, write_outputs
from densebatch.train.optim import build_optimizer

BUDGET_JSON = "batch_finder.json"


def _say(dist: Distributed, text: str) -> None:
    if dist.is_main:
        print(text, flush=True)


# ------------------------------------------------------------------------------------- budget
def budget_search(cfg: RunConfig, prepared: Prepared):
    """(worst, snap, low, high) for ``find_budget``: the worst batches of the run's plan at a budget,
    the rounding of a budget to a valid one, and the range searched."""
    b = cfg.batching
    store = prepared.train
    lengths = np.asarray(store.lengths, dtype=np.int64)
    m = b.pad_to_multiple_of
    up = lambda n: -(-int(n) // m) * m  # noqa: E731
    if b.strategy == "packed":
        unit = up(b.seq_len)  # a budget holds whole rows
        low, high = unit, unit * (int(lengths.sum()) // unit + len(lengths) // 8 + 2)
    else:
        unit = m
        low, high = up(lengths.max()), up(lengths.max()) * len(lengths)  # one longest document; everything at once
    collator = collator_from_config(b, store.meta, cfg.seed)

    def snap(budget: int) -> int:
        return int(min(high, max(low, budget // unit * unit)))

    order = np.argsort(-lengths, kind="stable")  # documents, longest first

    def worst(budget: int) -> list:
        """The plan's batch with the most slots and, for token budgets, the longest rows that fit:
        ``budget // longest`` rows of the longest documents. Which long documents meet in one batch
        changes with the budget and the epoch; this bound holds for every epoch."""
        plan = plan_epoch(lengths, PlanSettings.from_config(b, max_tokens_per_batch=budget), cfg.seed, 0)
        _, slots = plan.batch_stats()
        i = int(np.argmax(slots))
        rows = np.arange(plan.batch_ptr[i], plan.batch_ptr[i + 1], dtype=np.int64)
        out = [collator(store, rows_of(plan, rows), step=(0, int(rows[0])))]
        if b.strategy == "token_budget":
            longest = [[(int(d), 0, int(lengths[d]))] for d in order[: max(1, budget // up(lengths.max()))]]
            out.append(collator(store, longest, step=(0, 0)))
        return out

    return worst, snap, low, high


def fit_budget(cfg: RunConfig, model, prepared: Prepared, dist: Distributed) -> BudgetResult:
    """Run the budget finder on ``model`` (already on its device, not wrapped) with a throw-away optimizer."""
    worst, snap, low, high = budget_search(cfg, prepared)
    optimizer = build_optimizer(model, replace(cfg.train, lr=0.0))
    t, f = cfg.train, cfg.finder
    _say(dist, "finding the token budget (batching.max_tokens_per_batch: auto):")
    result = find_budget(
        model, optimizer, worst, snap, low, high, limit_gb=t.memory_limit_gb, margin=t.memory_margin, precision=t.precision,
        dist=dist, max_probes=f.max_probes, throughput_share=f.throughput_share, log=(lambda s: _say(dist, s)),
    )  # fmt: skip
    del optimizer  # its state went back to empty; the trainer builds its own
    return result


def resolve_budget(cfg: RunConfig, model, prepared: Prepared, dist: Distributed) -> RunConfig:
    """``cfg`` with ``batching.max_tokens_per_batch: auto`` replaced by the budget found (printed)."""
    if cfg.batching.max_tokens_per_batch != "auto":
        return cfg
    result = fit_budget(cfg, model, prepared, dist)
    _say(dist, result.report())
    _say(dist, f"batching.max_tokens_per_batch: auto → {result.budget} (written to {Path(cfg.output_dir) / 'config.yaml'})")
    return replace(cfg, batching=replace(cfg.batching, max_tokens_per_batch=result.budget))


# ---------------------------------------------------------------------------------------- lr
def trainer_config(cfg: RunConfig) -> TrainConfig:
    """``cfg.train`` with a number for ``lr`` (a placeholder while it is ``auto``: the range test sets every rate)."""
    return replace(cfg.train, lr=cfg.finder.lr_start) if cfg.train.lr == "auto" else cfg.train


def resolve_lr(cfg: RunConfig, trainer: Trainer, dist: Distributed) -> RunConfig:
    """``cfg`` with ``train.lr: auto`` replaced by the range test's suggestion (the trainer takes it too)."""
    if cfg.train.lr != "auto":
        return cfg
    _say(dist, "running the learning-rate range test (train.lr: auto):")
    result = lr_range_test(trainer, cfg.finder, log=(lambda s: _say(dist, s)))
    if dist.is_main:
        write_outputs(result, cfg.output_dir)
    _say(dist, f"train.lr: auto → {result.suggested_lr:.4g} (curve: {Path(cfg.output_dir) / 'lr_finder.png'})")
    cfg = replace(cfg, train=replace(cfg.train, lr=result.suggested_lr))
    trainer.cfg = cfg.train
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
        budget = config_from_dict(yaml.safe_load(saved.read_text(encoding="utf-8"))).batching.max_tokens_per_batch
        if budget != "auto":
            return replace(cfg, batching=replace(cfg.batching, max_tokens_per_batch=budget))
    raise ConfigError(
        f"batching.max_tokens_per_batch: auto is found by densebatch train or find-batch and written to {saved}; "
        "run one of them first, or give a number"
    )


# ---------------------------------------------------------------------------------- commands
def _setup(path: str | None, overrides: list[str]):
    """(config, prepared documents, model on its device, device, dist) as ``densebatch train`` builds them."""
    from densebatch.model import build_model
    from densebatch.run import resolve_config
    from densebatch.run.training import check_context, seed_everything

    cfg = resolve_config(path, overrides)
    dist = Distributed.from_environment(cfg.train.device)
    if dist.is_main:
        prepared = prepare(cfg.data, cfg.seed)
        print(prepared.summary, flush=True)
    dist.barrier()
    if not dist.is_main:
        prepared = prepare(cfg.data, cfg.seed)
    seed_everything(cfg.seed)  # the run's initial weights
    model = build_model(cfg.model, prepared.tokenizer.vocab_size)
    check_context(model, cfg, prepared)
    device = dist.device if dist.enabled else resolve_device(cfg.train.device)
    return cfg, prepared, model.to(device), device, dist


def find_lr_command(path: str | None, overrides: list[str]) -> int:
    from densebatch.run.training import build_loaders

    cfg, prepared, model, device, dist = _setup(path, overrides)
    try:
        cfg = resolve_budget(cfg, model, prepared, dist)
        forward = wrap_model(model, cfg.train.distributed, dist)
        loader, eval_data = build_loaders(cfg, prepared, dist)  # the eval data give the held-out batches
        trainer = Trainer(
            model, loader, trainer_config(cfg), cfg.eval, output_dir=cfg.output_dir, device=device, dist=dist,
            forward=forward, console=False, eval_data=eval_data,
        )  # fmt: skip
        result = lr_range_test(trainer, cfg.finder, log=(lambda s: _say(dist, s)))
        if dist.is_main:
            paths = [p for p in write_outputs(result, cfg.output_dir) if p is not None]
            print("wrote " + ", ".join(map(str, paths)), flush=True)
            if len(paths) < 2:
                print("no plot: matplotlib is not installed (pip install 'densebatch[plot]')", file=sys.stderr)
    finally:
        dist.close()
    return 0


def find_batch_command(path: str | None, overrides: list[str]) -> int:
    from densebatch.run import resolve_config

    strategy = resolve_config(path, overrides).batching.strategy
    if strategy not in ("token_budget", "packed"):
        raise ConfigError(
            f"find-batch sizes token_budget and packed batches; batching.strategy is {strategy}: "
            "pass --batching.strategy=token_budget or packed"
        )
    cfg, prepared, model, _device, dist = _setup(path, overrides)
    try:
        result = fit_budget(cfg, model, prepared, dist)
        if dist.is_main:
            print(result.report(), flush=True)
            out = Path(cfg.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            write_file(out / BUDGET_JSON, json.dumps(result.as_dict(), indent=1) + "\n")
            print(f"use it with --batching.max_tokens_per_batch={result.budget} (or auto); wrote {out / BUDGET_JSON}", flush=True)
    finally:
        dist.close()
    return 0
