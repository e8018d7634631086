"""The train command: from a resolved configuration to a finished run directory.

``_train`` reads in the order of a run: resolve (``run/resume.py``: a fresh directory, ``--overwrite``, or
the newest verified checkpoint with its saved configuration); build (``build_run``: documents and the
seeded model through ``run/build.py``, shared with the finders; the token budget found before any
wrapping, or on the sharded model; DDP / FSDP wrapping under torchrun; the loaders); report
(``run/report.py``, printed once); train (the trainer, its learning rate found by the range test under
``train.lr: auto``, and the session of ``train/session.py``: checkpoints, rollbacks, signals, the restore
when resuming); finish (``output_dir/final``: model, tokenizer, config, written atomically).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from densebatch.config import RunConfig, save_config, to_dict
from densebatch.data.accuracy import AccuracyCheck
from densebatch.data.load.loader import StepLoader
from densebatch.data.prepare.parts import check_inputs
from densebatch.data.prepare.pipeline import Prepared
from densebatch.errors import ConfigError
from densebatch.model import generate_batch
from densebatch.run.auto import resolve_budget, resolve_lr
from densebatch.run.build import build_loaders, eval_store, materialise_run_model, resolve_config, setup, source_weights
from densebatch.run.context import mesh_line
from densebatch.run.final import write_final
from densebatch.run.layout import CHECKPOINT_DIR, FINAL_DIR
from densebatch.run.lock import RunLock
from densebatch.run.preference import is_pairs, pairs_before_training, preference_steps
from densebatch.run.report import report_lines
from densebatch.run.resume import resolve_run
from densebatch.train.checkpoint.manager import CheckpointManager
from densebatch.train.distributed import Distributed, wrap_model
from densebatch.train.guard import AdaptiveClipper, AnomalyGuard, FixedClipper
from densebatch.train.loop import Trainer
from densebatch.train.observe.health import HealthMonitor, default_memory_limit_gb
from densebatch.train.observe.monitor import METRICS_FILE, truncate_metrics
from densebatch.train.observe.plots import PLOTS_DIR, plot_run
from densebatch.train.observe.sinks import build_sinks as sinks_for
from densebatch.train.parallel.mesh import ContextRanks
from densebatch.train.parts import Evaluation, Placement, Reporting, StepParts
from densebatch.train.schedule import BatchSchedule
from densebatch.train.session import Session


def train(path: str | None, overrides: list[str], resume: bool = False, overwrite: bool = False) -> int:
    requested = resolve_config(path, overrides)
    check_inputs(requested.data)  # before the output directory's checks: a missing file is named as that
    if not str(requested.output_dir).strip():  # before the lock, which would be taken in the current directory
        raise ConfigError("output_dir: empty; name the run's directory (an empty one would be the current directory)")
    dist = Distributed.from_environment(requested.train.device)
    try:
        with RunLock(requested.output_dir, dist):  # one writer per run directory, for the whole run
            return _train(requested, overrides=overrides, resume=resume, overwrite=overwrite, dist=dist)
    finally:
        dist.close()


def _train(requested: RunConfig, *, overrides: list[str], resume: bool, overwrite: bool, dist: Distributed) -> int:
    cfg, resume_from, start_over = resolve_run(
        requested, overrides=overrides, resume=resume, overwrite=overwrite, dist=dist
    )  # resolve
    run = build_run(cfg, dist, start_over)  # build
    if dist.is_main:  # report
        for line in [*report_lines(run.cfg, run.prepared, run.loader, run.weights), mesh_line(run.cfg, run.context)]:
            if line is not None:
                print(line, flush=True)
    trainer = build_trainer(run, dist)
    final_cfg = resolve_lr(run.cfg, trainer, dist)  # train.lr: auto: the range test on this trainer, which takes the rate
    out = Path(final_cfg.output_dir)
    session = Session(
        trainer, checkpoints=CheckpointManager(out / CHECKPOINT_DIR, final_cfg.checkpoint.keep_last, final_cfg.checkpoint.mirror_dir, dist),
        every_steps=final_cfg.checkpoint.every_steps, rollback_lr_factor=final_cfg.train.guard.rollback_lr_factor, config=to_dict(final_cfg),
        background_saves=final_cfg.checkpoint.async_,
    )  # fmt: skip
    if resume_from is not None:
        session.restore(resume_from)
        if dist.is_main:
            truncate_metrics(out / METRICS_FILE, trainer.state.step)
            print(f"resumed from {resume_from} (step {trainer.state.step})", flush=True)
    if dist.is_main:
        save_config(final_cfg, out / "config.yaml")
    try:  # train
        result = session.run()
    finally:  # a tracker's run ends, and its last records reach its files, with the run (or its error)
        for sink in trainer.sinks:
            sink.close()
    return finish(final_cfg, run=run, trainer=trainer, stop_reason=result.stop_reason, dist=dist)


@dataclass
class Run:
    """What ``build_run`` built: the configuration with its token budget found, the documents and model, the
    module training goes through, the loaders, the sources' weights and the accuracy check."""

    cfg: RunConfig
    prepared: Prepared
    model: torch.nn.Module
    device: torch.device
    forward: torch.nn.Module
    loader: StepLoader
    eval_data: Callable[[], Iterable] | None
    weights: list[float] | None
    accuracy: AccuracyCheck | None
    context: ContextRanks  # the data x context mesh (train.context_parallel)


def build_run(cfg: RunConfig, dist: Distributed, start_over: Callable[[], None] | None) -> Run:
    """Documents, the seeded model (on the meta device under FSDP: each rank materialises only its shards, no
    process holds it whole), ``batching.max_tokens_per_batch: auto`` found (before DDP wraps the model, or
    on the sharded model under FSDP), the wrapped model, the loaders and the sources' weights."""
    sharded = cfg.train.distributed == "fsdp" and dist.enabled
    s = setup(cfg, dist, on_meta=sharded)  # documents (rank 0 first), then the seeded model: run/build.py
    if start_over is not None:  # --overwrite: the old run goes only once the new one's data and model are there
        start_over()
    if sharded:  # the budget is found on the sharded model, through the module training goes through
        forward = wrap_model(s.model, cfg.train.distributed, dist, cfg.train.precision)
        if s.init is not None:
            materialise_run_model(cfg, model=s.model, record=s.init, device=s.device, dist=dist)
        sized = resolve_budget(cfg, model=s.model, prepared=s.prepared, dist=dist, forward=forward)
    else:  # the budget is found before DDP wraps the model
        sized = resolve_budget(cfg, model=s.model, prepared=s.prepared, dist=dist)
        forward = wrap_model(s.model, cfg.train.distributed, dist, cfg.train.precision)
    reference = None
    if is_pairs(s.prepared.train):  # preference pairs: whole in every row; dpo's reference scored once if precomputed
        reference = pairs_before_training(
            sized, model=s.model, prepared=s.prepared, device=s.device, dist=dist, eval_store=eval_store
        )
    loader, eval_data = build_loaders(sized, s.prepared, dist, s.context, reference)
    weights = source_weights(sized, s.prepared, loader)
    accuracy = accuracy_check(sized, s.prepared, dist)
    return Run(sized, s.prepared, s.model, s.device, forward, loader, eval_data, weights, accuracy, s.context)


def build_trainer(run: Run, dist: Distributed) -> Trainer:
    """The trainer of ``run``, with its guard, clipper, batch schedule, sinks and health warnings; under
    ``train.lr: auto`` it takes its rate from the range test (``resolve_lr``) before it trains."""
    cfg, t = run.cfg, run.cfg.train
    if t.batch_schedule.backoff_patience and run.eval_data is None:
        raise ConfigError(
            "train.batch_schedule.backoff_patience: a back-off watches the eval loss, and this run has no eval split"
        )
    out, tok = Path(cfg.output_dir), run.prepared.tokenizer
    return Trainer(
        run.model, run.loader, t, output_dir=out,
        evaluation=Evaluation(cfg.eval, run.eval_data, accuracy_entries(cfg, run.accuracy, tok) if run.accuracy is not None else None),
        placement=Placement(run.device, dist, run.forward, run.context),
        parts=StepParts(
            guard=AnomalyGuard(t.guard.spike_zscore, t.guard.spike_window, t.guard.max_bad_steps),
            clipper=AdaptiveClipper(ceiling=t.grad_clip) if t.grad_clip_mode == "adaptive" else FixedClipper(t.grad_clip),
            batch_schedule=BatchSchedule.from_config(t.batch_schedule), source_weights=run.weights,
            objective=preference_steps(cfg, run.model, sharded=t.distributed == "fsdp" and dist.enabled),
        ),
        reporting=Reporting(
            sinks=build_sinks(cfg, out) if dist.is_main else (), health=build_health(cfg, run.device),
            source_names=run.prepared.train.source_names,
        ),
    )  # fmt: skip


def finish(cfg: RunConfig, *, run: Run, trainer: Trainer, stop_reason: str, dist: Distributed) -> int:
    """After the last step: ``output_dir/final`` (model, tokenizer, config; every rank, FSDP streams the
    weights), the accuracy of the held-out answers and the plots; only a line when a signal stopped the run."""
    out = Path(cfg.output_dir)
    if stop_reason == "interrupted":
        if dist.is_main:
            print("stopped by signal; continue with --resume", flush=True)
        return 0
    final = out / FINAL_DIR
    write_final(final, model=trainer.model, tok=run.prepared.tokenizer, cfg=cfg, step=trainer.state.step, dist=dist)
    if dist.is_main:
        accuracy = run.accuracy
        if accuracy is not None and accuracy.samples:
            acc = (trainer.state.last_eval or {}).get("accuracy", math.nan)
            print(f"exact-match accuracy on {len(accuracy.samples)} held-out prompts: {acc:.3f}\n{accuracy.show()}")
        print(f"model, tokenizer and config: {final}", flush=True)
        if cfg.train.plots:
            write_plots(out)
    return 0


def accuracy_check(cfg: RunConfig, prepared, dist: Distributed) -> AccuracyCheck | None:
    """Exact-match accuracy on held-out prompts: only for the embedded dataset (whose answers can be checked),
    on rank 0, and not under FSDP (generation would need every rank's shards); not for a masked LM (an
    encoder generates nothing: its evaluation reports the masked tokens it predicts, ``masked_accuracy``)."""
    sharded = cfg.train.distributed == "fsdp" and dist.enabled
    if cfg.batching.mode == "mlm":
        return None
    demo_data = cfg.data.path is None and not cfg.data.sources
    # the held-out records are read here, by the one rank that scores them, and only when they are scored
    if demo_data and cfg.eval.accuracy_samples and dist.is_main and not sharded and prepared.eval_records:
        return AccuracyCheck(prepared.eval_records, cfg.data, prepared.tokenizer, cfg.eval.accuracy_samples)
    return None


def accuracy_entries(cfg: RunConfig, accuracy: AccuracyCheck, tok):
    """The eval records' accuracy entries: greedy answers to the held-out prompts, checked."""

    def answer(model, prompts):
        return generate_batch(model, prompts, cfg.eval.max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id)

    return lambda model: accuracy(lambda prompts: answer(model, prompts))


def build_health(cfg: RunConfig, device) -> HealthMonitor | None:
    """The health warnings' monitor from ``train.health``; memory is judged against ``train.memory_limit_gb``,
    or the device's (CUDA) or machine's (CPU) memory."""
    h = cfg.train.health
    if not h.enabled:
        return None
    limit = cfg.train.memory_limit_gb or default_memory_limit_gb(torch.device(device))
    return HealthMonitor(
        memory_limit_gb=limit, clip_limit=cfg.train.grad_clip, warmup_steps=h.warmup_steps,
        data_wait_share=h.data_wait_share, memory_headroom=h.memory_headroom, slow_ratio=h.slow_ratio,
        fill_ratio=h.fill_ratio, clip_share=h.clip_share, clip_warmup_steps=h.clip_warmup_steps,
    )  # fmt: skip


def write_plots(out: Path) -> None:
    """The run's plots (train/observe/plots.py) into ``out/plots``, and where they went; without matplotlib, a hint."""
    try:
        paths = plot_run(out)
    except ConfigError:  # matplotlib is missing: plots are optional
        print("plots: not drawn (they need matplotlib: pip install 'densebatch[plot]')", flush=True)
        return
    if paths:
        print(f"plots: {out / PLOTS_DIR}/ ({', '.join(p.name for p in paths)})", flush=True)


def build_sinks(cfg: RunConfig, out: Path) -> list:
    return sinks_for(list(cfg.train.report_to), out, to_dict(cfg)) if cfg.train.report_to else []
