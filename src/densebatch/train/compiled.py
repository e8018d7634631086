"""``train.compile``: compile what training runs, and count what was compiled.

``nn.Module.compile()`` wraps ``__call__`` only, and training never calls the model: it calls
``token_losses``. So a model that offers ``compile_blocks`` (the reference GPT, the Hugging Face adapter)
compiles its repeated blocks in place, with dynamic shapes, attention kept eager between the compiled
parts (its plan's Python facts change every batch); any other model gets ``token_losses`` compiled.

Shapes: with ``dynamic=True`` a token_budget epoch, whose every batch has a new (rows, T), compiles each
graph once; switching between training and evaluation (grad mode) compiles it once more. ``CompileCount``
reads dynamo's counters, so the run can say how many graphs it compiled and how many of those came
after the first step (recompiles), which the documented bound covers (docs/benchmarks.md, "Compile").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def compile_for_training(model: nn.Module) -> None:
    blocks = getattr(model, "compile_blocks", None)
    if callable(blocks):
        blocks()
    else:
        model.token_losses = torch.compile(model.token_losses, dynamic=True)


def _counters() -> tuple[int, int]:
    """(graphs compiled so far, graph breaks so far) in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


@dataclass
class CompileCount:
    """Graphs compiled by this run: before and after its first training step."""

    base: int = 0
    first: int | None = None

    @classmethod
    def start(cls) -> CompileCount:
        return cls(base=_counters()[0])

    def after_step(self) -> None:
        if self.first is None:
            self.first = _counters()[0] - self.base

    def record(self) -> dict:
        graphs, breaks = _counters()
        graphs -= self.base
        first = self.first if self.first is not None else graphs
        return {"compiled_graphs": graphs, "recompiled_graphs": graphs - first, "graph_breaks": breaks}

    def line(self) -> str:
        r = self.record()
        return (
            f"compile: {r['compiled_graphs']} graphs ({r['compiled_graphs'] - r['recompiled_graphs']} at the first step, "
            f"{r['recompiled_graphs']} after it), {r['graph_breaks']} graph breaks (attention runs eagerly between compiled parts)"
        )
