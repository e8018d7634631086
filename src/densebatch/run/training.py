"""The train command: prepare data, build model and loaders, train with checkpoints, resume and rollback.

Order of a run: resolved config written to ``output_dir/config.yaml``; documents prepared (or taken
from the cache); seeds set, then the model built (so initial weights depend only on ``seed``);
``--resume`` / ``checkpoint.resume: auto`` restores the newest checkpoint that verifies (model,
optimizer, counters, loader position, guard and clipper statistics, every RNG) and drops metrics
written after it; SIGTERM / SIGINT finish the current step, save a checkpoint and exit 0. At the end
a checkpoint and ``output_dir/final`` (model, tokenizer, config) are written.
"""

from __future__ import annotations

import math
import random
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from densebatch.config import RunConfig, save_config, to_dict
from densebatch.data.accuracy import AccuracyCheck
from densebatch.data.collate import collator_from_config
from densebatch.data.loader import BatchLoader
from densebatch.data.plan import PlanSettings
from densebatch.data.prepare import prepare
from densebatch.errors import ConfigError
from densebatch.model import build_model, generate_batch, save_model
from densebatch.run.commands import CHECKPOINT_DIR, FINAL_DIR
from densebatch.train.checkpoint import CheckpointManager
from densebatch.train.guard import AdaptiveClipper, AnomalyGuard
from densebatch.train.loop import Trainer
from densebatch.train.monitor import METRICS_FILE, truncate_metrics
from densebatch.train.rng import capture_rng_state, restore_rng_state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _check_lengths(cfg: RunConfig) -> None:
    """Rows longer than the model's context would fail deep inside the model: say so up front."""
    if cfg.model.kind != "gpt":
        return
    b, ctx = cfg.batching, cfg.model.block_size
    longest = b.seq_len if b.strategy == "packed" else cfg.data.max_seq_len
    longest = -(-longest // b.pad_to_multiple_of) * b.pad_to_multiple_of
    if longest > ctx:
        key = "batching.seq_len" if b.strategy == "packed" else "data.max_seq_len"
        raise ConfigError(
            f"{key}: rows of up to {longest} tokens exceed model.block_size ({ctx}); lower {key} or raise model.block_size"
        )


# TrainState fields that count what was consumed rather than what the weights have seen: kept by a rollback.
_CONSUMED = ("batches_seen", "real_tokens", "loss_tokens", "slot_tokens", "skipped_steps", "elapsed_s")


class Session:
    """One training run: the trainer plus its checkpoints, signals and anomaly rollbacks."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, ckpt: CheckpointManager):
        self.cfg, self.trainer, self.ckpt = cfg, trainer, ckpt
        self.last_saved_step = -1

    def save(self) -> Path:
        t = self.trainer
        extra = {"trainer": t.trainer_state(), "rng": capture_rng_state(), "config": to_dict(self.cfg)}
        path = self.ckpt.save(t.state.step, t.model.state_dict(), t.optimizer.state_dict(), extra)
        self.last_saved_step = t.state.step
        return path

    def restore(self, path: Path, keep_loader_position: bool = False) -> None:
        t = self.trainer
        ck = self.ckpt.load(path, device=t.device)
        loader_state = t.batches.state_dict() if keep_loader_position else None
        guard = getattr(t.step_check, "__self__", None)
        guard_state = guard.state_dict() if (keep_loader_position and guard is not None) else None
        # Counters of the data consumed (and wall time, skipped steps) follow the loader position, which a
        # rollback keeps: restored with the weights, batches_seen would lag the loader by the skipped
        # batches (wrong epoch in the logs, max_epochs overshot) and the skipped steps would be forgotten.
        consumed = {k: getattr(t.state, k) for k in _CONSUMED} if keep_loader_position else {}
        t.load_state_dict({"model": ck.model_state, "optimizer": ck.optimizer_state, "trainer": ck.extra_state["trainer"]})
        if keep_loader_position:  # a rollback skips the batches that caused it and keeps the guard's history
            t.batches.load_state_dict(loader_state)
            if guard is not None:
                guard.load_state_dict(guard_state)
            for k, v in consumed.items():
                setattr(t.state, k, v)
        else:
            restore_rng_state(ck.extra_state["rng"])

    def on_step(self, trainer: Trainer, step: int) -> None:
        rec = trainer.last_record or {}
        if rec.get("skipped") == "rollback":
            self.rollback(step)
            return
        every = self.cfg.checkpoint.every_steps
        if every and step % every == 0 and rec.get("skipped") is None:
            self.save()

    def rollback(self, bad_step: int) -> None:
        t = self.trainer
        target = self.ckpt.latest_valid()
        event = {"kind": "rollback", "step": bad_step, "loss": (t.last_record or {}).get("loss")}
        if target is None:
            event["note"] = "no checkpoint to roll back to: the step was skipped only"
        else:
            lr_scale = t.state.lr_scale * self.cfg.train.rollback_lr_factor
            self.restore(target, keep_loader_position=True)
            t.state.lr_scale = lr_scale
            event |= {"to_step": t.state.step, "lr_scale": lr_scale}
        if t.metrics is not None:
            t.metrics.write(event)
        print(
            f"\nrollback at step {bad_step}: "
            + (f"back to step {event['to_step']}, learning rate x{event['lr_scale']:g}" if target is not None else event["note"]),
            file=sys.stderr,
            flush=True,
        )


def _install_signal_handlers(trainer: Trainer) -> dict:
    """Route SIGTERM / SIGINT to ``trainer.should_stop``; returns the handlers they replace (to put back).
    Outside the main thread (``train`` called from a worker thread) signals cannot be caught: none."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        if trainer.should_stop:  # a second signal: stop now
            raise KeyboardInterrupt
        trainer.should_stop = True
        print(
            f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint", file=sys.stderr, flush=True
        )

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def train(cfg: RunConfig, resume: bool = False) -> int:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    _check_lengths(cfg)
    prepared = prepare(cfg.data)
    print(prepared.summary, flush=True)
    tok = prepared.tokenizer

    seed_everything(cfg.seed)
    model = build_model(cfg.model, tok.vocab_size)
    settings = PlanSettings.from_config(cfg.batching)
    collator = collator_from_config(cfg.batching, prepared.train.meta, cfg.seed)
    loader = BatchLoader(prepared.train, settings, collator, seed=cfg.seed, prefetch=cfg.batching.prefetch)
    eval_batches = None
    if prepared.eval is not None:
        eval_loader = BatchLoader(
            prepared.eval, settings, collator_from_config(cfg.batching, prepared.eval.meta, cfg.seed), seed=cfg.seed, prefetch=0
        )
        eval_batches = lambda: eval_loader.iter_epoch(0)  # noqa: E731 - a fresh deterministic pass each time
    t = cfg.train
    guard = AnomalyGuard(t.spike_zscore, t.spike_window, t.max_bad_steps)
    clipper = AdaptiveClipper(ceiling=t.grad_clip) if t.grad_clip_mode == "adaptive" else None
    trainer = Trainer(
        model, loader, t, cfg.eval, output_dir=out, eval_batches=eval_batches, step_check=guard.check, clipper=clipper
    )
    accuracy = None
    if cfg.data.path is None and prepared.eval_records and cfg.eval.accuracy_samples:
        accuracy = AccuracyCheck(prepared.eval_records, cfg.data, tok, cfg.eval.accuracy_samples)

        def answer(model, prompts):
            return generate_batch(model, prompts, cfg.eval.max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id)

        trainer.evaluate_fn = lambda model: accuracy(lambda prompts: answer(model, prompts))
    ckpt = CheckpointManager(out / CHECKPOINT_DIR, cfg.checkpoint.keep_last, cfg.checkpoint.mirror_dir)
    session = Session(cfg, trainer, ckpt)
    trainer.on_step = session.on_step

    if resume or cfg.checkpoint.resume == "auto":
        path = ckpt.latest_valid(on_skip=lambda p, why: print(f"warning: checkpoint {p}: {why} — skipped", file=sys.stderr))
        if path is None:
            print("no valid checkpoint to resume from: starting fresh", file=sys.stderr)
        else:
            session.restore(path)
            truncate_metrics(out / METRICS_FILE, trainer.state.step)
            print(f"resumed from {path} (step {trainer.state.step})", flush=True)

    previous = _install_signal_handlers(trainer)
    try:
        result = trainer.run()
    finally:
        for sig, old in previous.items():  # the caller's handlers (Python's KeyboardInterrupt for SIGINT), not SIG_DFL
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
    if session.last_saved_step != trainer.state.step:
        path = session.save()
        print(f"checkpoint: {path}", flush=True)
    if result.stop_reason == "interrupted":
        print("stopped by signal; continue with --resume", flush=True)
        return 0
    final = out / FINAL_DIR
    save_model(trainer.model, final)
    tok.save(final)
    save_config(cfg, final / "config.yaml")
    if accuracy is not None and accuracy.samples:
        acc = (trainer.state.last_eval or {}).get("accuracy", math.nan)
        print(f"exact-match accuracy on {len(accuracy.samples)} held-out prompts: {acc:.3f}\n{accuracy.show()}")
    print(f"model, tokenizer and config: {final}", flush=True)
    return 0
