"""The values a training step produces and the counters a run keeps: outcomes, results, state.

``StepOutcome`` is how a step ended (a value, not a log string: the session acts on it);
``TrainState`` the counters a resume restores; ``StepResult`` / ``TrainResult`` what the loop hands
back per step and per run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor, nn

from densebatch.batch import Step


class StepOutcome(str, Enum):
    APPLIED = "applied"
    EMPTY = "empty"  # the step held no loss tokens: no update, not an anomaly
    SKIPPED = "skipped"  # non-finite loss or gradient norm: weights unchanged
    OVERFLOW = "overflow"  # fp16 loss scale too high: the scaler skipped the update and lowers the scale
    ROLLBACK = "rollback"  # a spike or repeated non-finite steps: weights unchanged, the session rolls back

    def __str__(self) -> str:
        return self.value


@dataclass
class TrainState:
    """Counters a resumed run needs besides model and optimizer tensors (JSON-able via ``asdict``)."""

    step: int = 0  # optimizer steps taken (every outcome counts)
    batches_seen: int = 0  # planned batches over all ranks
    real_tokens: int = 0  # all ranks
    loss_tokens: int = 0
    slot_tokens: int = 0
    skipped_steps: int = 0  # skipped, overflow and rollback outcomes
    empty_steps: int = 0
    epoch: float = 0.0  # position in the data after the last step, in epochs
    total_steps: int | None = None  # schedule horizon, fixed at the first step
    lr_scale: float = 1.0  # multiplies the schedule (lowered after a rollback)
    best_eval_loss: float | None = None
    evals_without_improvement: int = 0
    last_eval_step: int = -1
    early_stopped: bool = False
    first_loss: float | None = None
    last_loss: float | None = None
    last_eval: dict | None = None
    elapsed_s: float = 0.0  # wall time over all sessions

    def count(self, step: Step, stats: dict, outcome: StepOutcome) -> None:
        """Add a finished step (its stats over all ranks) to the counters."""
        self.step += 1
        self.batches_seen += step.num_batches or stats["batches"]
        self.epoch = step.epoch
        self.real_tokens += stats["real_tokens"]
        self.loss_tokens += stats["loss_tokens"]
        self.slot_tokens += stats["slot_tokens"]
        self.skipped_steps += outcome in (StepOutcome.SKIPPED, StepOutcome.OVERFLOW, StepOutcome.ROLLBACK)
        self.empty_steps += outcome is StepOutcome.EMPTY
        if outcome is StepOutcome.APPLIED:
            self.first_loss = stats["loss"] if self.first_loss is None else self.first_loss
            self.last_loss = stats["loss"]

    def note_eval(self, rec: dict, patience: int | None) -> None:
        """Keep an evaluation's record (``last_eval``, at ``last_eval_step``), and early stopping: a finite eval
        loss below the best so far resets the count of evaluations without improvement; otherwise it
        counts, and ``patience`` of them in a row (0 / None: never) stop the run."""
        self.last_eval_step = self.step
        self.last_eval = rec
        loss = rec.get("loss")
        if not (isinstance(loss, float) and math.isfinite(loss)):
            return
        if self.best_eval_loss is None or loss < self.best_eval_loss:
            self.best_eval_loss, self.evals_without_improvement = loss, 0
        else:
            self.evals_without_improvement += 1
            if patience and self.evals_without_improvement >= patience:
                self.early_stopped = True

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict) -> None:
        names = {f.name for f in dataclasses.fields(self)}
        for k, v in d.items():
            if k in names:
                setattr(self, k, v)


@dataclass
class StepResult:
    outcome: StepOutcome
    record: dict  # the metrics record of the step
    step: Step


@dataclass
class TrainResult:
    stop_reason: str  # max_steps | max_tokens | max_epochs | early_stopping | interrupted | data_exhausted
    summary: dict  # JSON-able facts (keys read by monitor.format_summary)
    text: str  # the one-screen summary, as printed


def rank_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state held by this rank (local shards under FSDP)."""

    def local(t: Tensor) -> Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def step_record(st: TrainState, *, step: Step, stats: dict, outcome: StepOutcome, lr, grad_norm, limit, timing: dict) -> dict:
    """The ``"kind": "train"`` record of a finished step (figures over all ranks); the documents of a
    step whose update was not applied, for a post-mortem; per-source losses and out-of-memory splits
    when there are any."""
    seconds = timing["step_s"]
    rec = {
        "kind": "train",
        "step": st.step,
        "outcome": str(outcome),
        "loss": stats["loss"],
        "lr": lr,
        "grad_norm": grad_norm,
        "clip_limit": limit,
        "loss_tokens": stats["loss_tokens"],
        "real_tokens": stats["real_tokens"],
        "slot_tokens": stats["slot_tokens"],
        "fill_rate": stats["real_tokens"] / max(1, stats["slot_tokens"]),
        "tokens_per_s": stats["real_tokens"] / seconds if seconds > 0 else 0.0,
        "batches": step.num_batches or stats["batches"],
        "epoch": step.epoch,
        "elapsed_s": st.elapsed_s,
        **timing,
    }
    if outcome not in (StepOutcome.APPLIED, StepOutcome.EMPTY):
        rec["documents"] = list(step.documents)
    for key in ("loss_by_source", "loss_tokens_share_by_source"):
        if key in stats:
            rec[key] = stats[key]
    rec.update(stats.get("record", {}))  # an objective's own metrics (train/objectives/steps.py)
    if stats.get("oom_splits"):  # a batch ran out of memory and was split by rows (train/passes.py)
        rec["oom_splits"] = stats["oom_splits"]
    return rec


def run_summary(
    st: TrainState,
    *,
    stop_reason: str,
    session_seconds: float,
    session_tokens: int,
    output_dir,
    processes: int,
    device,
    precision: str,
    compiled: dict,
    warnings: list,
) -> dict:
    """What a finished run reports (the keys ``observe/monitor.format_summary`` reads): the counters plus
    ``stop_reason``, ``steps``, ``fill_rate``, ``final_loss``, ``final_eval``, this session's seconds and
    real tokens, ``output_dir``, the processes, device and precision it ran on, the compile counts
    (``train/compiled.py``) and the health warnings given."""
    return dataclasses.asdict(st) | {
        "stop_reason": stop_reason,
        "steps": st.step,
        "fill_rate": st.real_tokens / max(1, st.slot_tokens),
        "final_loss": st.last_loss,
        "final_eval": st.last_eval,
        "session_seconds": session_seconds,
        "session_real_tokens": session_tokens,
        "output_dir": str(output_dir),
        "processes": processes,
        "device": str(device),
        "precision": precision,
        **compiled,
        "warnings": warnings,
    }
