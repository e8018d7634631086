"""The finders' commands: ``densebatch find-lr`` (learning-rate range test) and ``find-batch`` (token
budget fitted to memory), on the model, loss and batches ``densebatch train`` would build (``run/build.py``).
The ``auto`` values of a training run resolve in ``run/auto.py``, which these commands share."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from densebatch.atomic import write_file
from densebatch.data.plan.rules import sized_by_budget
from densebatch.errors import ConfigError
from densebatch.run.auto import fit_budget, resolve_budget, say
from densebatch.run.build import build_loaders, eval_store, resolve_config, setup, source_weights
from densebatch.run.preference import is_pairs, pairs_before_training, preference_steps
from densebatch.train.distributed import Distributed, wrap_model
from densebatch.train.finders.lr_finder import lr_range_test, write_outputs
from densebatch.train.loop import Trainer
from densebatch.train.parts import Evaluation, Placement, Reporting, StepParts

BUDGET_JSON = "batch_finder.json"


def find_lr_command(path: str | None, overrides: list[str]) -> int:
    cfg = resolve_config(path, overrides)
    dist = Distributed.from_environment(cfg.train.device)
    try:
        s = setup(cfg, dist)
        cfg = resolve_budget(cfg, model=s.model, prepared=s.prepared, dist=dist)
        forward = wrap_model(s.model, cfg.train.distributed, dist, cfg.train.precision)
        reference = None  # preference pairs: the range test's steps are the objective's, as train's are
        if is_pairs(s.prepared.train):
            reference = pairs_before_training(
                cfg, model=s.model, prepared=s.prepared, device=s.device, dist=dist, eval_store=eval_store
            )
        loader, eval_data = build_loaders(cfg, s.prepared, dist, s.context, reference)  # the eval data give the held-out batches
        trainer = Trainer(
            s.model, loader, cfg.train, output_dir=cfg.output_dir, evaluation=Evaluation(cfg.eval, eval_data),
            placement=Placement(s.device, dist, forward, s.context), reporting=Reporting(console=False),
            parts=StepParts(source_weights=source_weights(cfg, s.prepared, loader), objective=preference_steps(cfg, s.model)),
        )  # fmt: skip
        result = lr_range_test(trainer, cfg.finder, log=(lambda text: say(dist, text)))
        if dist.is_main:
            paths = [p for p in write_outputs(result, cfg.output_dir) if p is not None]
            print("wrote " + ", ".join(map(str, paths)), flush=True)
            if len(paths) < 2:
                print("no plot: matplotlib is not installed (pip install 'densebatch[plot]')", file=sys.stderr)
    finally:
        dist.close()
    return 0


def find_batch_command(path: str | None, overrides: list[str]) -> int:
    cfg = resolve_config(path, overrides)
    if not sized_by_budget(cfg.batching.strategy):
        raise ConfigError(
            f"find-batch sizes token_budget and packed batches; batching.strategy is {cfg.batching.strategy}: "
            "pass --batching.strategy=token_budget or packed"
        )
    if cfg.train.context_parallel > 1:
        raise ConfigError("find-batch probes whole rows on one rank; under train.context_parallel set the budget yourself")
    dist = Distributed.from_environment(cfg.train.device)
    try:
        s = setup(cfg, dist)
        result = fit_budget(cfg, model=s.model, prepared=s.prepared, dist=dist)
        if dist.is_main:
            print(result.report(), flush=True)
            out = Path(cfg.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            write_file(out / BUDGET_JSON, json.dumps(result.as_dict(), indent=1) + "\n")
            print(f"use it with --batching.max_tokens_per_batch={result.budget} (or auto); wrote {out / BUDGET_JSON}", flush=True)
    finally:
        dist.close()
    return 0
