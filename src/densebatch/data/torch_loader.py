"""Dense batches in a plain ``torch.utils.data`` pipeline: a batch sampler, a dataset view and a collate function.

Any map-style dataset of token ids (a Hugging Face ``datasets.Dataset`` with ``input_ids`` and optional
``labels`` or ``loss_mask``, or a list of id lists) is planned by densebatch's planners and read
piece by piece::

    docs = Documents(hf_dataset)                        # lengths read once; items read per piece
    sampler = DenseBatchSampler(docs.lengths, seq_len=2048, max_tokens_per_batch=16384)  # packed rows (the default)
    loader = DataLoader(docs, batch_sampler=sampler, collate_fn=Collator(pad_id=0))

or in one call, ``dataloader(hf_dataset, seq_len=2048, ...)``, which also resumes mid-epoch.

The sampler yields, per batch, this rank's pieces ``Piece(doc, start, stop, row)`` of one step of the
epoch's global plan (the same on every rank: ``world_size`` planned batches a step, shared out as
the trainer shares them, so every rank yields the same number of batches; a rank with no share
of the last step gets an empty batch, which collates to one padding token and no loss).
``Documents[piece]`` reads the piece's tokens (and the one after a cut inside its document, its last
target), and the collator turns the pieces into the batch the causal collator makes from a store,
as a dict of tensors:

- ``format="hf"`` (default): what a Hugging Face causal LM reads: ``input_ids``, ``labels``
  (unshifted: the model shifts them; -100 at the first token of every piece, at padding and where
  the loss mask is 0), ``shift_labels`` (the targets already shifted, which transformers' causal LM
  loss and ``Trainer`` use instead of shifting ``labels``: with them the target after a row cut, the
  token that continues a split document, is kept), ``position_ids`` (0 at every piece's first token
  and at each padding run), and, when a row holds more than one piece, ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` over the rows flattened (what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
  gives): ``flash_attention_2``, ``flex_attention`` and densebatch's own ``attn_implementation="densebatch"``
  then keep the documents apart; rows of one piece get ``attention_mask`` instead.
- ``format="batch"``: densebatch's ``Batch`` (labels already shifted), for densebatch's own models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from densebatch.batch import IGNORE_INDEX, Batch
from densebatch.data.load.collate import CausalCollator
from densebatch.data.plan.strategies import DEFAULT_STRATEGY
from densebatch.data.store.store import DocumentStore
from densebatch.data.torch_sampler import DenseBatchSampler, Piece

SOURCE_KEY = "densebatch_source_ids"  # to_hf's key of the tokens' sources (the trainer's loss reads and drops it)


def _column_lengths(dataset, key: str) -> np.ndarray | None:
    """The lengths of a Hugging Face dataset's list column from its Arrow table, without reading the ids."""
    table = getattr(dataset, "data", None)
    if table is None or not hasattr(table, "column") or getattr(dataset, "_indices", None) is not None:
        return None
    try:
        import pyarrow.compute as pc

        return np.asarray(pc.list_value_length(table.column(key)).to_numpy(zero_copy_only=False), np.int64)
    except Exception:  # not a list column (pyarrow's ArrowNotImplementedError, ...): read item by item, which says why
        return None


def _check_dataset(dataset) -> None:
    """``TypeError`` / ``ValueError`` saying what to pass, for what ``Documents`` cannot read by index."""
    if isinstance(dataset, Mapping):  # a DatasetDict, or a dict of columns
        raise TypeError(
            f"dataset: a mapping (keys {', '.join(map(str, list(dataset)[:4]))}); pass one split, e.g. dataset['train']"
        )
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"dataset: expected a map-style dataset (a list, a datasets.Dataset); got {type(dataset).__name__}: list() it"
        )
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list) and "input_ids" not in columns:
        raise ValueError(f"dataset: no input_ids column (columns: {', '.join(columns)}): tokenize it first")


def _token_ids(ids, doc: int) -> np.ndarray:
    """Document ``doc``'s ids as int64, or ``ValueError`` naming it: not a flat list of integers (floats are
    not truncated, text is not read as digits)."""
    try:
        arr = np.asarray(ids)
    except ValueError:  # ragged nesting
        arr = None
    if arr is None or arr.ndim != 1 or (len(arr) and arr.dtype.kind not in "iu"):
        what = "nested lists" if arr is None or arr.ndim > 1 else f"{arr.dtype} values" if arr.ndim else type(ids).__name__
        raise ValueError(f"document {doc}: input_ids must be a flat list of integer token ids; got {what}")
    return arr.astype(np.int64, copy=False)


class Documents:
    """A map-style dataset of token ids seen as documents: ``docs[piece]`` is the piece's tokens and loss mask.

    Each item of ``dataset`` is a list of ids, or a dict with ``input_ids`` and optionally ``labels``
    (Hugging Face style, unshifted: -100 where a token is no target) or ``loss_mask`` (1 where a token,
    as a target, carries loss); without either, every token after the first is a target. ``lengths``
    are read once (from the Arrow table for a Hugging Face dataset, else item by item). ``source_column``: a
    column naming each document's source (a mixture): ``source_names`` in order of first appearance,
    ``sources`` each document's index into them, and every item and batch carries its tokens' sources."""

    def __init__(self, dataset, lengths: Sequence[int] | None = None, source_column: str | None = None) -> None:
        _check_dataset(dataset)
        self.dataset = dataset
        self.source_column = source_column
        self.source_names: list[str] = []
        self.sources: np.ndarray | None = None
        if source_column is not None:
            self.source_names, self.sources = _read_sources(dataset, source_column)
        if lengths is None:
            lengths = _column_lengths(dataset, "input_ids")
        if lengths is None:
            lengths = [len(_token_ids(self._ids(dataset[i]), i)) for i in range(len(dataset))]
        self.lengths = np.asarray(lengths, np.int64)
        if len(self.lengths) != len(dataset):
            raise ValueError(f"lengths: {len(self.lengths)} for {len(dataset)} documents")

    @staticmethod
    def _ids(item) -> Any:
        return item["input_ids"] if isinstance(item, Mapping) else item

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, piece: Piece | int) -> dict:
        """``{"piece", "input_ids", "loss_mask", "length"}``: the piece's tokens and the one after it when it
        stops inside its document (a plain index: the whole document)."""
        if not isinstance(piece, Piece):
            piece = Piece(int(piece), 0, int(self.lengths[int(piece)]), 0)
        item = self.dataset[piece.doc]
        ids = _token_ids(self._ids(item), piece.doc)
        n = len(ids)
        if isinstance(item, Mapping) and item.get("labels") is not None:
            mask = (np.asarray(item["labels"], np.int64) != IGNORE_INDEX).astype(np.uint8)
        elif isinstance(item, Mapping) and item.get("loss_mask") is not None:
            mask = np.asarray(item["loss_mask"], np.uint8)
        else:
            mask = np.ones(n, np.uint8)
        if len(mask) != n:
            raise ValueError(f"document {piece.doc}: {n} input_ids but {len(mask)} labels or loss_mask entries")
        end = min(piece.stop + 1, n)
        out = {"piece": piece, "input_ids": ids[piece.start : end], "loss_mask": mask[piece.start : end], "length": n}
        if self.sources is not None:
            out["source"] = int(self.sources[piece.doc])
        return out

    def doc_loss_tokens(self) -> np.ndarray:
        """(n,) int64: each document's targets (tokens after its first whose loss mask is 1), read item by item
        unless the dataset has neither ``labels`` nor ``loss_mask`` (then every token after the first)."""
        columns = getattr(self.dataset, "column_names", None)
        if isinstance(columns, list) and not {"labels", "loss_mask"} & set(columns):
            return np.maximum(self.lengths - 1, 0)
        return np.array([int(self[i]["loss_mask"][1:].sum()) for i in range(len(self))], np.int64)


def _read_sources(dataset, column: str) -> tuple[list[str], np.ndarray]:
    """(source names in order of first appearance, each document's index into them) from ``column``."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list):
        if column not in columns:
            raise ValueError(f"source_column: no {column!r} column (columns: {', '.join(columns)})")
        values = list(dataset[column])
    else:
        values = [item[column] if isinstance(item, Mapping) else None for item in dataset]
    if any(v is None for v in values):
        raise ValueError(f"source_column: document {next(i for i, v in enumerate(values) if v is None)} has no {column!r}")
    names = list(dict.fromkeys(str(v) for v in values))
    index = {n: i for i, n in enumerate(names)}
    return names, np.array([index[str(v)] for v in values], np.int64)


class Collator:
    """``collate_fn`` for ``Documents`` items of one sampler batch: the causal collator's batch, as a dict of
    tensors (``format="hf"``) or a ``Batch`` (``format="batch"``); see the module docstring."""

    def __init__(
        self,
        pad_id: int,
        pad_to_multiple_of: int = 1,
        format: str = "hf",
        use_loss_mask: bool = True,
        vocab_size: int | None = None,
    ) -> None:
        if format not in ("hf", "batch"):
            raise ValueError(f"format: expected hf or batch; got {format!r}")
        if not 0 <= int(pad_id) < (vocab_size or 2**31):  # it fills input_ids: an embedding row must exist for it
            raise ValueError(f"pad_id: expected a token id in 0 .. {(vocab_size or 2**31) - 1}; got {pad_id}")
        self.collator = CausalCollator(pad_id, pad_to_multiple_of, use_loss_mask)
        self.pad_id, self.format, self.vocab_size = int(pad_id), format, vocab_size

    def __call__(self, items: list[dict]) -> dict | Batch:
        if not items:  # a rank with no share of the last step: one padding token, no loss
            batch = Batch.null(self.pad_id)
            return batch if self.format == "batch" else to_hf(batch)
        # With sources, the store lists the pieces source after source (its source ids ascend); slot[i]: item i's place.
        order = sorted(range(len(items)), key=lambda i: items[i].get("source", 0))
        slot = {i: k for k, i in enumerate(order)}
        spans = [(items[i]["input_ids"], items[i]["loss_mask"]) for i in order]
        source = [items[i]["source"] for i in order] if "source" in items[0] else None
        store = DocumentStore.from_documents(spans, source=source)
        rows: list[list[tuple[int, int, int]]] = []
        for i, it in enumerate(items):
            p = it["piece"]
            while len(rows) <= p.row:
                rows.append([])
            rows[p.row].append((slot[i], 0, p.stop - p.start))
        batch = self.collator(store, rows)
        batch = dataclasses.replace(batch, documents=tuple(sorted({int(it["piece"].doc) for it in items})))
        if self.vocab_size is not None and (top := int(batch.input_ids.max())) >= self.vocab_size:  # the model's embedding
            raise ValueError(  # would fail with an index error deep inside; name the documents instead
                f"token id {top} in document(s) {', '.join(map(str, batch.documents[:5]))}: past the model's "
                f"vocabulary of {self.vocab_size} ids (a tokenizer other than the model's?)"
            )
        return batch if self.format == "batch" else to_hf(batch)


def to_hf(batch: Batch) -> dict[str, torch.Tensor]:
    """A ``Batch`` as a Hugging Face causal LM reads it (unshifted labels; see the module docstring)."""
    labels = torch.full_like(batch.labels, IGNORE_INDEX)
    labels[:, 1:] = batch.labels[:, :-1]
    labels[batch.positions == 0] = IGNORE_INDEX  # a piece's first token is never its own row's target
    out = {"input_ids": batch.input_ids, "labels": labels, "shift_labels": batch.labels, "position_ids": batch.positions}
    if batch.source_ids is not None:  # a loader given a source_column: each token's source (-1 at padding)
        out[SOURCE_KEY] = batch.source_ids
    if batch.single_doc_rows:
        out["attention_mask"] = _real_mask(batch)
    else:
        cu = batch.cu_seqlens
        if cu is None:
            raise ValueError("to_hf: a batch of packed rows needs cu_seqlens (made by the collator)")
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu.to(torch.int32)
        longest = int(batch.max_seqlen) if batch.max_seqlen is not None else int((cu[1:] - cu[:-1]).max())
        out["max_length_q"] = out["max_length_k"] = longest
    return out


def _real_mask(batch: Batch) -> torch.Tensor:
    """(rows, T) 1 at real tokens, 0 at the padding run that ends a row of one piece."""
    T = batch.seq_len
    starts = batch.positions == 0
    starts[:, 0] = False
    pad_from = torch.where(starts.any(1), starts.float().argmax(1), torch.full((batch.num_rows,), T))
    return (torch.arange(T)[None, :] < pad_from[:, None]).long()


class DenseDataLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` over ``Documents`` with a ``DenseBatchSampler``, resumable mid-epoch (the torchdata
    ``StatefulDataLoader`` convention): ``state_dict()`` is the position after the last batch this loader
    handed out (not what its workers fetched ahead), and iterating again, or after ``load_state_dict``,
    continues there."""

    def __init__(self, documents: Documents, sampler: DenseBatchSampler, collate_fn: Collator, **kwargs: Any) -> None:
        super().__init__(documents, batch_sampler=sampler, collate_fn=collate_fn, **kwargs)
        self._pos = (sampler.epoch, sampler.step)

    def __iter__(self):
        s = self.batch_sampler
        s.epoch, s.step = self._pos
        epoch, step = self._pos
        n = len(s)
        for batch in super().__iter__():
            step += 1
            self._pos = (epoch, step) if step < n else (epoch + 1, 0)  # the last batch handed out ends the epoch
            yield batch
        self._pos = (epoch + 1, 0)

    def set_epoch(self, epoch: int) -> None:
        self._pos = (int(epoch), 0)

    def state_dict(self) -> dict:
        return {"seed": self.batch_sampler.seed, "epoch": self._pos[0], "step": self._pos[1]}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)
        self._pos = (int(state["epoch"]), int(state["step"]))


def dataloader(
    dataset,
    strategy: str = DEFAULT_STRATEGY,
    seq_len: int = 1024,
    max_tokens_per_batch: int = 8192,
    seed: int = 0,
    pad_id: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    rows_per_batch: int = 8,
    pad_to_multiple_of: int = 1,
    format: str = "hf",
    lengths: Sequence[int] | None = None,
    source_column: str | None = None,
    **kwargs: Any,
) -> DenseDataLoader:
    """A ``DataLoader`` of dense batches over ``dataset`` (see ``Documents``), as dicts of tensors.

    ``strategy``: random, length_grouped, token_budget or packed; the other ``batching`` settings of the
    config (``long_docs``, ``bundle_tokens``, ``mega_batch_mult``, ``drop_last``, ``shard_docs``) pass as
    keywords; the rest of ``kwargs`` go to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).
    ``rank`` / ``world_size`` default to ``torch.distributed``'s. ``pad_id`` only fills padding (its
    labels are -100 and it never attends to a document). ``vocab_size``: the model's; a batch holding an id
    past it is refused, naming its documents. ``source_column``: a column naming each document's source;
    batches then carry each token's source (``Batch.source_ids``; ``densebatch_source_ids`` in the hf format)."""
    plan_keys = {"long_docs", "bundle_tokens", "mega_batch_mult", "drop_last", "shard_docs"}
    batching = {k: kwargs.pop(k) for k in list(kwargs) if k in plan_keys}
    vocab_size = kwargs.pop("vocab_size", None)
    docs = Documents(dataset, lengths, source_column)
    sampler = DenseBatchSampler(
        docs.lengths, strategy, seq_len, max_tokens_per_batch, rows_per_batch, seed, rank, world_size,
        pad_to_multiple_of=pad_to_multiple_of, **batching,
    )  # fmt: skip
    return DenseDataLoader(docs, sampler, Collator(pad_id, pad_to_multiple_of, format, vocab_size=vocab_size), **kwargs)


def _targets(batch: dict) -> torch.Tensor:
    """(rows, T) targets, aligned with the logits: ``shift_labels``, else ``labels`` shifted left."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    labels = batch["labels"]
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


def num_items(batches) -> int:
    """Targets of Hugging Face-format batches (``shift_labels``, or ``labels`` after the shift a causal LM
    applies, that are not -100): the ``num_items_in_batch`` of a step made of ``batches`` (all its
    micro-batches, on this rank; sum it over ranks for a step shared out by ``torch.distributed``)."""
    return int(sum(int((_targets(b) != IGNORE_INDEX).sum()) for b in batches))


def causal_loss(logits: torch.Tensor, batch: dict, num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """The causal LM loss of a Hugging Face-format ``batch``: cross-entropy of the logits against its targets
    (``shift_labels``, or ``labels`` shifted), summed and divided by ``num_items_in_batch`` (the step's
    targets, ``num_items``; default this batch's own). Summing each micro-batch's loss over a step then
    gives the step's mean over its targets, exact whatever the micro-batches hold, as one batch of all of
    them would."""
    shifted = _targets(batch).reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    total = torch.nn.functional.cross_entropy(flat, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
    n = (shifted != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    if num_items_in_batch is not None and not torch.is_tensor(n) and n < 1:  # a tensor is the trainer's count
        raise ValueError(f"num_items_in_batch: expected the step's number of targets (>= 1); got {n!r}")
    return total / torch.as_tensor(n, dtype=total.dtype, device=total.device).clamp(min=1)
