"""Training: the loop, AdamW and schedules, token-weighted evaluation, metrics and console output.

Consumes steps of ``densebatch.batch.Batch`` (or any iterable of batches) and any model with
``token_losses(batch)`` and ``layer_groups()``; imports nothing from ``densebatch.data`` or
``densebatch.model``. The session (``train/session.py``) holds the policy around the loop:
checkpoints, resume, rollbacks and signals; ``train/distributed.py`` the ranks and collectives.
"""

from densebatch.train.evaluate import EvalResult, evaluate
from densebatch.train.loop import StepOutcome, StepResult, Trainer, TrainResult, TrainState, resolve_device
from densebatch.train.observe.monitor import METRICS_FILE, MetricsWriter, read_metrics, truncate_metrics
from densebatch.train.optim import build_optimizer, estimate_total_steps, lr_at, param_groups

__all__ = [
    "EvalResult",
    "evaluate",
    "Trainer",
    "TrainResult",
    "TrainState",
    "resolve_device",
    "StepOutcome",
    "StepResult",
    "METRICS_FILE",
    "MetricsWriter",
    "read_metrics",
    "truncate_metrics",
    "build_optimizer",
    "estimate_total_steps",
    "lr_at",
    "param_groups",
]
