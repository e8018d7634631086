"""Collation of preference pairs: rows of whole pairs into a ``Batch`` with ``pairs`` (``batch.Pairs``), vectorised.

A planned piece of a pair store is a whole pair (``(doc, 0, length)``; a cut pair is a ``DataError``, never
collated). Each pair is laid as its store holds it (``data/store/pair_layout.py``) when the model can keep
the rejected branch from the chosen one (``shared``)::

    stored     p0 p1 | p2 c0 c1 E | p2 r0 E            prompt p0 p1 p2, chosen c0 c1 E, rejected r0 E
    input_ids  p0 p1   p2 c0 c1 E   p2 r0 E
    positions  0  1    2  3  4  5   2  3  4            the rejected branch continues the prompt's positions
    branches   0  0    1  1  1  1   2  2  2            (rejected never attends to chosen)
    labels     .  .    c0 c1 E  .   r0 E  .            (. = -100; the prompt's with prompt_targets: p1 p2 at 0, 1)

or, for a kernel that cannot (``shared`` False), with the prompt laid twice as two plain segments::

    input_ids  p0 p1 p2 c0 c1 E | p0 p1 p2 r0 E
    positions  0  1  2  3  4  5 | 0  1  2  3  4

Either way every answer token's target and position is the same, so per-pair sums do not depend on the
layout. ``pairs.answer`` names each answer target's pair and side (2k chosen, 2k + 1 rejected);
``prompt_targets`` (ORPO, whose cross-entropy covers the chosen sequence whole) also labels the prompt's
tokens, once, and ``pairs.prompt`` names them. ``reference``: a table of the reference model's summed
log-probabilities per stored pair (train.reference: precompute), handed out with the batch's pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from densebatch.batch import IGNORE_INDEX, Batch, Pairs
from densebatch.data.load.collate import Row
from densebatch.data.store.pair_layout import REJECTED, loss_bit, pair_spans, part_of
from densebatch.data.store.store import DocumentStore, read_ranges
from densebatch.errors import DataError


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(a, a + n)`` for each (a, n), vectorised."""
    total = int(lens.sum())
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)


def laid_lengths(lengths: np.ndarray, prefixes: np.ndarray | None, shared: bool) -> np.ndarray:
    """Each pair's length in a row: as stored when ``shared``, else with its prompt's first tokens again
    (``prefixes``: those counts, ``pair_layout.pair_spans``' first column)."""
    lengths = np.asarray(lengths, np.int64)
    return lengths if shared else lengths + np.asarray(prefixes, np.int64)


class PairCollator:
    """Rows of whole pairs → one ``Batch`` with ``pairs`` (module docstring)."""

    masked_rate: float | None = None  # targets: the store's loss mask (the loader counts them from it)

    def __init__(
        self,
        pad_id: int,
        pad_to_multiple_of: int = 1,
        *,
        shared: bool = True,
        prompt_targets: bool = False,
        reference: np.ndarray | None = None,
    ):
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of: expected a positive integer; got {pad_to_multiple_of}")
        self.pad_id, self.pad_to_multiple_of = int(pad_id), int(pad_to_multiple_of)
        self.shared, self.prompt_targets = shared, prompt_targets
        self.reference = reference  # (pairs of the store, 2) float64, or None

    def __call__(self, store: DocumentStore, rows: Sequence[Row], step: tuple[int, int] = (0, 0)) -> Batch:
        pieces = [p for row in rows for p in row]
        nrows = len(rows)
        doc, start, stop = (np.array(pieces, np.int64).reshape(-1, 3).T) if pieces else (np.zeros(0, np.int64),) * 3
        row_of = np.repeat(np.arange(nrows), [len(r) for r in rows])
        first, length = store.doc_spans(doc)
        tok = read_ranges(store.tokens, first, first + length).astype(np.int64)
        msk = read_ranges(store.loss_mask, first, first + length)
        prefix, cb, _ = pair_spans(msk, length).T  # (n,) each
        laid_as = laid_lengths(length, prefix, self.shared)  # what the planner was told
        if ((start != 0) | (stop != laid_as)).any():
            bad = int(np.flatnonzero((start != 0) | (stop != laid_as))[0])
            raise DataError(
                f"pair {int(doc[bad])} was planned cut ({int(start[bad])}, {int(stop[bad])} of {int(laid_as[bad])} tokens): a "
                "pair is collated whole (raise the row length, batching.seq_len, or lower data.max_seq_len)"
            )
        base = np.cumsum(length) - length  # each pair's first token in tok
        # What each pair lays, as ranges of its stored tokens: the whole pair, or [prefix + chosen] [prefix] [rejected]
        if self.shared:
            r_pair, r_start, r_len, r_block = np.arange(len(doc)), np.zeros(len(doc), np.int64), length, np.ones(len(doc), bool)
        else:
            n = len(doc)
            r_pair = np.repeat(np.arange(n), 3)
            r_start = np.stack([np.zeros(n, np.int64), np.zeros(n, np.int64), prefix + cb], 1).reshape(-1)
            r_len = np.stack([prefix + cb, prefix, length - prefix - cb], 1).reshape(-1)
            r_block = np.tile([True, True, False], n)  # a block (a causal sequence) starts with ranges 0 and 1
            r_second = np.tile([False, True, True], n)  # the second block: its prompt tokens are no target
        k = _ranges(r_start, r_len)  # (laid,) each laid token's index in its pair as stored
        pair = np.repeat(r_pair, r_len)  # (laid,)
        src = base[pair] + k
        part, bit = part_of(msk)[src], loss_bit(msk)[src]
        opens = (k == prefix[pair]) | (k == prefix[pair] + cb[pair])  # the prompt's last token, opening a branch
        prompt_tok = (part == 0) | opens
        blk = np.repeat(np.cumsum(r_block) - 1, r_len)  # (laid,) each token's block: a causal sequence of its own
        starts = np.concatenate([[True], blk[1:] != blk[:-1]]) if len(blk) else np.zeros(0, bool)
        follows = ~starts & ~(self.shared & (k == prefix[pair] + cb[pair]))  # continues the token before it
        second = np.repeat(r_second, r_len) if not self.shared else np.zeros(len(k), bool)
        answer_t = follows & ~prompt_tok & (bit == 1)
        prompt_t = follows & prompt_tok & ~second & self.prompt_targets
        positions = k - np.where(part == REJECTED, cb[pair], 0)
        # rows of laid tokens, padded
        laid = np.bincount(pair, minlength=len(doc)).astype(np.int64)
        row_len = np.bincount(row_of, weights=laid, minlength=nrows).astype(np.int64)
        T = int(row_len.max(initial=0))
        T = max(1, -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of)
        col = np.arange(len(k)) - np.repeat((np.cumsum(row_len) - row_len), row_len)
        dst = np.repeat(np.arange(nrows), row_len) * T + col  # (laid,) flat index into (rows, T)
        out_ids = np.full(nrows * T, self.pad_id, np.int64)
        out_ids[dst] = tok[src]
        out_pos = (np.arange(T)[None, :] - row_len[:, None]).reshape(-1)  # the padding run counts from 0
        out_pos[dst] = positions
        labels = np.full(nrows * T, IGNORE_INDEX, np.int64)
        answer = np.full(nrows * T, -1, np.int64)
        target = np.flatnonzero(answer_t | prompt_t)  # laid tokens that are targets of the token before them
        labels[dst[target - 1]] = tok[src[target]]
        at = np.flatnonzero(answer_t)
        answer[dst[at - 1]] = 2 * pair[at] + (part[at] == REJECTED)
        prompt = None
        if self.prompt_targets:
            prompt = np.full(nrows * T, -1, np.int64)
            pt = np.flatnonzero(prompt_t)
            prompt[dst[pt - 1]] = pair[pt]
        branches = None
        if self.shared:
            branches = np.zeros(nrows * T, np.int8)
            branches[dst] = part
        shape = (nrows, T)
        # segments: each block of each pair (its ranges 0, or 0 and 1 with 2), then the row's padding run
        block_len = np.bincount(blk, minlength=int(r_block.sum())).astype(np.int64)
        block_row = row_of[r_pair[r_block]]
        pad = T - row_len
        seg = np.concatenate([block_len, pad])[
            np.argsort(np.concatenate([2 * block_row, 2 * np.arange(nrows) + 1]), kind="stable")
        ]
        seg = seg[seg > 0]
        cu = np.concatenate([[0], np.cumsum(seg)]).astype(np.int32)
        source = store.sources_of(doc)
        source_ids = None
        if source is not None:
            source_ids = np.full(nrows * T, -1, np.int64)
            source_ids[dst] = source[pair]
            source_ids = torch.from_numpy(source_ids.reshape(shape))
        reference = None
        if self.reference is not None:
            reference = torch.from_numpy(np.asarray(self.reference, np.float64)[doc].reshape(-1, 2))
        labels_t = torch.from_numpy(labels.reshape(shape))
        return Batch(
            torch.from_numpy(out_ids.reshape(shape)),
            labels_t,
            torch.from_numpy(out_pos.reshape(shape)),
            num_loss_tokens=int((labels != IGNORE_INDEX).sum()),
            num_real_tokens=int(len(k)),
            single_doc_rows=False,  # a pair is never a plain causal row (its branches), nor are two segments
            max_position=int(max(out_pos.max(initial=0), 0)),
            documents=tuple(int(d) for d in np.unique(doc)),
            source_ids=source_ids,
            cu_seqlens=torch.from_numpy(cu),
            max_seqlen=int(np.diff(cu).max()) if cu.size > 1 else 0,
            pairs=Pairs(
                answer=torch.from_numpy(answer.reshape(shape)),
                branches=None if branches is None else torch.from_numpy(branches.reshape(shape)),
                rows=torch.from_numpy(row_of.astype(np.int64)),
                ids=tuple(int(d) for d in doc),
                prompt=None if prompt is None else torch.from_numpy(prompt.reshape(shape)),
                reference=reference,
            ),
        )
