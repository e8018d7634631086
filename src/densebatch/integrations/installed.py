"""What ``dense_batches`` sets on a trainer, recorded so that ``undo_dense_batches`` puts back exactly what was there.

Every attribute the drop-in gives a trainer (its ``get_train_dataloader``, ``compute_loss``,
``get_batch_samples``, ``loss_is_scaled_for_ga``) goes through ``Installed.set``, which keeps what the
instance held before (its own instance attribute, or none: the class's method then answers again once
the attribute is removed). The methods set are bound methods of module functions (``types.MethodType``)
that read their settings from the trainer's ``_densebatch`` (an ``Installed``), so nothing refers to
another trainer or model than the one it is called on. The model itself is never given anything
(``fused_forward.py``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

_ABSENT = object()
STATE = "_densebatch"  # the trainer's attribute holding its Installed
LINE = "densebatch_loss"  # the trainer's attribute holding the loss path's line (public: docs/python.md)


@dataclass
class Installed:
    """The attributes set on one trainer (``previous``: what each held before), the loader's settings, and
    the loss path's state (``hf_loss.LossPath``, or None before it is installed)."""

    loader: dict[str, Any]
    loss: Any = None
    previous: dict[str, Any] = field(default_factory=dict)

    def set(self, trainer, name: str, value) -> None:
        """``trainer.<name> = value``, keeping what the instance held before (the first time only)."""
        self.previous.setdefault(name, trainer.__dict__.get(name, _ABSENT))
        setattr(trainer, name, value)

    def bind(self, trainer, name: str, function) -> None:
        """``trainer.<name>`` becomes ``function`` bound to ``trainer``."""
        self.set(trainer, name, types.MethodType(function, trainer))

    def own(self, trainer, name: str):
        """The trainer's own ``name`` as it was before ``set``: its instance attribute, else its class's."""
        before = self.previous.get(name, _ABSENT)
        return getattr(type(trainer), name).__get__(trainer) if before is _ABSENT else before

    def undo(self, trainer) -> list[str]:
        """Put every attribute back as it was; the names restored, in the order they were set."""
        for name, before in self.previous.items():
            if before is _ABSENT:
                trainer.__dict__.pop(name, None)
            else:
                setattr(trainer, name, before)
        trainer.__dict__.pop(STATE, None)
        trainer.__dict__.pop(LINE, None)
        return list(self.previous)


def installed(trainer) -> Installed | None:
    """The trainer's ``Installed``, or None when ``dense_batches`` was not called on it (or was undone)."""
    return trainer.__dict__.get(STATE)
