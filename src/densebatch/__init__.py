"""densebatch: train causal language models with dense batches (packed or token-budget).

The public Python API (docs/python.md) is what this package itself exports; every other module is
internal. Names load on first use, so ``import densebatch`` (and ``densebatch prepare``) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    # planning from lengths
    "PlanSettings": "densebatch.data.plan.planner",
    "Plan": "densebatch.data.plan.planner",
    "plan_epoch": "densebatch.data.plan.planner",
    # collation
    "Batch": "densebatch.batch",
    "IGNORE_INDEX": "densebatch.batch",
    "CausalCollator": "densebatch.data.load.collate",
    "MaskedLMCollator": "densebatch.data.load.collate",
    # torch.utils.data
    "Piece": "densebatch.data.torch_loader",
    "Documents": "densebatch.data.torch_loader",
    "DenseBatchSampler": "densebatch.data.torch_loader",
    "Collator": "densebatch.data.torch_loader",
    "DenseDataLoader": "densebatch.data.torch_loader",
    "dataloader": "densebatch.data.torch_loader",
    "to_hf": "densebatch.data.torch_loader",
    "num_items": "densebatch.data.torch_loader",
    "causal_loss": "densebatch.data.torch_loader",
    # Hugging Face Trainer / TRL
    "dense_batches": "densebatch.integrations.hf_trainer",
    "register_attention": "densebatch.integrations.hf_trainer",
    "undo_dense_batches": "densebatch.integrations.hf_trainer",
}
__all__ = [  # the names of _EXPORTS (a test checks they agree)
    "IGNORE_INDEX",
    "Batch",
    "CausalCollator",
    "Collator",
    "DenseBatchSampler",
    "DenseDataLoader",
    "Documents",
    "MaskedLMCollator",
    "Piece",
    "Plan",
    "PlanSettings",
    "__version__",
    "causal_loss",
    "dataloader",
    "dense_batches",
    "num_items",
    "plan_epoch",
    "register_attention",
    "to_hf",
    "undo_dense_batches",
]

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from densebatch.batch import IGNORE_INDEX, Batch
    from densebatch.data.load.collate import CausalCollator, MaskedLMCollator
    from densebatch.data.plan.planner import Plan, PlanSettings, plan_epoch
    from densebatch.data.torch_loader import (
        Collator,
        DenseBatchSampler,
        DenseDataLoader,
        Documents,
        Piece,
        causal_loss,
        dataloader,
        num_items,
        to_hf,
    )
    from densebatch.integrations.hf_trainer import dense_batches, register_attention, undo_dense_batches


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'densebatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
