"""The train command: from a resolved configuration to a finished run directory.

Order of a run: where it starts (``run/resume.py``: a fresh directory, ``--overwrite``, or the newest
verified checkpoint with its saved configuration); documents and the seeded model (``run/build.py``,
shared with the finders); ``auto`` values (``run/auto.py``: the budget before any wrapping, the
learning rate once the trainer exists); DDP / FSDP wrapping under torchrun; the session
(``train/session.py``: checkpoints, rollbacks, signals), which restores the checkpoint when resuming
and runs. At the end rank 0 writes ``output_dir/final`` (model, tokenizer, config) atomically.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from densebatch.config import RunConfig, save_config, to_dict
from densebatch.data.accuracy import AccuracyCheck
from densebatch.errors import ConfigError
from densebatch.model import generate_batch
from densebatch.run.auto import resolve_budget, resolve_lr, trainer_config
from densebatch.run.build import (
    build_loaders,
    eval_cap_line,
    homogeneity_warning,
    materialise_run_model,
    resolve_config,
    setup,
    source_weights,
    source_weights_line,
    step_size_line,
)
from densebatch.run.final import write_final
from densebatch.run.layout import CHECKPOINT_DIR, FINAL_DIR
from densebatch.run.lock import RunLock
from densebatch.run.resume import resolve_run
from densebatch.train.checkpoint import CheckpointManager
from densebatch.train.distributed import Distributed, wrap_model
from densebatch.train.guard import AdaptiveClipper, AnomalyGuard, FixedClipper
from densebatch.train.loop import Trainer
from densebatch.train.observe.health import HealthMonitor, default_memory_limit_gb
from densebatch.train.observe.monitor import METRICS_FILE, truncate_metrics
from densebatch.train.observe.plots import PLOTS_DIR, plot_run
from densebatch.train.observe.sinks import build_sinks as sinks_for
from densebatch.train.parts import Evaluation, Placement, Reporting, StepParts
from densebatch.train.schedule import BatchSchedule
from densebatch.train.session import Session


def train(path: str | None, overrides: list[str], resume: bool = False, overwrite: bool = False) -> int:
    requested = resolve_config(path, overrides)
    if not str(requested.output_dir).strip():  # before the lock, which would be taken in the current directory
        raise ConfigError("output_dir: empty; name the run's directory (an empty one would be the current directory)")
    dist = Distributed.from_environment(requested.train.device)
    try:
        with RunLock(requested.output_dir, dist):  # one writer per run directory, for the whole run
            return _train(requested, overrides, resume, overwrite, dist)
    finally:
        dist.close()


def _train(requested: RunConfig, overrides: list[str], resume: bool, overwrite: bool, dist: Distributed) -> int:
    cfg, resume_from, start_over = resolve_run(requested, overrides, resume, overwrite, dist)
    out = Path(cfg.output_dir)
    # FSDP: the model is built on the meta device and each rank materialises only its shards (no process
    # holds it whole); the budget finder then sizes the sharded step
    sharded = cfg.train.distributed == "fsdp" and dist.enabled
    s = setup(cfg, dist, on_meta=sharded)  # documents (rank 0 first), then the seeded model: run/build.py
    if start_over is not None:  # --overwrite: the old run goes only once the new one's data and model are there
        start_over()
    prepared, model, device = s.prepared, s.model, s.device
    tok = prepared.tokenizer
    if not sharded:
        cfg = resolve_budget(cfg, model, prepared, dist)  # batching.max_tokens_per_batch: auto, before DDP wraps it
    forward = wrap_model(model, cfg.train.distributed, dist, cfg.train.precision)
    if s.init is not None:
        materialise_run_model(cfg, model, s.init, device, dist)
    if sharded:
        cfg = resolve_budget(cfg, model, prepared, dist, forward)
    loader, eval_data = build_loaders(cfg, prepared, dist)
    if dist.is_main and (alike := homogeneity_warning(cfg, prepared, loader)) is not None:
        print(alike, flush=True)
    if dist.is_main and (sizes := step_size_line(loader)) is not None:
        print(sizes, flush=True)
    if dist.is_main and prepared.eval is not None and (cap := eval_cap_line(cfg, prepared.eval)) is not None:
        print(cap, flush=True)
    weights = source_weights(cfg, prepared, loader)
    if dist.is_main and (line := source_weights_line(prepared, weights, cfg.batching.rows_per_batch)) is not None:
        print(line, flush=True)
    t = trainer_config(cfg)  # train.lr: auto holds a placeholder until resolve_lr below
    if t.batch_schedule.backoff_patience and eval_data is None:
        raise ConfigError(
            "train.batch_schedule.backoff_patience: a back-off watches the eval loss, and this run has no eval split"
        )
    accuracy = accuracy_check(cfg, prepared, dist)
    trainer = Trainer(
        model, loader, t, output_dir=out,
        evaluation=Evaluation(cfg.eval, eval_data, accuracy_entries(cfg, accuracy, tok) if accuracy is not None else None),
        placement=Placement(device, dist, forward),
        parts=StepParts(
            guard=AnomalyGuard(t.guard.spike_zscore, t.guard.spike_window, t.guard.max_bad_steps),
            clipper=AdaptiveClipper(ceiling=t.grad_clip) if t.grad_clip_mode == "adaptive" else FixedClipper(t.grad_clip),
            batch_schedule=BatchSchedule.from_config(t.batch_schedule), source_weights=weights,
        ),
        reporting=Reporting(
            sinks=build_sinks(cfg, out) if dist.is_main else (), health=build_health(cfg, device),
            source_names=prepared.train.source_names,
        ),
    )  # fmt: skip
    cfg = resolve_lr(cfg, trainer, dist)  # train.lr: auto: the range test on this trainer, which it leaves as it was
    ckpt = CheckpointManager(out / CHECKPOINT_DIR, cfg.checkpoint.keep_last, cfg.checkpoint.mirror_dir, dist)
    session = Session(
        trainer, ckpt, cfg.checkpoint.every_steps, t.guard.rollback_lr_factor, config=to_dict(cfg),
        background_saves=cfg.checkpoint.async_,
    )  # fmt: skip
    if resume_from is not None:
        session.restore(resume_from)
        if dist.is_main:
            truncate_metrics(out / METRICS_FILE, trainer.state.step)
            print(f"resumed from {resume_from} (step {trainer.state.step})", flush=True)
    if dist.is_main:
        save_config(cfg, out / "config.yaml")
    try:
        result = session.run()
    finally:  # a tracker's run ends, and its last records reach its files, with the run (or its error)
        for sink in trainer.sinks:
            sink.close()
    if result.stop_reason == "interrupted":
        if dist.is_main:
            print("stopped by signal; continue with --resume", flush=True)
        return 0
    final = out / FINAL_DIR
    write_final(final, trainer.model, tok, cfg, trainer.state.step, dist)  # every rank: FSDP streams the weights
    if dist.is_main:
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
