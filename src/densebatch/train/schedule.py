"""Batch-size schedule: the size of every optimizer step, relative to the target, as a function of its number.

A step's size is ``fraction(n)`` times the target (``world_size × grad_accum_batches`` planned
batches, or ``loss_tokens_per_step``), where ``n`` is the loader's own step count
(``StepLoader.set_step_fraction``; ``data/plan/steps.py`` cuts steps of any size, below one batch in rows)::

    fraction(n) = ramp(n) × scale(n)

    ramp   ramp_start ──────╱‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾   1 from ramp_steps on (steps), or from the step
                            0 ... ramp_steps            where ramp_steps full steps of data are consumed (tokens)
    scale  1 ‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾‾╲___________╲____    × backoff_factor after each plateau of
                                    plateau     plateau  backoff_patience evaluations (floor, cap, max)

- **Ramp** (``ramp_unit`` steps): ``ramp_start`` at the first step, linear to 1 at step ``ramp_steps``.
  ``tokens``: linear in the data consumed, ``ramp(n) = ramp_start + (1 - ramp_start) × u(n) /
  ramp_steps`` with ``u(n) = Σ_{k<n} fraction(k)`` (full steps' worth of data before step ``n``), as
  large pre-training runs ramp over tokens. ``u`` sums the *nominal* fractions, not measured tokens:
  the loader plans steps ahead in a background thread and every rank must agree without a
  collective, so the size of step ``n`` must follow from ``n`` alone. Measured tokens differ from the
  nominal share only by how whole rows round it (packed rows hold ~the same tokens each).
- **Back-off**: after ``backoff_patience`` evaluations in a row without a new best eval loss,
  ``scale`` is multiplied by ``backoff_factor`` (a factor above 1 grows steps instead), clamped to
  ``[backoff_floor, backoff_cap]``, at most ``backoff_max`` times. It applies from the next step;
  steps the loader prefetched at the old size are dropped, so the data order is unchanged: the
  following steps take the next rows of the plan, fewer (or more) of them per step.
- **Learning rate**: multiplied by ``fraction ** p``, ``p`` = 0, ½ or 1 (``lr_scaling`` none, sqrt,
  linear).

Exactness: eval losses are all-reduced, so every rank takes the same decisions; the state (the
changes, each from which step, and the plateau counters) is the trainer part ``batch_schedule``,
saved in every checkpoint, and a resumed run recomputes the same fractions bit for bit. A rollback
keeps this state, as it keeps the data position the fractions are indexed by.
"""

from __future__ import annotations

import math
import threading

from densebatch.config import BatchScheduleConfig
from densebatch.train.contracts import StepSource, TrainerHost

LR_POWERS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


class BatchSchedule:
    """The fractions of the target step size (``fraction(n)``), their learning-rate factors, and the
    trainer hooks that announce and decide changes (``attach``, ``before_step``, ``record``, ``after_step``)."""

    def __init__(
        self,
        ramp_steps: int = 0,
        ramp_start: float = 1.0,
        ramp_unit: str = "steps",
        backoff_patience: int = 0,
        backoff_factor: float = 0.5,
        backoff_floor: float = 0.125,
        backoff_cap: float = 4.0,
        backoff_max: int = 3,
        lr_scaling: str = "none",
    ):
        if ramp_unit not in ("steps", "tokens") or lr_scaling not in LR_POWERS:
            raise ValueError(
                f"BatchSchedule: ramp_unit {ramp_unit!r} (steps, tokens), lr_scaling {lr_scaling!r} {tuple(LR_POWERS)}"
            )
        if ramp_steps < 0 or (ramp_steps and not 0.0 < ramp_start <= 1.0):
            raise ValueError(f"BatchSchedule: ramp_steps {ramp_steps} >= 0, ramp_start {ramp_start} in (0, 1]")
        if backoff_patience and (backoff_factor <= 0.0 or not 0.0 < backoff_floor <= 1.0 <= backoff_cap):
            raise ValueError(
                f"BatchSchedule: factor {backoff_factor} > 0, floor {backoff_floor} in (0, 1], cap {backoff_cap} >= 1"
            )
        self.ramp_steps, self.ramp_start, self.ramp_unit = int(ramp_steps), float(ramp_start), ramp_unit
        self.backoff_patience, self.backoff_max = int(backoff_patience), int(backoff_max)
        self.backoff_factor, self.backoff_floor, self.backoff_cap = (
            float(backoff_factor),
            float(backoff_floor),
            float(backoff_cap),
        )
        self.lr_power = LR_POWERS[lr_scaling]
        self.changes: tuple[tuple[int, float], ...] = ()  # (loader step from which it applies, scale)
        self.best_loss: float | None = None
        self.bad_evals = 0  # evaluations since the best (reset by a change)
        self._lock = threading.Lock()  # the loader's prefetch thread asks for fractions too
        self._progress = [0.0]  # tokens ramp: u(n) for the n computed so far (up to the ramp's end)
        self._current = 0  # the loader step number of the step being trained
        self._loss_target: int | None = None

    @classmethod
    def from_config(cls, cfg: BatchScheduleConfig) -> BatchSchedule | None:
        """The schedule ``train.batch_schedule`` asks for, or None when neither a ramp nor a back-off is on."""
        if not cfg.ramp_steps and not cfg.backoff_patience:
            return None
        return cls(
            cfg.ramp_steps,
            cfg.ramp_start,
            cfg.ramp_unit,
            cfg.backoff_patience,
            cfg.backoff_factor,
            cfg.backoff_floor,
            cfg.backoff_cap,
            cfg.backoff_max,
            cfg.lr_scaling,
        )

    # ---------------------------------------------------------------------------- fractions
    def scale_at(self, n: int) -> float:
        scale = 1.0
        for start, value in self.changes:
            if n >= start:
                scale = value
        return scale

    def _ramp(self, u: float) -> float:
        return 1.0 if u >= self.ramp_steps else self.ramp_start + (1.0 - self.ramp_start) * (u / self.ramp_steps)

    def _progress_at(self, n: int) -> float:
        """u(n): full steps' worth of data before step ``n`` (computed once, in order; stops growing
        at the ramp's end, after which only ``u >= ramp_steps`` matters)."""
        with self._lock:
            u = self._progress
            while len(u) <= n and u[-1] < self.ramp_steps:
                k = len(u) - 1
                u.append(u[k] + self._ramp(u[k]) * self.scale_at(k))
            return u[min(n, len(u) - 1)]

    def ramp_at(self, n: int) -> float:
        if not self.ramp_steps:
            return 1.0
        return self._ramp(float(n) if self.ramp_unit == "steps" else self._progress_at(n))

    def fraction(self, n: int) -> float:
        """Size of loader step ``n`` as a fraction of the target (> 0); ``StepSource.set_step_fraction``."""
        return self.ramp_at(n) * self.scale_at(n)

    def lr_factor(self, n: int) -> float:
        return self.fraction(n) ** self.lr_power if self.lr_power else 1.0

    def steps_for(self, full_steps: float) -> int:
        """Steps that consume ``full_steps`` full steps' worth of data from the start (the schedule's
        horizon, ``optim.estimate_total_steps``): the ramp's smaller steps make more of them."""
        n, u = 0, 0.0
        while u < full_steps - 1e-9:
            if self.ramp_at(n) >= 1.0:
                return n + math.ceil((full_steps - u) / self.scale_at(n) - 1e-9)
            u, n = u + self.fraction(n), n + 1
        return n

    # ------------------------------------------------------------------------------ back-off
    def observe_eval(self, loss: float, next_step: int) -> str | None:
        """Count a plateau; on the ``backoff_patience``-th evaluation without a new best, change the
        scale from loader step ``next_step`` on. Returns why (for the event), or None (no change)."""
        if not self.backoff_patience or not math.isfinite(loss):
            return None
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss, self.bad_evals = loss, 0
            return None
        self.bad_evals += 1
        if self.bad_evals < self.backoff_patience or len(self.changes) >= self.backoff_max:
            return None
        old = self.scale_at(next_step)
        new = min(self.backoff_cap, max(self.backoff_floor, old * self.backoff_factor))
        if new == old:
            return None  # already at the floor (or the cap)
        with self._lock:
            self.changes = (*self.changes, (int(next_step), new))
            del self._progress[next_step + 1 :]  # u(k) for k <= next_step used only earlier fractions
        why = f"eval loss {loss:.4f} not below the best {self.best_loss:.4f} in {self.bad_evals} evaluation(s)"
        self.bad_evals = 0
        return why

    # ---------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"changes": [list(c) for c in self.changes], "best_loss": self.best_loss, "bad_evals": self.bad_evals}

    def load_state_dict(self, d: dict) -> None:
        with self._lock:
            self.changes = tuple((int(n), float(s)) for n, s in d["changes"])
            self._progress = [0.0]
        self.best_loss, self.bad_evals = d["best_loss"], int(d["bad_evals"])

    # --------------------------------------------------------------------------- trainer hooks
    def attach(self, data: StepSource) -> BatchSchedule:
        """Make ``data`` (a ``StepLoader``) cut its steps by ``fraction``."""
        data.set_step_fraction(self.fraction)  # a source that cannot cut its steps refuses (ValueError)
        self._loss_target = data.loss_tokens_per_step
        return self

    def before_step(self, trainer: TrainerHost) -> float:
        """As a step begins (``Trainer._set_lr``): note its loader step number, announce the ramp at the
        first step; returns the step's learning-rate factor."""
        self._current = int(trainer.data.state_dict()["steps"]) - 1  # the loader counts the step just handed out
        if self._current == 0 and self.ramp_steps:
            unit = "steps" if self.ramp_unit == "steps" else "full steps' worth of tokens"
            self._announce(trainer, 0, 0, "ramp_start", f"linear ramp to the target over {self.ramp_steps} {unit}")
        return self.lr_factor(self._current)

    def record(self) -> dict:
        """Fields of the step's train record: its fraction of the target (and loss-token target)."""
        f = self.fraction(self._current)
        return {"batch_fraction": f} | ({"target_loss_tokens": f * self._loss_target} if self._loss_target else {})

    def after_step(self, trainer: TrainerHost) -> None:
        """After the step's record and evaluation, before the session's checkpoint (which must hold any
        change): announce the ramp's end, act on a plateau of this step's evaluation."""
        st, nxt = trainer.state, self._current + 1
        if self.ramp_steps and self.ramp_at(nxt) >= 1.0 > self.ramp_at(self._current):
            self._announce(trainer, st.step, nxt, "ramp_end", "the ramp reached the target")
        loss = (st.last_eval or {}).get("loss") if st.last_eval_step == st.step else None
        if isinstance(loss, float) and (why := self.observe_eval(loss, nxt)) is not None:
            trainer.reset_data_iterator()  # prefetched steps were cut at the old size
            trainer.data.invalidate()
            self._announce(trainer, st.step, nxt, "backoff" if self.backoff_factor < 1.0 else "growth", why)

    def _announce(self, trainer: TrainerHost, step: int, n: int, reason: str, detail: str) -> None:
        """An event record (``step``: the steps completed when loader step ``n``, the first at the new
        size, begins) and a console line."""
        f = self.fraction(n)
        trainer.write_record({"kind": "batch_size", "step": step, "fraction": f, "reason": reason, "detail": detail})
        trainer.console.message(f"batch size: {f:.3g} of the target from step {step + 1} ({reason}: {detail})")
