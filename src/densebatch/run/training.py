"""The train command: build data, model, loaders, trainer and session from the configuration, and run.

Order of a run: the configuration is resolved (a resume takes the checkpoint's, see ``run/resume.py``;
a fresh run refuses an ``output_dir`` that already holds a run unless ``--overwrite``); documents are
prepared (rank 0 first, the others then read the cache); seeds are set, then the model is built (so
initial weights depend only on ``seed``) and its context checked against the longest row; the model
is wrapped for DDP / FSDP under torchrun; the session restores the newest verified checkpoint when
resuming and runs. At the end rank 0 writes ``output_dir/final`` (model, tokenizer, config) atomically.
Training policy (checkpoints, rollbacks, signals) lives in ``train/session.py``; this module only builds.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from densebatch.atomic import staged_dir, write_file
from densebatch.config import RunConfig, save_config, to_dict
from densebatch.data.accuracy import AccuracyCheck
from densebatch.data.collate import collator_from_config
from densebatch.data.loader import StepLoader, full_context_settings
from densebatch.data.plan import PlanSettings
from densebatch.data.prepare import Prepared, prepare
from densebatch.data.steps import StepSettings
from densebatch.errors import ConfigError, UserError
from densebatch.model import build_model, generate_batch, save_model
from densebatch.run.find import keep_resolved, resolve_budget, resolve_lr, trainer_config
from densebatch.run.resume import plan_resume
from densebatch.train.checkpoint import CheckpointManager, latest_valid, load_checkpoint
from densebatch.train.distributed import Distributed, wrap_model
from densebatch.train.guard import AdaptiveClipper, AnomalyGuard, FixedClipper
from densebatch.train.health import HealthMonitor, default_memory_limit_gb
from densebatch.train.loop import Trainer, resolve_device
from densebatch.train.monitor import METRICS_FILE, truncate_metrics
from densebatch.train.portable import is_sharded, model_state
from densebatch.train.schedule import BatchSchedule
from densebatch.train.session import Session

FINAL_DIR = "final"  # output_dir/final: model + tokenizer + config.yaml + densebatch_state.json
CHECKPOINT_DIR = "checkpoints"
FINAL_STATE = "densebatch_state.json"  # {"step": N}: which step the final weights are
RUN_OUTPUTS = (METRICS_FILE, CHECKPOINT_DIR, FINAL_DIR, "plots", "tensorboard", "csv", "config.yaml")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def longest_row(cfg: RunConfig, prepared: Prepared) -> tuple[int, str]:
    """The longest row any batch of the run can hold (train and full-context eval), and the key that sets it."""
    b, m = cfg.batching, cfg.batching.pad_to_multiple_of
    longest_doc = int(np.max(prepared.train.lengths))
    if b.strategy == "packed":
        train, key = b.seq_len, "batching.seq_len"
    elif b.strategy == "token_budget" and b.long_docs == "split":
        budget = longest_doc if b.max_tokens_per_batch == "auto" else b.max_tokens_per_batch  # auto: not known yet
        train, key = min(longest_doc, budget), "data.max_seq_len"
    else:
        train, key = longest_doc, "data.max_seq_len"
    longest = max(train, int(np.max(prepared.eval.lengths)) if prepared.eval is not None else 0)
    return -(-longest // m) * m, key


def check_context(model, cfg: RunConfig, prepared: Prepared) -> None:
    """Rows longer than the model's context would fail deep inside the model: refuse them up front."""
    ctx = getattr(model, "max_positions", None)
    row, key = longest_row(cfg, prepared)
    if ctx is not None and row > ctx:
        what = "model.block_size" if cfg.model.kind == "gpt" else f"the model's context ({cfg.model.path})"
        raise ConfigError(
            f"{key}: rows of up to {row} tokens exceed {what} of {ctx} positions; lower {key}"
            + (" or raise model.block_size" if cfg.model.kind == "gpt" else "")
        )


def holds_a_run(out: Path) -> list[str]:
    """The outputs of an earlier run found in ``out`` (metrics, checkpoints, final model); empty when
    it is safe to start there."""
    found = []
    for name in RUN_OUTPUTS[:3]:
        p = out / name
        if p.is_file() or (p.is_dir() and any(p.iterdir())):
            found.append(name)
    return found


def resolve_run(requested: RunConfig, overrides: list[str], resume: bool, overwrite: bool, dist: Distributed):
    """(configuration to run, checkpoint to resume from or None), after the resume / overwrite rules."""
    out = Path(requested.output_dir)
    ck = requested.checkpoint
    path = None
    if resume or ck.resume == "auto":
        path = latest_valid(
            out / CHECKPOINT_DIR, ck.mirror_dir, on_skip=lambda p, why: _warn(dist, f"checkpoint {p}: {why} — skipped")
        )
        if path is None and resume:
            _warn(dist, f"no valid checkpoint in {out / CHECKPOINT_DIR} to resume from: starting fresh")
    if path is None:
        found = holds_a_run(out)
        if found and not overwrite and not resume:
            raise UserError(
                f"{out} already holds a run ({', '.join(found)}); continue it with --resume, "
                f"or start over with --overwrite (deletes it), or set --output_dir"
            )
        if found and dist.is_main:
            for name in RUN_OUTPUTS:
                target = out / name
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        dist.barrier()
        return requested, None
    extra = load_checkpoint(path, parts=("extra",)).extra_state
    requested = keep_resolved(requested, extra["config"])  # `auto` asked again: the value the run found
    plan = plan_resume(extra["config"], requested, overrides)
    cfg = plan.config
    saved_world = int(extra.get("world_size", 1))
    if saved_world != dist.world_size:  # elastic: keep the global batch by changing the accumulation
        total = saved_world * cfg.train.grad_accum_batches
        if cfg.train.loss_tokens_per_step is None and total % dist.world_size:
            raise UserError(
                f"--resume: the run took {total} batches per step over {saved_world} processes; "
                f"{dist.world_size} processes cannot split that evenly: use a world size that divides {total}"
            )
        k = max(1, total // dist.world_size)
        plan.changed.append(
            f"train.grad_accum_batches: {cfg.train.grad_accum_batches} → {k} ({saved_world} → {dist.world_size} processes, same batches per step)"
        )
        cfg = replace(cfg, train=replace(cfg.train, grad_accum_batches=k))
    if dist.is_main:
        print(f"resuming the run saved in {path} with its configuration", flush=True)
        for line in plan.changed:
            print(f"  changed: {line}", flush=True)
        for line in plan.ignored:
            print(f"  ignored: {line}", flush=True)
    return cfg, path


def _warn(dist: Distributed, text: str) -> None:
    if dist.is_main:
        print(f"warning: {text}", file=sys.stderr, flush=True)


def build_loaders(cfg: RunConfig, prepared: Prepared, dist: Distributed):
    """(train StepLoader, eval batches factory or None)."""
    settings = PlanSettings.from_config(cfg.batching)
    t = cfg.train
    steps = StepSettings(t.grad_accum_batches, t.loss_tokens_per_step, dist.world_size, dist.rank)
    collator = collator_from_config(cfg.batching, prepared.train.meta, cfg.seed)
    loader = StepLoader(
        prepared.train, settings, collator, cfg.seed, steps, prefetch=cfg.batching.prefetch, weights=prepared.weights
    )
    if prepared.eval is None:
        return loader, None
    eval_settings = full_context_settings(settings, int(np.max(prepared.eval.lengths)))
    eval_collator = collator_from_config(cfg.batching, prepared.eval.meta, cfg.seed)
    eval_loader = StepLoader(
        prepared.eval, eval_settings, eval_collator, cfg.seed, StepSettings(1, None, dist.world_size, dist.rank), 0
    )
    return loader, lambda: eval_loader.iter_epoch(0)


def train(path: str | None, overrides: list[str], resume: bool = False, overwrite: bool = False) -> int:
    from densebatch.run import resolve_config

    requested = resolve_config(path, overrides)
    dist = Distributed.from_environment(requested.train.device)
    try:
        return _train(requested, overrides, resume, overwrite, dist)
    finally:
        dist.close()


def _train(requested: RunConfig, overrides: list[str], resume: bool, overwrite: bool, dist: Distributed) -> int:
    cfg, resume_from = resolve_run(requested, overrides, resume, overwrite, dist)
    out = Path(cfg.output_dir)
    if dist.is_main:  # rank 0 prepares (or finds the cache); the others then read what it wrote
        prepared = prepare(cfg.data, cfg.seed)
        print(prepared.summary, flush=True)
    dist.barrier()
    if not dist.is_main:
        prepared = prepare(cfg.data, cfg.seed)
    tok = prepared.tokenizer

    seed_everything(cfg.seed)
    model = build_model(cfg.model, tok.vocab_size, tok.base_vocab_size)  # added tokens' rows: the mean of the others
    check_context(model, cfg, prepared)
    model.label_smoothing = cfg.train.label_smoothing
    device = dist.device if dist.enabled else resolve_device(cfg.train.device)
    model.to(device)
    cfg = resolve_budget(cfg, model, prepared, dist)  # batching.max_tokens_per_batch: auto, before any wrapping
    forward = wrap_model(model, cfg.train.distributed, dist)
    loader, eval_data = build_loaders(cfg, prepared, dist)
    t = trainer_config(cfg)  # train.lr: auto holds a placeholder until resolve_lr below
    if t.batch_backoff_patience and eval_data is None:
        raise ConfigError("train.batch_backoff_patience: a back-off watches the eval loss, and this run has no eval split")
    trainer = Trainer(
        model, loader, t, cfg.eval, output_dir=out, device=device, eval_data=eval_data,
        guard=AnomalyGuard(t.spike_zscore, t.spike_window, t.max_bad_steps),
        clipper=AdaptiveClipper(ceiling=t.grad_clip) if t.grad_clip_mode == "adaptive" else FixedClipper(t.grad_clip),
        dist=dist, forward=forward, sinks=build_sinks(cfg, out) if dist.is_main else (),
        source_names=prepared.train.source_names,
        batch_schedule=BatchSchedule.from_config(t), health=build_health(cfg, device),
    )  # fmt: skip
    cfg = resolve_lr(cfg, trainer, dist)  # train.lr: auto: the range test on this trainer, which it leaves as it was
    accuracy = None
    sharded = cfg.train.distributed == "fsdp" and dist.enabled  # generation would need every rank's shards
    demo_data = cfg.data.path is None and not cfg.data.sources  # the embedded dataset, whose answers can be checked
    if demo_data and prepared.eval_records and cfg.eval.accuracy_samples and dist.is_main and not sharded:
        accuracy = AccuracyCheck(prepared.eval_records, cfg.data, tok, cfg.eval.accuracy_samples)

        def answer(model, prompts):
            return generate_batch(model, prompts, cfg.eval.max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id)

        trainer.evaluate_fn = lambda model: accuracy(lambda prompts: answer(model, prompts))
    ckpt = CheckpointManager(out / CHECKPOINT_DIR, cfg.checkpoint.keep_last, cfg.checkpoint.mirror_dir)
    session = Session(trainer, ckpt, cfg.checkpoint.every_steps, t.rollback_lr_factor, config=to_dict(cfg))
    if resume_from is not None:
        session.restore(resume_from)
        if dist.is_main:
            truncate_metrics(out / METRICS_FILE, trainer.state.step)
            print(f"resumed from {resume_from} (step {trainer.state.step})", flush=True)
    if dist.is_main:
        save_config(cfg, out / "config.yaml")
    result = session.run()
    if result.stop_reason == "interrupted":
        if dist.is_main:
            print("stopped by signal; continue with --resume", flush=True)
        return 0
    final_model = trainer.model
    if is_sharded(trainer.model):  # FSDP: gather the full weights (every rank takes part) into a plain copy
        state = model_state(trainer.model)
        if dist.is_main:
            final_model = build_model(cfg.model, tok.vocab_size, tok.base_vocab_size)  # LoRA: the same modules
            final_model.load_state_dict(state)
    if dist.is_main:
        final = out / FINAL_DIR
        with staged_dir(final) as tmp:
            save_model(final_model, tmp)
            tok.save(tmp)
            save_config(cfg, tmp / "config.yaml")
            write_file(tmp / FINAL_STATE, json.dumps({"step": trainer.state.step}))
        if accuracy is not None and accuracy.samples:
            acc = (trainer.state.last_eval or {}).get("accuracy", math.nan)
            print(f"exact-match accuracy on {len(accuracy.samples)} held-out prompts: {acc:.3f}\n{accuracy.show()}")
        print(f"model, tokenizer and config: {final}", flush=True)
        if cfg.train.plots:
            write_plots(out)
    return 0


def build_health(cfg: RunConfig, device) -> HealthMonitor | None:
    """The health warnings' monitor from ``train.health``; memory is judged against ``train.memory_limit_gb``,
    or the device's (CUDA) or machine's (CPU) memory."""
    h = cfg.train.health
    if not h.enabled:
        return None
    limit = cfg.train.memory_limit_gb or default_memory_limit_gb(torch.device(device))
    return HealthMonitor(
        memory_limit_gb=limit, clip_limit=cfg.train.grad_clip, warmup_steps=h.warmup_steps,
        data_wait_share=h.data_wait_share, memory_margin=h.memory_margin, slow_ratio=h.slow_ratio,
        fill_ratio=h.fill_ratio, clip_share=h.clip_share, clip_warmup_steps=h.clip_warmup_steps,
    )  # fmt: skip


def write_plots(out: Path) -> None:
    """The run's plots (train/plots.py) into ``out/plots``, and where they went; without matplotlib, a hint."""
    from densebatch.train.plots import PLOTS_DIR, plot_run

    try:
        paths = plot_run(out)
    except ConfigError:  # matplotlib is missing: plots are optional
        print("plots: not drawn (they need matplotlib: pip install 'densebatch[plot]')", flush=True)
        return
    if paths:
        print(f"plots: {out / PLOTS_DIR}/ ({', '.join(p.name for p in paths)})", flush=True)


def build_sinks(cfg: RunConfig, out: Path) -> list:
    if not cfg.train.report_to:
        return []
    from densebatch.train.sinks import build_sinks as build

    return build(list(cfg.train.report_to), out)
