"""Dense batches inside Hugging Face ``Trainer`` and TRL's ``SFTTrainer``: one call on the trainer.

    trainer = Trainer(model=model, args=args, train_dataset=tokenized)   # or SFTTrainer(...)
    densebatch.dense_batches(trainer, seq_len=2048, max_tokens_per_batch=16384)   # packed rows (the default)
    trainer.train()

``dense_batches`` replaces the trainer's training ``DataLoader`` by ``densebatch.dataloader`` over its
``train_dataset`` (``input_ids`` with optional ``labels`` or ``loss_mask``): the planned batches, this
process's share of each step (``args.process_index`` of ``args.world_size``, so torchrun and
``accelerate launch`` work unchanged), seeded by ``args.seed``, epoch by epoch through the trainer's
``set_epoch``. The loader is not handed to ``accelerate``: it already yields each rank's share.
Batches carry ``shift_labels``, so transformers' loss and the trainer's ``num_items_in_batch`` count
every target, including the one after a row cut, and gradient accumulation is exact in tokens.
Packed rows carry ``cu_seq_lens_q/k`` and ``position_ids``: load the model with
``attn_implementation="densebatch"`` (``densebatch.register_attention()``; any device),
``"flash_attention_2"`` or ``"flex_attention"`` to keep documents apart (``sdpa`` and ``eager`` ignore
them and let packed documents attend to each other). A resumed run (``resume_from_checkpoint``)
skips the batches already trained, and so continues with the same batches. The trainer's loss becomes
densebatch's (``loss="densebatch"``, the default): per-token losses through the fused chunked head, over
the step's loss tokens, never the full logits (``integrations/hf_loss.py``); ``loss="hf"`` keeps the trainer's.
``source_column="source"`` (a column naming each record's source) weighs each source's loss tokens as
``densebatch train`` does with ``train.source_balance: batches`` (``source_factors``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.rules import longest_row, sized_by_budget
from densebatch.data.plan.source_balance import batch_balance
from densebatch.data.plan.strategies import DEFAULT_STRATEGY, LengthGrouped
from densebatch.data.torch_loader import Documents, dataloader
from densebatch.integrations.hf_loss import LOSSES, install_loss
from densebatch.model.hf.attention import register
from densebatch.model.hf.checks import check_transformers
from densebatch.model.hf.falcon import install as install_falcon_attention


def register_attention() -> str:
    """Make ``attn_implementation="densebatch"`` known to transformers; returns that name. (Falcon before
    transformers 5.25, whose layers pick their attention class from a table of their own, gets
    densebatch's class there too: ``model/hf/falcon.py``.)"""
    check_transformers()
    register()
    install_falcon_attention()
    return "densebatch"


def dense_batches(
    trainer,
    strategy: str = DEFAULT_STRATEGY,
    max_tokens_per_batch: int = 8192,
    seq_len: int | None = None,
    loss: str = "densebatch",
    loss_chunk_tokens: int | None = None,
    source_column: str | None = None,
    **settings: Any,
):
    """Make ``trainer`` (a ``transformers.Trainer`` or a subclass such as ``trl.SFTTrainer``) train on
    densebatch's batches; returns it. ``settings``: the other ``densebatch.dataloader`` keywords
    (``rows_per_batch``, ``long_docs``, ``bundle_tokens``, ``pad_to_multiple_of``, ...); ``pad_id``
    defaults to the trainer's tokenizer's pad (else end-of-text) id, ``seq_len`` to ``max_tokens_per_batch``
    (packed rows as long as the budget: one row a batch). ``loss="densebatch"`` (the default) also gives the
    trainer densebatch's loss path, the fused chunked head (``integrations/hf_loss.py``); ``"hf"`` keeps its own;
    ``loss_chunk_tokens``: positions the head projects at a time (default: 128 MiB of float32 logits, 1 GiB on CUDA).
    ``source_column``: the ``train_dataset`` column naming each record's source: on packed and token_budget
    plans each source's loss tokens weigh ``source_factors`` in the loss (densebatch's loss path only)."""
    check_transformers()
    if loss not in LOSSES:
        raise ValueError(f"dense_batches: loss: expected one of {', '.join(LOSSES)}; got {loss!r}")
    if source_column is not None and loss != "densebatch":
        raise ValueError("dense_batches: source_column weighs sources in densebatch's loss path: drop loss='hf'")
    PlanSettings(strategy=strategy, max_tokens_per_batch=max_tokens_per_batch, seq_len=seq_len or max_tokens_per_batch)
    args = trainer.args
    if getattr(args, "train_sampling_strategy", None) == "group_by_length" or getattr(args, "group_by_length", False) is True:
        raise ValueError(
            "dense_batches: the trainer's group_by_length would be ignored (densebatch plans the batches): drop it, "
            f"and pass strategy={LengthGrouped.name!r} (or better packed / token_budget)"
        )
    tok = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
    tok = getattr(tok, "tokenizer", tok)  # a processor's tokenizer
    pad = getattr(tok, "pad_token_id", None)
    pad = getattr(tok, "eos_token_id", None) if pad is None else pad
    settings.setdefault("pad_id", 0 if pad is None else int(pad))
    settings.setdefault("seed", args.seed)
    if isinstance(vocab := getattr(_text_config(trainer.model), "vocab_size", None), int):
        settings.setdefault("vocab_size", vocab)  # ids past it, the pad id included, are refused by name

    def get_train_dataloader():
        if trainer.train_dataset is None:
            raise ValueError("dense_batches: the trainer has no train_dataset")
        loader = dataloader(
            trainer.train_dataset,
            strategy=strategy,
            seq_len=seq_len or max_tokens_per_batch,
            max_tokens_per_batch=max_tokens_per_batch,
            rank=args.process_index,
            world_size=args.world_size,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            source_column=source_column,
            **settings,
        )
        check_positions(loader.batch_sampler, trainer.model)
        return loader

    weights = None
    if source_column is not None:
        if trainer.train_dataset is None:
            raise ValueError("dense_batches: source_column needs the trainer's train_dataset")
        docs = Documents(trainer.train_dataset, source_column=source_column)
        weights = source_factors(docs, strategy, settings["seed"], settings.get("rows_per_batch", 8))
    trainer.get_train_dataloader = get_train_dataloader
    line = install_loss(trainer, loss, loss_chunk_tokens, source_weights=weights)
    if source_column is not None and not line.startswith("densebatch"):
        raise ValueError(f"dense_batches: source_column needs densebatch's loss path, which this trainer cannot use: {line}")
    return trainer


class _SourceView:
    """What ``batch_balance`` reads of a store, over ``Documents`` laid out source after source (as a
    prepared mixture's store holds them, each source's documents in dataset order)."""

    def __init__(self, docs: Documents) -> None:
        order = np.argsort(docs.sources, kind="stable")
        self.source_names = docs.source_names
        self.doc_loss_tokens = docs.doc_loss_tokens()[order]
        self._sources = docs.sources[order]

    def __len__(self) -> int:
        return len(self._sources)

    def sources_of(self, docs) -> np.ndarray:
        return self._sources[np.asarray(docs, np.int64)]


def source_factors(docs: Documents, strategy: str, seed: int, rows_per_batch: int = 8) -> list[float] | None:
    """Each source's weight of its loss tokens (``train.source_balance: batches``, ``run/build.py``'s
    ``source_weights``): ``data/plan/source_balance.py``'s factors for plans sized by a token budget (packed,
    token_budget), None for one source or for random / length_grouped batches (which weigh sources as random
    batches do). The same documents, source by source, seed and rows give the factors ``densebatch train`` uses."""
    if not sized_by_budget(strategy) or len(docs.source_names) < 2:
        return None
    factors = batch_balance(_SourceView(docs), weights=None, seed=seed, rows=rows_per_batch)
    return None if factors is None else [float(f) for f in factors]


def check_positions(sampler, model) -> None:
    """``ValueError`` before training when a row can be longer than the model's positions (an index error
    deep inside its embedding otherwise, at the first long row): packed rows are ``seq_len`` long,
    token_budget rows at most the budget, random and length_grouped rows the longest document."""
    cfg = _text_config(model)
    positions = next((v for k in ("max_position_embeddings", "n_positions") if isinstance(v := getattr(cfg, k, None), int)), None)
    s = sampler.settings
    row, key = longest_row(s, int(sampler.lengths.max()))
    if positions and row > positions:
        fix = f"pass {key}={positions}" if key else f"cut the documents to {positions} tokens, or use packed / token_budget rows"
        raise ValueError(
            f"dense_batches: {s.strategy} rows of up to {row} tokens, but the model has {positions} positions: {fix}"
        )


def _text_config(model):
    """The model's (text) configuration: its vocabulary and positions; None when it has none."""
    cfg = getattr(model, "config", None)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
