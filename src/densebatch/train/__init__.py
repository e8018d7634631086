"""Training: the loop, AdamW and schedules, token-weighted evaluation, metrics and console output.

Consumes any iterator of ``densebatch.batch.Batch`` and any model with ``token_losses(batch)`` and
``layer_groups()``; imports nothing from ``densebatch.data`` or ``densebatch.model``.
"""

from densebatch.train.evaluate import EvalResult, evaluate
from densebatch.train.loop import Trainer, TrainResult, TrainState, resolve_device, skip_non_finite
from densebatch.train.monitor import METRICS_FILE, MetricsWriter, read_metrics, truncate_metrics
from densebatch.train.optim import build_optimizer, estimate_total_steps, lr_at, param_groups

__all__ = [
    "EvalResult",
    "evaluate",
    "Trainer",
    "TrainResult",
    "TrainState",
    "resolve_device",
    "skip_non_finite",
    "METRICS_FILE",
    "MetricsWriter",
    "read_metrics",
    "truncate_metrics",
    "build_optimizer",
    "estimate_total_steps",
    "lr_at",
    "param_groups",
]
