"""Build a ``Batch`` of packed documents from plain token lists (per the batch.py convention), for model tests.

``pack`` is a per-token Python reference, independent of the data layer's vectorised collate, so a
model test does not depend on the collator it might be checking.
"""

from __future__ import annotations

import torch

from densebatch.batch import IGNORE_INDEX, Batch, segment_bounds

# Three rows of packed document lengths, one document of length 1 (it carries no target).
PACKED_LENGTHS = [[7, 12, 5], [20], [3, 9, 1, 6]]


def pack(rows: list[list[list[int]]], seq_len: int | None = None, pad_id: int = 0) -> Batch:
    """``rows[r]`` is the list of documents (token lists) packed into row r, then padding to seq_len.

    Labels are the next token within a document, -100 at each document's last token and on padding;
    positions restart at 0 at each document and at the padding run.
    """
    T = seq_len or max(sum(len(d) for d in docs) for docs in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.int64)  # (rows, T)
    labels = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.int64)  # (rows, T)
    pos = torch.zeros((len(rows), T), dtype=torch.int64)  # (rows, T)
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
    cu, longest = segment_bounds(pos)
    return Batch(ids, labels, pos, int((labels != IGNORE_INDEX).sum()), real, cu_seqlens=cu, max_seqlen=longest)


def random_docs(gen: torch.Generator, lengths: list[int], vocab: int) -> list[list[int]]:
    """One document of random ids in [1, vocab) per length (0 is left for padding)."""
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]
