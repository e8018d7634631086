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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from densebatch.batch import IGNORE_INDEX, Batch
from densebatch.data.store.store import DocumentStore, read_ranges
from densebatch.errors import ConfigError, DataError

Row = Sequence[tuple[int, int, int]]  # a row: its pieces (doc, start, stop)


class Collator(Protocol):
    """What the loader needs of a collator: rows of a store's documents → one ``Batch``.

    ``pad_id`` fills a null batch (an idle rank's share); ``masked_rate`` is the share of real tokens that
    become targets when the batch is collated (masked LM), None when the store's loss mask decides which
    tokens are targets (causal LM): the loader counts a step's loss tokens from it before collating."""

    pad_id: int
    masked_rate: float | None

    def __call__(self, store: DocumentStore, rows: Sequence[Row], step: tuple[int, int] = (0, 0)) -> Batch: ...


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
    token_at: np.ndarray  # (n,) flat index into (rows, T) of each real token
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray]  # (doc, start, lens) of each piece, in token order
    token_k: np.ndarray  # (n,) each real token's index in its piece

    def token_documents(self) -> tuple[np.ndarray, np.ndarray]:
        """(document, position in the document) of every real token (masked LM only: not on the causal path)."""
        doc, start, lens = self.pieces
        return np.repeat(doc, lens), np.repeat(start, lens) + self.token_k

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


def _gather(store, *, rows, pad_id: int, pad_to_multiple_of: int, use_loss_mask: bool) -> _Gathered:
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
        token_at=dst,
        pieces=(doc, start, lens),
        token_k=k,
    )


class CausalCollator:
    """Causal-LM batches. ``use_loss_mask=False`` trains on every in-document target (no prompt masking)."""

    def __init__(self, pad_id: int, pad_to_multiple_of: int = 1, use_loss_mask: bool = True):
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of: expected a positive integer; got {pad_to_multiple_of}")
        self.pad_id = int(pad_id)
        self.pad_to_multiple_of = int(pad_to_multiple_of)
        self.use_loss_mask = use_loss_mask
        self.masked_rate: float | None = None  # targets: the store's loss mask

    def __call__(self, store: DocumentStore, rows: Sequence[Row], step: tuple[int, int] = (0, 0)) -> Batch:
        g = _gather(
            store, rows=rows, pad_id=self.pad_id, pad_to_multiple_of=self.pad_to_multiple_of, use_loss_mask=self.use_loss_mask
        )
        return g.batch(torch.from_numpy(g.input_ids), torch.from_numpy(g.labels), int((g.labels != IGNORE_INDEX).sum()))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose outputs pass as independent uniform draws."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def token_draws(seed: int, epoch: int, doc: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three draws per token that depend only on (seed, epoch, document, position in the document):
    two uniforms in [0, 1) (24 bits each) and one uint64 (the random replacement). Counter-based, so a
    token's draw is the same in any batch, row, piece, rank or strategy."""
    with np.errstate(over="ignore"):
        base = _mix(np.uint64(seed % 2**64) + _GOLDEN * np.uint64(epoch % 2**64 + 1))
        x = _mix(_mix(base ^ (doc.astype(np.uint64) * _GOLDEN)) + pos.astype(np.uint64) * _GOLDEN)
        y = _mix(x ^ _GOLDEN)
    scale = 1.0 / (1 << 24)
    return (x >> np.uint64(40)).astype(np.float64) * scale, ((x >> np.uint64(16)) & np.uint64(0xFFFFFF)) * scale, y


class MaskedLMCollator:
    """Masked-LM batches with the semantics of Hugging Face ``DataCollatorForLanguageModeling(mlm=True)``.

    ``mlm_probability`` of the real, non-special tokens are selected; of those 80% become
    ``mask_id``, 10% a random token, 10% stay; labels are the original token at selected positions
    and -100 elsewhere (not shifted: the target of position t is token t). Padding is excluded by
    position, special tokens by id.

    Which tokens are selected, and what each becomes, depends only on (seed, epoch, document,
    position in the document) (``token_draws``): not on the batch, the row, the piece a document was
    split into, the rank or the strategy. So evaluation (epoch 0) masks the same tokens under every
    plan, a step split over ranks masks what one process masks, and each epoch masks anew (dynamic
    masking, as Hugging Face's collator re-draws per batch).
    """

    def __init__(
        self,
        pad_id: int,
        *,
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
        self.pad_id = int(pad_id)
        self.mask_id = int(mask_id)
        self.vocab_size = int(vocab_size)
        self.special_ids = np.array(sorted({int(i) for i in special_ids} | {self.mask_id}), np.int64)
        self.mlm_probability = float(mlm_probability)
        self.masked_rate: float | None = self.mlm_probability  # targets: drawn here, a share of the real tokens
        self.seed = int(seed)
        self.pad_to_multiple_of = int(pad_to_multiple_of)

    def __call__(self, store: DocumentStore, rows: Sequence[Row], step: tuple[int, int] = (0, 0)) -> Batch:
        g = _gather(store, rows=rows, pad_id=self.pad_id, pad_to_multiple_of=self.pad_to_multiple_of, use_loss_mask=False)
        ids = g.input_ids.reshape(-1)
        at = g.token_at
        tokens = ids[at]  # (n,) the real tokens
        select, what, other = token_draws(self.seed, step[0], *g.token_documents())
        chosen = (select < self.mlm_probability) & ~np.isin(tokens, self.special_ids)
        masked = chosen & (what < 0.8)
        randomised = chosen & (what >= 0.8) & (what < 0.9)  # the last 10% keep their token
        out = ids.copy()
        out[at[masked]] = self.mask_id
        out[at[randomised]] = (other[randomised] % np.uint64(self.vocab_size)).astype(np.int64)
        labels = np.full(ids.shape, IGNORE_INDEX, np.int64)
        labels[at[chosen]] = tokens[chosen]
        shape = g.input_ids.shape
        return g.batch(torch.from_numpy(out.reshape(shape)), torch.from_numpy(labels.reshape(shape)), int(chosen.sum()))


def collator_from_config(cfg, meta: dict, seed: int = 0) -> Collator:
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
            pad_id,
            mask_id=meta.get("mask_id"),
            vocab_size=meta["vocab_size"],
            special_ids=special,
            mlm_probability=cfg.mlm_probability,
            seed=seed,
            pad_to_multiple_of=cfg.pad_to_multiple_of,
        )
    return CausalCollator(pad_id, cfg.pad_to_multiple_of)
