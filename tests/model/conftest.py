"""Test helpers for the model tests: pack token lists into a Batch per the batch.py convention."""

from __future__ import annotations

import pytest
import torch

from densebatch.batch import IGNORE_INDEX, Batch


def pack(rows: list[list[list[int]]], seq_len: int | None = None, pad_id: int = 0) -> Batch:
    """``rows[r]`` is the list of documents (token lists) packed into row r, then padding to seq_len.

    Labels are the next token within a document, -100 at each document's last token and on padding;
    positions restart at 0 at each document and at the padding run.
    """
    T = seq_len or max(sum(len(d) for d in docs) for docs in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.int64)
    pos = torch.zeros((len(rows), T), dtype=torch.int64)
    real = 0
    for r, docs in enumerate(rows):
        t = 0
        for d in docs:
            n = len(d)
            ids[r, t : t + n] = torch.tensor(d)
            labels[r, t : t + n - 1] = torch.tensor(d[1:], dtype=torch.int64)
            pos[r, t : t + n] = torch.arange(n)
            t += n
        assert t <= T, "documents longer than the row"
        pos[r, t:] = torch.arange(T - t)
        real += t
    return Batch(ids, labels, pos, int((labels != IGNORE_INDEX).sum()), real)


def random_docs(gen: torch.Generator, lengths: list[int], vocab: int) -> list[list[int]]:
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)
