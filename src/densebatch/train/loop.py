"""The training loop: turn an iterator of ``Batch`` into optimizer steps whose loss is exact in tokens.

A step gathers its batches first (``grad_accum_batches`` of them, or until ``loss_tokens_per_step``
loss tokens), counts the loss tokens of the whole step (over ranks, through ``all_reduce_sum``), then
back-propagates ``sum(per-token CE of the batch) / (loss tokens of the step)`` for each batch: the
gradient of one big batch, however the tokens were split; never a mean of micro-batch means.
The loop draws no random numbers, so a resumed run consumes the global RNGs exactly as a fresh one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from densebatch.batch import Batch
from densebatch.config import EvalConfig, TrainConfig
from densebatch.train.evaluate import autocast, check_precision, evaluate, to_device
from densebatch.train.guard import clip_gradients
from densebatch.train.monitor import METRICS_FILE, Console, MetricsWriter, format_summary
from densebatch.train.optim import build_optimizer, estimate_total_steps, lr_at


@dataclass
class TrainState:
    """Counters a resumed run needs besides model and optimizer tensors (JSON-able via ``asdict``)."""

    step: int = 0  # optimizer steps taken (skipped ones included)
    batches_seen: int = 0
    real_tokens: int = 0  # all ranks
    loss_tokens: int = 0
    slot_tokens: int = 0
    skipped_steps: int = 0
    total_steps: int | None = None  # schedule horizon, fixed at the first step
    lr_scale: float = 1.0  # multiplies the schedule (an anomaly guard lowers it after a rollback)
    best_eval_loss: float | None = None
    evals_without_improvement: int = 0
    last_eval_step: int = -1
    early_stopped: bool = False
    first_loss: float | None = None
    last_loss: float | None = None
    last_eval: dict | None = None
    elapsed_s: float = 0.0  # wall time over all sessions


@dataclass
class TrainResult:
    stop_reason: str  # max_steps | max_tokens | max_epochs | early_stopping | interrupted | data_exhausted
    summary: dict  # JSON-able facts (keys read by monitor.format_summary)
    text: str  # the one-screen summary, as printed


def skip_non_finite(loss: float, grad_norm: float) -> str:
    """Default pre-step check: a NaN/inf loss or gradient norm skips the update."""
    return "ok" if math.isfinite(loss) and math.isfinite(grad_norm) else "skip"


def resolve_device(name: str | torch.device) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Trainer:
    """Train ``model`` on ``batches`` under ``cfg``; ``run()`` until a limit, early stopping or ``should_stop``.

    Integration points: ``on_step(trainer, step)`` after every optimizer step (periodic checkpoints;
    ``last_record`` holds the step's metrics); ``step_check(loss, grad_norm) -> "ok" | "skip" | other``
    before the update (``AnomalyGuard.check`` fits; anything but "ok" leaves the weights unchanged and
    lands in the record's ``skipped``, e.g. "rollback" for ``on_step`` to act on); ``clipper`` with
    ``step(norm) -> limit`` (``AdaptiveClipper``; default: fixed ``grad_clip``); ``should_stop`` (set
    from a signal handler: the current step finishes, then the run stops without a final eval);
    ``state_dict()`` / ``load_state_dict()``; ``state.lr_scale``; ``metrics.write(record)`` during a run.
    ``eval_batches``: an iterable of Batch, or a zero-argument callable returning a fresh one (use the
    callable for a loader, e.g. ``lambda: loader.iter_epoch(0)``; a loader's own iterator never ends).
    ``evaluate_fn(model) -> dict`` adds entries (e.g. ``accuracy``) to every eval record; when it returns
    ``loss``, that loss drives early stopping. ``all_reduce_sum`` sums a tensor over ranks (identity when
    None); with DDP, whose gradient is a mean over ranks, pass ``world_size`` so the step stays a sum / N.
    """

    def __init__(
        self,
        model: nn.Module,
        batches: Iterable[Batch],
        cfg: TrainConfig,
        eval_cfg: EvalConfig | None = None,
        *,
        output_dir: str | Path,
        device: str | torch.device | None = None,
        eval_batches: Iterable[Batch] | Callable[[], Iterable[Batch]] | None = None,
        evaluate_fn: Callable[[nn.Module], dict] | None = None,
        total_steps: int | None = None,
        on_step: Callable[[Trainer, int], None] | None = None,
        step_check: Callable[[float, float], str] = skip_non_finite,
        clipper: Any = None,
        all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
        world_size: int = 1,
        rank: int = 0,
        console: bool = True,
    ):
        self.cfg, self.eval_cfg = cfg, eval_cfg or EvalConfig()
        self.device = resolve_device(device if device is not None else cfg.device)
        check_precision(self.device, cfg.precision)
        self.model = model.to(self.device)
        if cfg.compile:
            self.model.compile()  # in place: forward is compiled, state_dict keys stay unprefixed
        self.optimizer = build_optimizer(self.model, cfg)
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision == "fp16")
        self.batches, self.eval_batches, self.evaluate_fn = batches, eval_batches, evaluate_fn
        self.on_step, self.step_check, self.clipper = on_step, step_check, clipper
        self.all_reduce_sum, self.world_size, self.is_main = all_reduce_sum, world_size, rank == 0
        self.output_dir = Path(output_dir)
        self.state = TrainState(total_steps=total_steps)
        self.should_stop = False  # set from a signal handler: finish the current step, then stop
        self.metrics: MetricsWriter | None = None  # open during run(); callers may write their own records
        self.console = Console(None, 0, enabled=False)
        self._show_console = console and self.is_main
        self.last_record: dict | None = None  # the latest step's metrics record (for on_step)
        self._it = None  # created lazily so that load_state_dict() can reposition the loader first
        self._tick = self._mark = time.perf_counter()
        self._session_tokens, self._session_seconds = 0, 0.0

    # ------------------------------------------------------------------------------------ state
    def _stateful(self) -> tuple:
        # Duck-typed parts with their own state_dict(): the loader, the clipper, a guard whose bound
        # ``check`` is the step_check.
        return (("loader", self.batches), ("clipper", self.clipper), ("guard", getattr(self.step_check, "__self__", None)))

    def trainer_state(self) -> dict:
        """The JSON-able part of the resumable state: counters, scaler, loader / clipper / guard state."""
        out = dataclasses.asdict(self.state)
        out["scaler"] = self.scaler.state_dict()
        for key, obj in self._stateful():
            if hasattr(obj, "state_dict"):
                out[key] = obj.state_dict()
        return out

    def load_trainer_state(self, d: dict) -> None:
        names = {f.name for f in dataclasses.fields(TrainState)}
        self.state = TrainState(**{k: v for k, v in d.items() if k in names})
        if d.get("scaler"):
            self.scaler.load_state_dict(d["scaler"])
        for key, obj in self._stateful():
            if key in d and hasattr(obj, "load_state_dict"):
                obj.load_state_dict(d[key])
        self._it = None  # the next batch comes from the restored loader position

    def state_dict(self) -> dict:
        """``{"model": tensors, "optimizer": optimizer.state_dict(), "trainer": JSON-able dict}``."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "trainer": self.trainer_state()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_trainer_state(state["trainer"])

    # ------------------------------------------------------------------------------------- data
    def _batches_per_epoch(self) -> int | None:
        n = getattr(self.batches, "batches_per_epoch", None)
        if n is None and hasattr(self.batches, "__len__"):
            n = len(self.batches)
        return n or None

    def epoch(self) -> float:
        bpe = self._batches_per_epoch()
        return self.state.batches_seen / bpe if bpe else float(getattr(self.batches, "epoch", 0))

    def _next_batch(self) -> Batch | None:
        if self._it is None:
            self._it = iter(self.batches)
        try:
            return next(self._it)
        except StopIteration:
            # A re-iterable (a list) starts its next epoch; an exhausted generator yields nothing.
            self._it = iter(self.batches)
            return next(self._it, None)

    def next_step_batches(self) -> list[Batch]:
        """The batches of one optimizer step (fewer at the end of the data; empty when none are left)."""
        out, tokens = [], 0
        target = self.cfg.loss_tokens_per_step
        last = self._epoch_limit_batches()
        while (batch := self._next_batch()) is not None:
            out.append(batch)
            tokens += batch.num_loss_tokens
            if last is not None and self.state.batches_seen + len(out) >= last:
                break  # an epoch limit ends the step early rather than overshoot into the next epoch
            # Token-driven: a rank's share of the step's loss tokens (ranks see similar data).
            full = tokens * self.world_size >= target if target is not None else len(out) >= self.cfg.grad_accum_batches
            if full:
                break
        return out

    # ------------------------------------------------------------------------------------- step
    def _clock(self) -> float:
        """Add the wall time since the last call to ``state.elapsed_s``; return now."""
        now = time.perf_counter()
        self.state.elapsed_s += now - self._mark
        self._mark = now
        return now

    def _reduce(self, t: Tensor) -> Tensor:
        return self.all_reduce_sum(t) if self.all_reduce_sum is not None else t

    def forward_backward(self, batches: list[Batch]) -> dict:
        """Leave in ``.grad`` the gradient of (summed CE of the step) / (loss tokens of the step).

        Returns the step's loss and token counts (all ranks). Gradients are scaled by the fp16 loss
        scale when it is on (``scaler.unscale_`` undoes it).
        """
        self.optimizer.zero_grad(set_to_none=True)
        local = torch.tensor([sum(b.num_loss_tokens for b in batches)], dtype=torch.float64, device=self.device)
        total = float(self._reduce(local).item())  # known before any backward: the normaliser of every batch
        # DDP averages gradients over ranks; dividing by total / world_size turns that mean into sum / total.
        denom = total / self.world_size if total > 0 else math.inf
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # CE sum, real tokens, slots
        no_sync = getattr(self.model, "no_sync", None)  # DDP: all-reduce gradients on the last batch only
        for i, batch in enumerate(batches):
            batch = to_device(batch, self.device)
            sync = no_sync() if no_sync is not None and i < len(batches) - 1 else contextlib.nullcontext()
            with sync:
                with autocast(self.device, self.cfg.precision):
                    losses = self.model.token_losses(batch)  # (rows, T) float32, 0 where label == -100
                summed = losses.float().sum()
                self.scaler.scale(summed / denom).backward()
            sums[0] += summed.detach().double()
            sums[1] += batch.num_real_tokens
            sums[2] += batch.num_slots
        loss_sum, real, slots = self._reduce(sums).tolist()
        return {
            "loss": loss_sum / total if total > 0 else math.nan,
            "loss_tokens": int(total),
            "real_tokens": int(real),
            "slot_tokens": int(slots),
            "batches": len(batches),
        }

    def train_step(self, batches: list[Batch]) -> dict:
        """One optimizer step over ``batches``: schedule, forward/backward, clip, check, update, log, eval."""
        st, cfg = self.state, self.cfg
        if st.total_steps is None and st.step == 0:
            real = sum(b.num_real_tokens for b in batches) * self.world_size
            st.total_steps = estimate_total_steps(cfg, self._batches_per_epoch(), len(batches), real)
            self.console.set_total(st.total_steps)
        lr = lr_at(st.step, cfg, st.total_steps) * st.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_mult"]
        stats = self.forward_backward(batches)
        self.scaler.unscale_(self.optimizer)  # clip and check the true gradient, not the fp16-scaled one
        grad_norm, _ = clip_gradients(self._params, cfg.grad_clip, clipper=self.clipper)  # norm before clipping
        if self.scaler.is_enabled() and math.isfinite(stats["loss"]) and not math.isfinite(grad_norm):
            action = "overflow"  # fp16 loss scale too high: the scaler skips and lowers it; not an anomaly
        else:
            action = self.step_check(stats["loss"], grad_norm)
        if action == "ok":
            self.scaler.step(self.optimizer)  # with fp16, itself skips an update whose gradient overflowed
        else:
            st.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update()

        now = self._clock()
        seconds, self._tick = now - self._tick, now
        st.step += 1
        st.batches_seen += len(batches)
        for key in ("real_tokens", "loss_tokens", "slot_tokens"):
            setattr(st, key, getattr(st, key) + stats[key])
        self._session_tokens += stats["real_tokens"]
        self._session_seconds += seconds
        if action == "ok" and math.isfinite(stats["loss"]):
            st.first_loss = stats["loss"] if st.first_loss is None else st.first_loss
            st.last_loss = stats["loss"]
        rec = {
            "kind": "train",
            "step": st.step,
            "loss": stats["loss"],
            "lr": lr,
            "grad_norm": grad_norm,
            "loss_tokens": stats["loss_tokens"],
            "real_tokens": stats["real_tokens"],
            "slot_tokens": stats["slot_tokens"],
            "fill_rate": stats["real_tokens"] / max(1, stats["slot_tokens"]),
            "tokens_per_s": stats["real_tokens"] / seconds if seconds > 0 else 0.0,
            "elapsed_s": st.elapsed_s,
            "epoch": self.epoch(),
            "batches": stats["batches"],
        }
        if action != "ok":
            rec["skipped"] = str(getattr(action, "value", action))
        self.last_record = rec
        if self.metrics is not None and (st.step % cfg.log_every == 0 or action != "ok"):
            self.metrics.write(rec)
        self.console.step(rec, seconds)
        if self.eval_cfg.every_steps and st.step % self.eval_cfg.every_steps == 0:
            self.evaluate_now()
        if self.on_step is not None:
            self.on_step(self, st.step)
        self._tick = time.perf_counter()  # evaluation and checkpoints do not count against tokens/s
        return rec

    # ------------------------------------------------------------------------------------- eval
    def evaluate_now(self) -> dict | None:
        """Evaluate, record (metrics + console), and update early stopping. None when there is no eval."""
        if self.eval_batches is None and self.evaluate_fn is None:
            return None
        st = self.state
        rec: dict = {"kind": "eval", "step": st.step}
        if self.eval_batches is not None:
            source = self.eval_batches() if callable(self.eval_batches) else self.eval_batches
            result = evaluate(
                self.model,
                source,
                device=self.device,
                precision=self.cfg.precision,
                max_batches=self.eval_cfg.max_batches,
                all_reduce_sum=self.all_reduce_sum,
            )
            rec.update(result.as_dict())
        if self.evaluate_fn is not None:
            was_training = self.model.training
            self.model.eval()
            with torch.no_grad():
                rec.update(self.evaluate_fn(self.model))
            self.model.train(was_training)
        self._clock()
        rec["elapsed_s"] = st.elapsed_s
        st.last_eval_step, st.last_eval = st.step, rec
        loss = rec.get("loss")
        if isinstance(loss, float) and math.isfinite(loss):
            if st.best_eval_loss is None or loss < st.best_eval_loss:
                st.best_eval_loss, st.evals_without_improvement = loss, 0
            else:
                st.evals_without_improvement += 1
                if self.eval_cfg.patience and st.evals_without_improvement >= self.eval_cfg.patience:
                    st.early_stopped = True
        if self.metrics is not None:
            self.metrics.write(rec)
        self.console.eval(rec)
        return rec

    # -------------------------------------------------------------------------------------- run
    def stop_reason(self) -> str | None:
        st, cfg = self.state, self.cfg
        if self.should_stop:
            return "interrupted"
        if st.early_stopped:
            return "early_stopping"
        if cfg.max_steps is not None and st.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_tokens is not None and st.real_tokens >= cfg.max_tokens:
            return "max_tokens"
        last = self._epoch_limit_batches()
        if last is not None and st.batches_seen >= last:
            return "max_epochs"
        return None

    def _epoch_limit_batches(self) -> int | None:
        cfg = self.cfg
        epochs = cfg.max_epochs
        if epochs is None and cfg.max_steps is None and cfg.max_tokens is None:
            epochs = 1.0  # no limit at all: one pass over the data
        bpe = self._batches_per_epoch()
        return math.ceil(epochs * bpe - 1e-9) if epochs is not None and bpe else None  # 0.1 * 30 is 3.0000000000000004

    def run(self) -> TrainResult:
        """Train until a stop condition; evaluate at the end (not when interrupted); print the summary."""
        if self.is_main:
            # A fresh run starts its metrics afresh; a resumed one appends after the kept records.
            self.metrics = MetricsWriter(self.output_dir / METRICS_FILE, append=self.state.step > 0)
        self.console = Console(self.state.total_steps, self.state.step, enabled=self._show_console, progress=self.cfg.progress)
        self.model.train()
        self._tick = self._mark = time.perf_counter()
        try:
            while (reason := self.stop_reason()) is None:
                batches = self.next_step_batches()
                if not batches:
                    reason = "data_exhausted"
                    break
                self.train_step(batches)
            if reason != "interrupted" and self.state.last_eval_step != self.state.step:
                self.evaluate_now()
        finally:
            self.console.close()
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
        summary = self.summary(reason)
        text = format_summary(summary)
        if self._show_console:
            print(text, flush=True)
        return TrainResult(stop_reason=reason, summary=summary, text=text)

    def summary(self, stop_reason: str) -> dict:
        """The state's counters plus ``stop_reason``, ``steps``, ``fill_rate``, ``epoch``, ``final_loss``,
        ``final_eval``, this session's tokens and seconds, ``output_dir``."""
        st = self.state
        return dataclasses.asdict(st) | {
            "stop_reason": stop_reason,
            "steps": st.step,
            "fill_rate": st.real_tokens / max(1, st.slot_tokens),
            "epoch": self.epoch(),
            "final_loss": st.last_loss,
            "final_eval": st.last_eval,
            "session_seconds": self._session_seconds,
            "session_real_tokens": self._session_tokens,
            "output_dir": str(self.output_dir),
        }
