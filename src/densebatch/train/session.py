"""Training policy around the loop: periodic checkpoints, exact resume, rollbacks, signals.

``Session(trainer, checkpoints, ...)`` runs the trainer and decides what happens between its steps:

- **Checkpoints** hold the model, the optimizer (both in the world-size-independent form of
  ``train/checkpoint/portable.py``) and the trainer's named parts (``Trainer.parts()``: counters, data position,
  guard, clipper, fp16 scaler), plus every rank's RNG states, the number of ranks and the run's
  configuration. ``restore`` puts all of them back: the resumed run continues bit for bit.
- **Rollback** (the guard's verdict on a loss spike or on repeated non-finite steps): the weights,
  optimizer, scaler and clipper go back to the newest checkpoint and the learning rate is scaled by
  ``rollback_lr_factor``; the data position is *kept*, so every batch between that checkpoint and the
  spike is skipped, the spike's included (as PaLM does: replaying the same batches tends to reproduce
  the spike). Also kept: the guard's history (the spike never entered it), the RNGs, and the counters
  of what was consumed (``CONSUMED``: tokens, batches, epoch, skipped steps, wall time). Step numbers
  restart from the checkpoint's, so ``metrics.jsonl`` shows those step numbers twice. The rollback
  event lists the skipped steps and the document indices they held.
- **Signals**: SIGTERM / SIGINT finish the current step, then the run saves a checkpoint and stops
  (a second signal stops at once: exit 130; see ``install_signal_handlers``). Under torchrun every rank
  stops at the same step.
- **A checkpoint that cannot be written** (no space left on device) stops every rank with rank 0's
  one-line ``CheckpointError``; nothing half-written is left, the previous checkpoint stays the newest.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from densebatch.train.checkpoint.async_saves import CheckpointWriter
from densebatch.train.checkpoint.format import encode_tree
from densebatch.train.checkpoint.manager import CheckpointManager
from densebatch.train.checkpoint.portable import load_model_state, load_optimizer_state, model_state, optimizer_state
from densebatch.train.checkpoint.rng import capture_rng_state, restore_rng_state
from densebatch.train.loop import StepOutcome, StepResult, Trainer, TrainResult
from densebatch.train.observe.monitor import METRICS_FILE, MetricsWriter

# Counters of what was consumed (data, wall time, skipped steps): a rollback keeps them, because it
# keeps the data position too; only the weights and what depends on them go back.
CONSUMED = ("batches_seen", "real_tokens", "loss_tokens", "slot_tokens", "skipped_steps", "empty_steps", "epoch", "elapsed_s")
# Trainer parts a rollback restores from the checkpoint (the others keep their current state).
ROLLBACK_RESTORES = ("counters", "scaler", "clipper")


class Session:
    """One training run: the trainer plus its checkpoints, rollbacks and signal handling."""

    def __init__(
        self,
        trainer: Trainer,
        *,
        checkpoints: CheckpointManager,
        every_steps: int = 0,
        rollback_lr_factor: float = 0.5,
        config: dict | None = None,
        log: Callable[[str], None] | None = None,
        background_saves: bool = False,
    ):
        self.trainer, self.checkpoints = trainer, checkpoints
        self.writer = CheckpointWriter(checkpoints, trainer.dist, background_saves)  # every rank, in order
        self.every_steps, self.rollback_lr_factor, self.config = every_steps, rollback_lr_factor, config
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.last_saved_step = -1
        self.since_save: list[tuple[int, tuple[int, ...]]] = []  # (step, documents) after the last checkpoint
        self.rollbacks = 0
        trainer.after_step = self.after_step

    # ------------------------------------------------------------------------------ checkpoints
    def save(self) -> Path | None:
        """Write a checkpoint of the current step: model and optimizer in the portable form of
        ``train/checkpoint/portable.py`` (under FSDP every rank writes its own shards), the trainer's parts and every
        rank's RNG states (rank 0 writes those). Every rank takes part and returns once it is complete; a
        save that failed raises on every rank (none is left waiting at the next collective)."""
        t = self.trainer
        model, optim = model_state(t.model), optimizer_state(t.model, t.optimizer)
        rngs = t.dist.gather_object(capture_rng_state())
        extra = {"parts": t.trainer_state(), "rng": rngs, "config": self.config, "world_size": t.dist.world_size}
        path, blocked = self.writer.save(t.state.step, model, optim, extra)
        # blocked_s: what training waited; a background write's own seconds are known once it is done,
        # so each record carries the previous write's (write_s of a synchronous save is blocked_s)
        record = {"kind": "checkpoint", "step": t.state.step, "background": self.writer.background, "blocked_s": blocked}
        record["previous_write_s" if self.writer.background else "write_s"] = self.writer.previous_write_s
        t.write_record(record)
        self.last_saved_step = t.state.step
        self.since_save.clear()
        return path

    def _load(self, path: Path):
        """The checkpoint at ``path`` (verified already, by ``latest_valid``), each rank reading the rows of
        the shards its own model and optimizer hold (whole tensors on the CPU straight into them)."""
        t = self.trainer
        targets = {"model": keyed(model_state(t.model)), "optimizer": keyed(optimizer_state(t.model, t.optimizer))}
        return self.checkpoints.load(path, device="cpu", targets=targets, verified=True)

    def restore(self, path: Path) -> None:
        """Resume exactly: model, optimizer, every trainer part and every RNG from ``path``."""
        t = self.trainer
        ck = self._load(path)
        self._load_weights(ck)
        t.load_trainer_state(ck.extra_state["parts"])
        rngs = ck.extra_state["rng"]
        # Each rank continues its own random streams; on another world size the streams cannot all
        # continue (dropout masks then differ from the uninterrupted run; data order does not).
        restore_rng_state(rngs[t.dist.rank % len(rngs)])
        self.last_saved_step = t.state.step

    def _load_weights(self, ck) -> None:
        t = self.trainer
        load_model_state(t.model, ck.model_state)
        load_optimizer_state(t.model, t.optimizer, ck.optimizer_state)

    # -------------------------------------------------------------------------------- per step
    def after_step(self, result: StepResult) -> None:
        t = self.trainer
        self.since_save.append((t.state.step, result.step.documents))
        if result.outcome is StepOutcome.ROLLBACK:
            self.rollback(result)
        elif self.every_steps and t.state.step % self.every_steps == 0:
            self.save()

    def rollback(self, result: StepResult) -> None:
        """Back to the newest checkpoint's weights, keeping the data position (see the module docstring)."""
        t = self.trainer
        bad_step = t.state.step
        skipped = list(self.since_save)
        self.writer.wait()  # the newest checkpoint may be the one being written
        target = self.checkpoints.latest_valid()
        event: dict = {"kind": "rollback", "step": bad_step, "loss": result.record.get("loss")}
        if target is None:
            event["note"] = "no checkpoint to roll back to: the step was skipped only"
        else:
            consumed = {k: getattr(t.state, k) for k in CONSUMED}
            lr_scale = t.state.lr_scale * self.rollback_lr_factor
            ck = self._load(target)
            self._load_weights(ck)
            t.load_trainer_state(ck.extra_state["parts"], only=ROLLBACK_RESTORES)
            for k, v in consumed.items():
                setattr(t.state, k, v)
            t.state.lr_scale = lr_scale
            self.rollbacks += 1
            self.since_save.clear()
            event |= {
                "to_step": t.state.step,
                "lr_scale": lr_scale,
                "skipped_steps": [s for s, _ in skipped],
                "skipped_documents": sorted({d for _, docs in skipped for d in docs}),
            }
        t.write_record(event)
        where = f"back to step {event['to_step']}, learning rate x{event['lr_scale']:g}" if target else event["note"]
        if t.dist.is_main:
            self.log(f"\nrollback at step {bad_step}: {where}")

    # ------------------------------------------------------------------------------------- run
    def run(self) -> TrainResult:
        """Train; on the way out (a limit, early stopping or a signal) save a checkpoint of the last step.
        The signal handlers stay until that checkpoint is written: a second signal during it stops at once."""
        previous = install_signal_handlers(self.trainer, self.log)
        try:
            result = self.trainer.run()
            path = self._last_save() if self.last_saved_step != self.trainer.state.step else None
            path = self.writer.wait() or path  # the run ends once its last checkpoint is complete
            if path is not None:
                print(f"checkpoint: {path}", flush=True)
        finally:
            restore_signal_handlers(previous, stopped_by_signal=self.trainer.should_stop)
        return result

    def _last_save(self) -> Path | None:
        """``save`` once the trainer's run is over: its ``metrics.jsonl`` is closed by then (the run closes it
        whichever way it ends), so the main rank opens it again to append this checkpoint's record, as every
        other save's is (the trackers get it either way)."""
        t = self.trainer
        if t.dist.is_main and t.metrics is None:
            t.metrics = MetricsWriter(t.output_dir / METRICS_FILE)
        try:
            return self.save()
        finally:
            if t.metrics is not None:
                t.metrics.close()
                t.metrics = None


def keyed(state) -> dict:
    """The tensors of ``state`` by the keys a checkpoint stores them under (``encode_tree``'s paths)."""
    encode_tree(state, [], tensors := {})
    return tensors


def install_signal_handlers(trainer: Trainer, log: Callable[[str], None]) -> dict:
    """Route SIGTERM / SIGINT to ``trainer.should_stop``; returns the handlers they replace (to put back).

    The first signal asks the run to finish its step and save a checkpoint. A second one stops at once,
    whichever the signal: ``KeyboardInterrupt`` where the run is (a checkpoint being written is dropped,
    its temporary directory removed; the CLI prints "interrupted" and exits 130). A third one, while the
    second unwinds, ends the process on the spot with code 130. Outside the main thread (``train``
    called from a worker thread) signals cannot be caught: none."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    unwinding = [False]

    def handler(signum, frame):
        if unwinding[0]:
            _exit_now()
        if trainer.should_stop:  # a second signal: stop now
            unwinding[0] = True
            raise KeyboardInterrupt
        trainer.should_stop = True
        if trainer.dist.is_main:
            log(f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint")

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_signal_handlers(previous: dict, stopped_by_signal: bool = False) -> None:
    """Put back the handlers ``install_signal_handlers`` replaced (Python's KeyboardInterrupt for SIGINT).

    After a run stopped by a signal, the process is about to end, and a second signal must not kill it
    (an exit by signal, not the documented code): SIGTERM's default action becomes ``KeyboardInterrupt``
    (exit 130, as SIGINT's), and once the interpreter shuts down, signals are ignored (Python restores
    the default actions then, which would kill the process mid-exit; the stop is complete by that time,
    so its exit code stands)."""
    for sig, old in previous.items():
        if old in (None, signal.SIG_DFL) and stopped_by_signal:
            old = _stop_now
        signal.signal(sig, old if old is not None else signal.SIG_DFL)
    if stopped_by_signal and previous:
        atexit.unregister(_ignore_signals)  # once per process
        atexit.register(_ignore_signals)


def _stop_now(signum, frame) -> None:
    raise KeyboardInterrupt


def _ignore_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _exit_now() -> None:
    """End the process with code 130 at once (no cleanup): the user asked a third time."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a signal can land in the middle of a write (reentrant flush)
            pass
    os.write(2, b"\ndensebatch: interrupted\n")
    os._exit(130)
