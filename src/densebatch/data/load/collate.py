"""Collation: turn one planned batch (rows of document pieces) into a ``Batch`` of tensors, vectorised.

A row is a list of pieces ``(doc, start, stop)`` (token ``start`` up to ``stop`` of document ``doc``
in the store). Every piece is one segment: positions restart at 0 at its first token, also for a
piece that continues a split document (``start > 0``; attention cannot reach the previous piece,
so it must not pretend to continue its positions). The padding at the end of a row is one more
segment starting at 0 (see ``densebatch.batch``)::

    pieces     (a, 0, 3) (b, 0, 2)       a = a0 a1 E, b = b0 E   (E = end-of-text, the doc's last token)
    input_ids  a0 a1 E    b0 E     P  P
    labels     a1 E  -100 E  -100  -100 -100
    positions  0  1  2    0  1     0  1

``labels[t] = tokens[t + 1]`` of the same *document* where ``loss_mask[t + 1] == 1``, else -100: at
padding, at prompt tokens the document masks, and at the last position of a piece that ends its
document (it must not predict the next document). A piece that stops inside its document keeps the
token after the cut as its last target, so splitting a document never loses a target::

    document   c = c0 c1 c2 c3 c4 E, split into (c, 0, 3) and (c, 3, 6)
    input_ids  c0 c1 c2 | c3 c4 E
    labels     c1 c2 c3 | c4 E  -100
    positions  0  1  2  | 0  1  2

Masking is by *position*: a pad or end-of-text id inside a text is still a target. All of it is a
handful of numpy gathers/scatters over the batch's tokens, no per-token Python. The planner's facts
travel with the batch (``single_doc_rows``, ``max_position``, ``documents``), computed here from the
pieces so that models need no host synchronisation to rediscover them. A store with sources (every
prepared one) also gives ``source_ids``: each real token's source, -1 at padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from densebatch.batch import IGNORE_INDEX, Batch
from densebatch.data.prepare.store import read_ranges
from densebatch.errors import ConfigError, DataError


@dataclass(frozen=True)
class _Gathered:
    input_ids: np.ndarray  # (rows, T) int64
    positions: np.ndarray  # (rows, T) int64
    labels: np.ndarray  # (rows, T) int64, causal targets
    real: np.ndarray  # (rows, T) bool, False at padding
    num_real: int
    single_doc_rows: bool  # every row: exactly one piece, then padding
    max_position: int  # largest value in positions (pieces and padding runs)
    documents: tuple[int, ...]  # sorted unique store indices
    source_ids: np.ndarray | None  # (rows, T) int64, -1 at padding; None when the store has no sources
    cu_seqlens: np.ndarray  # (segments + 1,) int32: pieces and padding runs over the flattened rows

    def batch(self, input_ids: np.ndarray | torch.Tensor, labels: torch.Tensor, num_loss_tokens: int) -> Batch:
        return Batch(
            torch.as_tensor(input_ids),
            labels,
            torch.from_numpy(self.positions),
            num_loss_tokens=num_loss_tokens,
            num_real_tokens=self.num_real,
            single_doc_rows=self.single_doc_rows,
            max_position=self.max_position,
            documents=self.documents,
            source_ids=None if self.source_ids is None else torch.from_numpy(self.source_ids),
            cu_seqlens=torch.from_numpy(self.cu_seqlens),
            max_seqlen=int(self.cu_seqlens.size > 1 and np.diff(self.cu_seqlens).max()),
        )


def _gather(store, rows, pad_id: int, pad_to_multiple_of: int, use_loss_mask: bool) -> _Gathered:
    pieces = [p for row in rows for p in row]
    nrows = len(rows)
    if pieces:
        doc, start, stop = np.array(pieces, np.int64).reshape(-1, 3).T
    else:
        doc = start = stop = np.zeros(0, np.int64)
    row = np.repeat(np.arange(nrows), [len(r) for r in rows])
    lens = stop - start
    if (lens <= 0).any() or (start < 0).any():
        bad = int(np.flatnonzero((lens <= 0) | (start < 0))[0])
        raise ValueError(f"empty or negative piece (doc {int(doc[bad])}, {int(start[bad])}, {int(stop[bad])})")
    doc_first, doc_len = store.doc_spans(doc)
    if (stop > doc_len).any():
        bad = int(np.flatnonzero(stop > doc_len)[0])
        raise ValueError(
            f"piece (doc {int(doc[bad])}, {int(start[bad])}, {int(stop[bad])}) ends past the document ({int(doc_len[bad])} tokens)"
        )
    row_len = np.bincount(row, weights=lens, minlength=nrows).astype(np.int64)
    T = int(row_len.max(initial=0))
    T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    ends = np.cumsum(lens)
    col0 = ends - lens - (np.cumsum(row_len) - row_len)[row]  # piece's first column in its row
    n = int(ends[-1]) if len(ends) else 0
    k = np.arange(n) - np.repeat(ends - lens, lens)  # index inside the piece (= position)
    # Each piece's tokens and the one after it (its last target when the document goes on), read from the
    # store range by range (read_ranges: never resident in this process) into `local`
    first = doc_first + start
    span = np.minimum(stop + 1, doc_len) - start
    src = np.repeat(np.cumsum(span) - span, lens) + k  # (n,) index into the pieces' tokens read below
    dst = np.repeat(row * T + col0, lens) + k  # (n,) flat index into (rows, T)
    # Only the document's own last token has no target: a piece cut before its document's end
    # keeps the token after the cut (the next piece's first) as its last target.
    doc_end = k == np.repeat(doc_len - start - 1, lens)
    tgt = np.where(doc_end, src, src + 1)  # never read past the document's last token
    keep = ~doc_end
    if use_loss_mask:
        keep &= read_ranges(store.loss_mask, first, first + span)[tgt] != 0
    local = read_ranges(store.tokens, first, first + span)
    input_ids = np.full(nrows * T, pad_id, np.int64)
    input_ids[dst] = local[src]
    labels = np.full(nrows * T, IGNORE_INDEX, np.int64)
    labels[dst[keep]] = local[tgt[keep]]
    positions = np.arange(T)[None, :] - row_len[:, None]  # (rows, T): the padding run counts from 0
    real = positions < 0
    positions = positions.reshape(-1)
    positions[dst] = k
    shape = (nrows, T)
    source_ids = None
    source = store.sources_of(doc)
    if source is not None:  # every real token gets its document's source, so each target does too
        source_ids = np.full(nrows * T, -1, np.int64)
        source_ids[dst] = np.repeat(source, lens)
        source_ids = source_ids.reshape(shape)
    # The largest position, from lengths alone: the longest piece or the longest padding run.
    longest_run = max(int(lens.max(initial=0)), int((T - row_len).max(initial=0)))
    # Segments row by row: the row's pieces in order, then its padding run (if any).
    pad = T - row_len  # (rows,)
    order = np.argsort(np.concatenate([2 * row, 2 * np.arange(nrows) + 1]), kind="stable")
    seg = np.concatenate([lens, pad])[order]
    seg = seg[seg > 0]
    cu_seqlens = np.concatenate([[0], np.cumsum(seg)]).astype(np.int32)
    return _Gathered(
        input_ids.reshape(shape),
        positions.reshape(shape),
        labels.reshape(shape),
        real,
        n,
        single_doc_rows=all(len(r) == 1 for r in rows),
        max_position=max(0, longest_run - 1),
        documents=tuple(int(d) for d in np.unique(doc)),
        source_ids=source_ids,
        cu_seqlens=cu_seqlens,
    )


class CausalCollator:
    """Causal-LM batches. ``use_loss_mask=False`` trains on every in-document target (no prompt masking)."""

    def __init__(self, pad_id: int, pad_to_multiple_of: int = 1, use_loss_mask: bool = True):
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of: expected a positive integer; got {pad_to_multiple_of}")
        self.pad_id, self.pad_to_multiple_of, self.use_loss_mask = int(pad_id), int(pad_to_multiple_of), use_loss_mask

    def __call__(self, store, rows, step: tuple[int, int] = (0, 0)) -> Batch:
        g = _gather(store, rows, self.pad_id, self.pad_to_multiple_of, self.use_loss_mask)
        return g.batch(torch.from_numpy(g.input_ids), torch.from_numpy(g.labels), int((g.labels != IGNORE_INDEX).sum()))


class MaskedLMCollator:
    """Masked-LM batches with the semantics of Hugging Face ``DataCollatorForLanguageModeling(mlm=True)``.

    ``mlm_probability`` of the real, non-special tokens are selected; of those 80% become
    ``mask_id``, 10% a random token, 10% stay; labels are the original token at selected positions
    and -100 elsewhere (not shifted: the target of position t is token t). Padding is excluded by
    position, special tokens by id. Deterministic: the draw depends only on (seed, epoch, batch index).
    """

    def __init__(
        self,
        pad_id: int,
        mask_id: int | None,
        vocab_size: int,
        special_ids=(),
        mlm_probability: float = 0.15,
        seed: int = 0,
        pad_to_multiple_of: int = 1,
    ):
        if mask_id is None:
            raise ConfigError(
                "batching.mode mlm needs a mask token and the tokenizer has none: set batching.mode: causal, or a "
                "data.tokenizer with a mask token"
            )
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability: expected a number in (0, 1); got {mlm_probability}")
        self.pad_id, self.mask_id, self.vocab_size = int(pad_id), int(mask_id), int(vocab_size)
        self.special_ids = torch.tensor(sorted({int(i) for i in special_ids} | {self.mask_id}), dtype=torch.int64)
        self.mlm_probability, self.seed, self.pad_to_multiple_of = float(mlm_probability), int(seed), int(pad_to_multiple_of)

    def generator(self, step: tuple[int, int]) -> torch.Generator:
        epoch, index = step
        state = np.random.SeedSequence([self.seed % 2**63, int(epoch), int(index)]).generate_state(1, np.uint64)[0]
        return torch.Generator().manual_seed(int(state) & (2**63 - 1))

    def __call__(self, store, rows, step: tuple[int, int] = (0, 0)) -> Batch:
        g = _gather(store, rows, self.pad_id, self.pad_to_multiple_of, use_loss_mask=False)
        ids = torch.from_numpy(g.input_ids)
        gen = self.generator(step)
        real = torch.from_numpy(g.real)
        prob = torch.full(ids.shape, self.mlm_probability)
        prob.masked_fill_(~real | torch.isin(ids, self.special_ids), 0.0)
        selected = torch.bernoulli(prob, generator=gen).bool()
        labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
        replaced = torch.bernoulli(torch.full(ids.shape, 0.8), generator=gen).bool() & selected
        randomised = torch.bernoulli(torch.full(ids.shape, 0.5), generator=gen).bool() & selected & ~replaced
        out = ids.clone()
        out[replaced] = self.mask_id
        out[randomised] = torch.randint(self.vocab_size, ids.shape, generator=gen)[randomised]
        return g.batch(out, labels, int(selected.sum()))


def collator_from_config(cfg, meta: dict, seed: int = 0):
    """The collator a ``BatchingConfig`` asks for (``mode`` causal or mlm), from a store's ``meta``.

    ``prepare`` checks the meta of the stores it hands out; a store made some other way that lacks
    what collation needs is a one-line ``DataError`` that says how to rebuild it."""
    pad_id = meta.get("pad_id")
    pad_id = meta.get("eos_id") if pad_id is None else pad_id
    need = ("vocab_size",) if cfg.mode == "mlm" else ()
    if pad_id is None or any(meta.get(k) is None for k in need):
        what = "neither pad_id nor eos_id" if pad_id is None else "no vocab_size"
        raise DataError(
            f"the prepared documents' meta.json has {what} (a stale or damaged cache): delete the entry under "
            "data.cache_dir and run again to rebuild it"
        )
    if cfg.mode == "mlm":
        special = set(meta.get("special_ids") or ()) | ({meta["eos_id"]} if meta.get("eos_id") is not None else set())
        return MaskedLMCollator(
            pad_id, meta.get("mask_id"), meta["vocab_size"], special, cfg.mlm_probability, seed, cfg.pad_to_multiple_of
        )
    return CausalCollator(pad_id, cfg.pad_to_multiple_of)
