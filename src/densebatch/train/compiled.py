"""``train.compile``: compile what training runs, and count what was compiled.

``nn.Module.compile()`` wraps ``__call__`` only, and training never calls the model: it calls
``token_losses``. So the model's repeated blocks (``distributed.repeated_blocks``, what FSDP2 shards:
the GPT's blocks, a Hugging Face model's decoder layers) are compiled in place, with dynamic shapes;
attention runs eagerly between the compiled parts (``model/attention.py`` ``attend_eagerly``: its
plan's Python facts change every batch). A model without repeated blocks gets ``token_losses`` compiled.
Under FSDP2 the blocks are already sharded when they are compiled: ``module.compile()`` compiles the
block's whole ``__call__``, FSDP2's hooks included, so that order runs the same as compiling first
(tests/cli/test_distributed.py checks compiled FSDP against eager DDP). Every graph break counted is a call
of the eager attention, once per compiled frame that makes it and grad mode.

Shapes: with ``dynamic=True`` a token_budget epoch, whose every batch has a new (rows, T), compiles each
graph once; switching between training and evaluation (grad mode) compiles it once more. ``CompileCount``
reads dynamo's counters, so the run can say how many graphs it compiled and how many of those came
after the first step (recompiles), which the documented bound covers (docs/benchmarks.md, "Compile").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from densebatch.train.distributed import repeated_blocks


def compile_for_training(model: nn.Module) -> None:
    blocks = repeated_blocks(model)
    for block in blocks:
        block.compile(dynamic=True)
    if not blocks:
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
