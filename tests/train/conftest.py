"""Test helpers for train/: a tiny stand-in model with the model interface, batch builders, a list loader.

Tests reach the helpers through the ``tiny`` fixture (test directories are not packages, and several
hold a ``conftest.py``, so importing one by name would be ambiguous).

The stand-in is position-wise (embedding → linear block → norm → head, no attention), so a token's
loss does not depend on which row or batch carries it: any difference between batchings in a loop
test is the loop's fault, not the model's.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from densebatch.batch import IGNORE_INDEX, Batch

VOCAB = 32


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 16, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # leave the global RNG alone (the tests check it)
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, dim)
            self.block = nn.Linear(dim, dim)
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
        self.poison_calls: set[int] = set()  # token_losses call indices that return NaN
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.block(self.embed(input_ids)))))  # (rows, T, vocab)

    def token_losses(self, batch: Batch) -> torch.Tensor:
        logits = self(batch.input_ids, batch.positions)
        losses = F.cross_entropy(
            logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(batch.labels.shape)  # (rows, T)
        if self.calls in self.poison_calls:
            losses = losses * float("nan")
        self.calls += 1
        return losses

    def layer_groups(self) -> dict:
        return {
            "embeddings": [self.embed.weight],
            "blocks": [self.block.weight, self.block.bias, self.norm.weight, self.norm.bias],
            "head": [self.head.weight],
        }


def make_docs(n: int, seed: int = 0, min_len: int = 2, max_len: int = 24, vocab: int = VOCAB) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (L,), generator=g) for L in lengths]


def collate(docs: list[torch.Tensor], pad_id: int = 0, seq_len: int | None = None) -> Batch:
    """One document per row, right-padded; the target of the last token of a document is -100."""
    T = seq_len or max(len(d) for d in docs)
    input_ids = torch.full((len(docs), T), pad_id, dtype=torch.int64)
    labels = torch.full((len(docs), T), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros((len(docs), T), dtype=torch.int64)
    for r, d in enumerate(docs):
        L = len(d)
        input_ids[r, :L] = d
        labels[r, : L - 1] = d[1:]
        positions[r, :L] = torch.arange(L)
        positions[r, L:] = torch.arange(T - L)  # the padding run is its own segment
    return Batch(input_ids, labels, positions, int((labels != IGNORE_INDEX).sum()), sum(len(d) for d in docs))


def batch_with_loss_tokens(n: int, seed: int = 0) -> Batch:
    """A one-row batch whose document has exactly ``n`` loss tokens."""
    return collate(make_docs(1, seed=seed, min_len=n + 1, max_len=n + 1))


class ListLoader:
    """A stand-in for a loader of single batches (the trainer groups them into steps): cycles over its
    batches forever, with epoch / position state."""

    def __init__(self, batches: list[Batch]):
        self.items = list(batches)
        self.batches_per_epoch = len(self.items)
        self.position = 0  # batches yielded so far, over all epochs

    @property
    def epoch(self) -> int:
        return self.position // self.batches_per_epoch

    def __iter__(self):
        while True:
            batch = self.items[self.position % self.batches_per_epoch]
            self.position += 1
            yield batch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def trainer(tmp_path, batches, cfg=None, eval_cfg=None, eval_data=None, evaluate_fn=None, dist=None, **parts):
    """A CPU ``Trainer`` of a ``TinyLM`` on ``batches``; ``parts``: guard, clipper, batch_schedule."""
    from densebatch.config import EvalConfig, TrainConfig
    from densebatch.train.loop import Trainer
    from densebatch.train.parts import Evaluation, Placement, Reporting, StepParts

    evaluation = Evaluation(eval_cfg or EvalConfig(), eval_data, evaluate_fn)
    cfg = cfg or TrainConfig(lr=1e-2, warmup_steps=0, progress=False, device="cpu")
    return Trainer(
        TinyLM(), batches, cfg, output_dir=tmp_path, evaluation=evaluation, placement=Placement("cpu", dist),
        parts=StepParts(**parts), reporting=Reporting(console=False),
    )  # fmt: skip


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.fixture
def tiny() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        trainer=trainer,
        flat_grad=flat_grad,
        TinyLM=TinyLM,
        make_docs=make_docs,
        collate=collate,
        batch_with_loss_tokens=batch_with_loss_tokens,
        ListLoader=ListLoader,
        VOCAB=VOCAB,
    )
