"""The training loop: turn steps of batches into optimizer updates whose loss is exact in tokens (one concept, 402 lines: a step, its evaluation and the run read in one place).

Each step's batches come planned (``Step``, from the data layer's ``StepLoader``; a plain iterable
of ``Batch`` is grouped here by ``grad_accum_batches`` / ``loss_tokens_per_step``). The loop counts
the loss tokens of the whole step over all ranks first, then back-propagates
``sum(per-token CE of each batch) / (loss tokens of the step)`` (each weighted by its source's weight
when ``train.source_balance`` gives a mixture's sources weights): the gradient of one big batch,
however the tokens were split into batches and ranks; never a mean of micro-batch means. A step
ends in one ``StepOutcome``: applied, empty (no loss tokens: nothing to learn, no update, not an
anomaly), skipped (non-finite loss or gradient), overflow (fp16 loss scale) or rollback (the guard
asks for the last checkpoint; ``train/session.py`` acts on it). The loop draws no random numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from densebatch.batch import Batch, Step
from densebatch.config import TrainConfig
from densebatch.train.batch_steps import BatchSteps
from densebatch.train.compiled import CompileCount, compile_for_training
from densebatch.train.contracts import StepSource
from densebatch.train.distributed import Distributed, TokenLosses, gradient_sync
from densebatch.train.evaluate import EvalResult, eval_record, evaluate
from densebatch.train.guard import AnomalyGuard, FixedClipper
from densebatch.train.observe.monitor import METRICS_FILE, Console, MetricsWriter, finish_run, format_summary, resource_usage
from densebatch.train.optim import build_optimizer, estimate_total_steps, lr_record, set_lrs
from densebatch.train.parallel.mesh import ContextRanks
from densebatch.train.parallel.shards import ShardedSteps, shard_batch
from densebatch.train.parts import Evaluation, Placement, Reporting, StepParts, load_parts
from densebatch.train.passes import OOMLog, Passes, accumulate
from densebatch.train.per_source import SourceLosses, SourceWeights, step_denominator
from densebatch.train.precision import allow_tf32, resolve_precision
from densebatch.train.state import (
    StepOutcome,
    StepResult,
    TrainResult,
    TrainState,
    rank_state_bytes,
    run_summary,
    step_record,
)
from densebatch.train.update import StepStats, apply_update


def resolve_device(name: str | torch.device) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Trainer:
    """Train ``model`` on ``data`` under ``cfg``: ``run()`` until a limit, early stopping or ``should_stop``.

    ``data`` is a ``StepSource`` (``train/contracts.py``: a ``StepLoader``) or any iterable of ``Batch``.
    The rest comes grouped (``train/parts.py``): ``evaluation`` (settings, eval batches, extra checks),
    ``placement`` (device, ranks, the wrapped forward), ``parts`` (guard, clipper, batch schedule) and
    ``reporting`` (console, sinks, health warnings, source names). Stateful components, each with
    ``state_dict`` / ``load_state_dict``, are listed by name in ``parts()``. ``after_step(result)`` runs
    after every step (the session: checkpoints, rollbacks).
    """

    def __init__(
        self,
        model: nn.Module,
        data: StepSource | Iterable[Batch],
        cfg: TrainConfig,
        *,
        output_dir: str | Path,
        evaluation: Evaluation | None = None,
        placement: Placement | None = None,
        parts: StepParts | None = None,
        reporting: Reporting | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        total_steps: int | None = None,
    ):
        evaluation = evaluation or Evaluation()
        placement = placement or Placement()
        parts = parts or StepParts()
        reporting = reporting or Reporting()
        self.cfg = cfg
        self.eval_cfg = evaluation.cfg
        self.dist = placement.dist or Distributed()
        self.device = resolve_device(placement.device if placement.device is not None else cfg.device)
        self.precision = resolve_precision(self.device, cfg.precision)  # auto: bf16 on a CUDA GPU that has it, else fp32
        self.tf32 = allow_tf32(self.device)
        self.model = model.to(self.device)
        self.compiled: CompileCount | None = None
        if cfg.compile:
            self.compiled = CompileCount.start()
            compile_for_training(self.model)
        self.forward = placement.forward if placement.forward is not None else TokenLosses(self.model)
        if optimizer is None:  # train.lr: auto: no rate until set_lr takes the range test's (it sets each step's rate itself)
            optimizer = build_optimizer(self.model, cfg if cfg.lr != "auto" else dataclasses.replace(cfg, lr=0.0))
        self.optimizer = optimizer
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]  # what the optimizer updates
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.data: StepSource = data if isinstance(data, StepSource) else BatchSteps(data, cfg)
        self.context = placement.context or ContextRanks()  # rows split over context ranks: each pass takes its columns
        if self.context.split:
            self.data = ShardedSteps(self.data, self.context)
        schedule = parts.batch_schedule
        self.batch_schedule = schedule.attach(self.data) if schedule is not None else None  # train/schedule.py
        self.guard = parts.guard if parts.guard is not None else AnomalyGuard(spike_zscore=0.0, max_bad_steps=None)
        self.clipper = parts.clipper if parts.clipper is not None else FixedClipper(cfg.grad_clip)
        self.eval_data = evaluation.data
        self.evaluate_fn = evaluation.extra
        self.objective = parts.objective  # a preference objective's steps (train/objectives/); None: sft
        names = reporting.source_names
        self.source_names = list(names) if names and len(names) > 1 else None  # with two or more: loss per source
        self.source_losses: SourceLosses | None = None  # the current step's, with two or more sources
        w = parts.source_weights  # all alike: the plain mean
        self.source_weights = SourceWeights(w, getattr(model, "weighs_losses", False)) if w and len(set(w)) > 1 else None
        self.after_step: Callable[[StepResult], None] | None = None
        self.output_dir = Path(output_dir)
        self.state = TrainState(total_steps=total_steps)
        self.should_stop = False  # set from a signal handler: finish the current step, then stop
        self.metrics: MetricsWriter | None = None  # open during run(); the session writes its events here
        self.sinks = list(reporting.sinks)
        self.health = reporting.health
        self.console = Console(None, initial_step=0, enabled=False)
        self._show_console = reporting.console and self.dist.is_main
        self._it: Iterator[Step] | None = None  # created lazily so that load_state_dict can reposition data
        self._mark = time.perf_counter()
        self._data_wait = 0.0  # seconds the last step waited for its data
        self._step_began = 0.0
        self._first_record = True  # the first record of this session carries rank_state_gb
        self._session_tokens = 0  # real tokens and seconds of this session (a resume starts a new one)
        self._session_seconds = 0.0
        self._facts: dict = {}  # the run's peak memory (per rank) and attention kernels, once the run has finished
        self.oom = OOMLog()  # the first out-of-memory split of the run is printed once (train/passes.py)

    def set_lr(self, lr: float) -> None:
        """The base learning rate from the next step on: under ``train.lr: auto`` the range test's rate, which
        the trainer needs before ``run()``."""
        self.cfg = dataclasses.replace(self.cfg, lr=lr)

    # ------------------------------------------------------------------------------------ state
    def parts(self) -> dict[str, Any]:
        """The JSON-able stateful parts a checkpoint stores beside model and optimizer, by name."""
        parts = {"counters": self.state, "scaler": self.scaler, "data": self.data, "guard": self.guard, "clipper": self.clipper}
        if self.batch_schedule is not None:
            parts["batch_schedule"] = self.batch_schedule
        if self.health is not None:
            parts["health"] = self.health
        return parts

    def trainer_state(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts().items()}

    def load_trainer_state(self, d: dict, only: Iterable[str] | None = None) -> None:
        """The saved parts back (``train/parts.py``'s ``load_parts``), then the data read from its new position."""
        load_parts(self.parts(), d, only)
        self.reset_data_iterator()

    def state_dict(self) -> dict:
        """``{"model": tensors, "optimizer": optimizer.state_dict(), "trainer": {part name: JSON-able}}``."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "trainer": self.trainer_state()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_trainer_state(state["trainer"])

    def reset_data_iterator(self) -> None:
        """The next step comes from the data's current state (after a restore or a fraction change)."""
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()  # stops its prefetch thread; prefetched steps are dropped
        self._it = None

    # ------------------------------------------------------------------------------------- step
    def _clock(self) -> float:
        now = time.perf_counter()
        self.state.elapsed_s += now - self._mark
        self._mark = now
        return now

    def forward_backward(self, batches: Iterable[Batch]) -> dict:
        """Leave in ``.grad`` the gradient of (summed CE of the step) / (loss tokens of the step).

        Returns the step's loss and token counts over all ranks. Gradients carry the fp16 loss scale
        when it is on (``scaler.unscale_`` removes it). The passes run in ``train/passes.py``: a batch that
        runs out of memory is split by rows and retried within the step (``oom_splits`` counts splits)."""
        if self.objective is not None:
            return self.objective.forward_backward(self, batches)
        batches = list(batches)
        local, total, denom = step_denominator(batches, self.source_weights, self.dist, self.device)
        sources = self.source_losses = SourceLosses(self.source_names, self.device) if self.source_names else None
        loss, splits = accumulate(self.passes(), batches, denom)
        # summed over ranks in one all-reduce; read back at the step's end with the gradient norm (StepStats.read)
        return StepStats.gather(batches, loss, splits=splits, sources=sources, total=total, has_targets=local > 0, dist=self.dist)

    def passes(self) -> Passes:
        """What the step's forward and backward passes use (``train/passes.py``)."""
        return Passes(
            forward=self.forward, optimizer=self.optimizer, scaler=self.scaler, device=self.device,
            precision=self.precision, dist=self.dist, sync=self.sync_gradients, source_losses=self.source_losses,
            console=self.console, oom=self.oom, source_weights=self.source_weights,
        )  # fmt: skip

    def sync_gradients(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradients are reduced over ranks on the step's last backward only (DDP ``no_sync``, FSDP2
        ``set_requires_gradient_sync``: train/distributed.py ``gradient_sync``)."""
        return gradient_sync(self.forward, last)

    def _set_lr(self, step: Step) -> float:
        st = self.state
        if st.total_steps is None and st.step == 0:  # the horizon, fixed once from the first step (all ranks)
            local = torch.tensor([float(sum(b.num_real_tokens for b in step.batches))], dtype=torch.float64)
            first_tokens = int(self.dist.all_reduce_sum(local.to(self.device)).item())
            st.total_steps = estimate_total_steps(self.cfg, self.data.steps_per_epoch(), first_tokens, self.batch_schedule)
            self.console.set_total(self.cfg.max_steps or st.total_steps)
        scale = st.lr_scale * (self.batch_schedule.before_step(self) if self.batch_schedule is not None else 1.0)
        return set_lrs(
            self.optimizer, step=st.step, cfg=self.cfg, total_steps=st.total_steps, scale=scale
        )  # per layer group (train/optim.py)

    def train_step(self, step: Step) -> StepResult:
        """One optimizer step: schedule, forward/backward, clip, verdict, update, log, evaluate."""
        t0 = time.perf_counter()
        lr = self._set_lr(step)
        stats = self.forward_backward(step.batches)
        t1 = time.perf_counter()
        outcome, grad_norm, limit = self.apply_update(stats)  # reads the device once: stats and gradient norm
        t2 = time.perf_counter()
        return self._finish_step(step, stats=stats, outcome=outcome, lr=lr, grad_norm=grad_norm, limit=limit, times=(t0, t1, t2))

    def apply_update(self, stats: dict, clipper=None, judge: bool = True) -> tuple[StepOutcome, float, float]:
        """``train/update.py``'s update on this trainer's optimizer, scaler and parameters (clipper: the trainer's
        unless given; ``judge``: ask the guard). Returns (outcome, norm before clipping, clip limit)."""
        clipper = clipper if clipper is not None else self.clipper
        return apply_update(
            self.optimizer,
            scaler=self.scaler,
            params=self.params,
            stats=stats,
            clipper=clipper,
            guard=self.guard if judge else None,
        )

    def _finish_step(self, step: Step, *, stats: dict, outcome: StepOutcome, lr, grad_norm, limit, times) -> StepResult:
        st = self.state
        now = self._clock()
        seconds = now - self._step_began
        st.count(step, stats, outcome)
        self._session_tokens += stats["real_tokens"]
        self._session_seconds += seconds
        t0, t1, t2 = times
        timing = {"data_wait_s": self._data_wait, "fwd_bwd_s": t1 - t0, "optimizer_s": t2 - t1, "step_s": seconds}
        rec = step_record(st, step=step, stats=stats, outcome=outcome, lr=lr, grad_norm=grad_norm, limit=limit, timing=timing)
        rec |= resource_usage(self.device)
        rec |= lr_record(self.optimizer, self.cfg) | (self.batch_schedule.record() if self.batch_schedule is not None else {})
        if st.step == 1 or self._first_record:  # what this rank holds: 1/N of DDP's under FSDP
            rec["rank_state_gb"] = rank_state_bytes(self.model, self.optimizer) / 1e9
            self._first_record = False
        self.write_record(rec, always=outcome is not StepOutcome.APPLIED or "oom_splits" in rec)
        self.console.step(rec, seconds)
        for warning in self.health.observe(rec) if self.health is not None else ():
            self.write_record(warning.as_record())
            self.console.message(f"warning: {warning}")
        result = StepResult(outcome, rec, step)
        if self.eval_cfg.every_steps and st.step % self.eval_cfg.every_steps == 0:
            self.evaluate_now()
        if self.batch_schedule is not None:  # may change the next steps' size: before the session checkpoints
            self.batch_schedule.after_step(self)
        if self.after_step is not None:
            self.after_step(result)
        return result

    def write_record(self, rec: dict, always: bool = False) -> None:
        """Write ``rec`` to metrics.jsonl and the sinks (a train record only every ``log_every`` steps unless ``always``)."""
        if rec.get("kind") != "train" or always or rec["step"] % self.cfg.log_every == 0:
            if self.metrics is not None:
                self.metrics.write(rec)
            for sink in self.sinks:
                sink.write(rec)

    # ------------------------------------------------------------------------------------- eval
    def evaluate_batches(self, batches: Iterable[Batch], max_batches: int | None = None) -> EvalResult:
        """``evaluate`` on ``batches`` through this trainer's model wrapper, device, precision and ranks."""
        if self.objective is not None:
            return self.objective.evaluate(self, batches, max_batches)
        if self.context.split:
            batches = (shard_batch(b, self.context) for b in batches)
        return evaluate(
            self.model, batches, device=self.device, precision=self.precision, max_batches=max_batches,
            all_reduce_sum=self.dist.all_reduce_sum if self.dist.enabled else None, forward=self.forward,
            source_names=self.source_names,
        )  # fmt: skip

    def evaluate_now(self) -> dict | None:
        """Evaluate, record (metrics + console), and update early stopping. None when there is no eval."""
        if self.eval_data is None and self.evaluate_fn is None:
            return None
        rec = eval_record(
            self.model, self.state.step, data=self.eval_data, max_batches=self.eval_cfg.max_batches,
            evaluate_batches=self.evaluate_batches, extra=self.evaluate_fn,
        )  # fmt: skip
        self._clock()
        rec["elapsed_s"] = self.state.elapsed_s
        self.state.note_eval(rec, self.eval_cfg.patience)  # kept for the schedule and the summary; early stopping
        self.write_record(rec)
        self.console.eval(rec)
        return rec

    # -------------------------------------------------------------------------------------- run
    def stop_reason(self) -> str | None:
        st = self.state
        cfg = self.cfg
        if self.dist.agree(self.should_stop):  # a signal may reach one rank only: all stop together
            self.should_stop = True
            return "interrupted"
        if st.early_stopped:
            return "early_stopping"
        if cfg.max_steps is not None and st.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_tokens is not None and st.real_tokens >= cfg.max_tokens:
            return "max_tokens"
        return None

    def _epoch_limit(self) -> float | None:
        """``train.max_epochs``; without it, one pass when no other limit is set, else None (no epoch limit)."""
        c = self.cfg
        if c.max_epochs is not None:
            return c.max_epochs
        if c.max_steps is None and c.max_tokens is None:
            return 1.0
        return None

    def next_step(self) -> Step | None:
        """The next step of data (None when the data ends: max_epochs, or a finite iterable)."""
        if self._it is None:
            self.data.max_epochs = self._epoch_limit()
            self._it = iter(self.data)
        t = time.perf_counter()
        step = next(self._it, None)
        self._data_wait = time.perf_counter() - t
        return step

    def run(self) -> TrainResult:
        """Train until a stop condition; evaluate at the end (not when interrupted); print the summary."""
        if self.cfg.lr == "auto":
            raise ValueError("train.lr: auto: give the trainer its rate first (set_lr; run/auto.py resolve_lr)")
        if self.dist.is_main:
            # A fresh run starts its metrics afresh; a resumed one appends after the kept records.
            self.metrics = MetricsWriter(self.output_dir / METRICS_FILE, append=self.state.step > 0)
        total = self.cfg.max_steps or self.state.total_steps
        self.console = Console(total, initial_step=self.state.step, enabled=self._show_console, progress=self.cfg.progress)
        self.model.train()
        self._mark = time.perf_counter()
        try:
            while (reason := self.stop_reason()) is None:
                self._step_began = time.perf_counter()
                step = self.next_step()
                if step is None:
                    reason = "max_epochs" if self._epoch_limit() is not None else "data_exhausted"
                    break
                self.train_step(step)
                if self.compiled is not None:
                    self.compiled.after_step()
            if reason != "interrupted" and self.state.last_eval_step != self.state.step:
                self.evaluate_now()
            self._facts = finish_run(
                self.device, gather=self.dist.gather_object, write=self.write_record, step=self.state.step, reason=reason
            )
        finally:
            # Stop the loader's prefetch thread now: left to interpreter shutdown, a daemon thread inside
            # a torch op is killed mid-call ("terminate called without an active exception", SIGABRT).
            # The loader's position is that of the last step taken, so a later run() resumes exactly.
            self.reset_data_iterator()
            self.console.close()
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
        summary = self.summary(reason)
        text = format_summary(summary)
        if self.health is not None and self.health.warnings:
            text += "\n" + self.health.format_summary()
        if self.compiled is not None:
            text += "\n" + self.compiled.line()
        if self._show_console:
            print(text, flush=True)
        return TrainResult(stop_reason=reason, summary=summary, text=text)

    def summary(self, stop_reason: str) -> dict:
        """``train/state.py``'s ``run_summary`` of this run: counters, this session, where and how it ran."""
        precision = self.precision + (" (auto)" if self.cfg.precision == "auto" else "")
        return run_summary(
            self.state, stop_reason=stop_reason, session_seconds=self._session_seconds, session_tokens=self._session_tokens,
            output_dir=self.output_dir, processes=self.dist.world_size, device=self.device,
            precision=precision + (", TF32 matmuls" if self.tf32 else ""),
            compiled=self.compiled.record() if self.compiled is not None else {},
            warnings=[w.as_record() for w in self.health.summary()] if self.health is not None else [],
        ) | self._facts  # fmt: skip
