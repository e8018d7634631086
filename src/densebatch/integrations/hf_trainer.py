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
``densebatch train`` does with ``train.source_balance: batches`` (``sources.py``).

Everything is checked before anything changes: a call that raises leaves the trainer as it was. The model
is never given anything (its ``forward`` is densebatch's only inside one training ``compute_loss`` call,
``fused_forward.py``). ``undo_dense_batches(trainer)`` puts back the trainer's own methods and attributes
(``installed.py``) and returns their names. The end of training leaves the trainer's methods in place, so
that a second ``train()`` (a resume, a hyperparameter search) trains on the same batches, not silently on
the trainer's own.
"""

from __future__ import annotations

import logging
from typing import Any

from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.rules import longest_row
from densebatch.data.plan.strategies import DEFAULT_STRATEGY, LengthGrouped, TokenBudget
from densebatch.data.torch_loader import Documents, dataloader
from densebatch.integrations.hf_loss import install_loss, plan_loss
from densebatch.integrations.installed import STATE, Installed, installed
from densebatch.integrations.sources import source_factors
from densebatch.integrations.trl_dpo import dense_dpo_batches, is_dpo_trainer
from densebatch.model.hf.attention import register
from densebatch.model.hf.checks import check_transformers
from densebatch.model.hf.falcon import install as install_falcon_attention

logger = logging.getLogger("densebatch.integrations")


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
    strategy: str | None = None,
    max_tokens_per_batch: int = 8192,
    seq_len: int | None = None,
    loss: str = "densebatch",
    loss_chunk_tokens: int | None = None,
    source_column: str | None = None,
    **settings: Any,
):
    """Make ``trainer`` (a ``transformers.Trainer`` or a subclass such as ``trl.SFTTrainer``) train on
    densebatch's batches; returns it. ``strategy``: packed unless given (TRL's ``DPOTrainer``: token_budget,
    ``integrations/trl_dpo.py``). ``settings``: the other ``densebatch.dataloader`` keywords
    (``rows_per_batch``, ``long_docs``, ``bundle_tokens``, ``pad_to_multiple_of``, ...); ``pad_id``
    defaults to the trainer's tokenizer's pad (else end-of-text) id, ``seq_len`` to ``max_tokens_per_batch``
    (packed rows as long as the budget: one row a batch). ``loss="densebatch"`` (the default) also gives the
    trainer densebatch's loss path, the fused chunked head (``integrations/hf_loss.py``); ``"hf"`` keeps its own;
    ``loss_chunk_tokens``: positions the head projects at a time (default: 128 MiB of float32 logits, 1 GiB on CUDA).
    ``source_column``: the ``train_dataset`` column naming each record's source: on packed and token_budget
    plans each source's loss tokens weigh ``source_factors`` in the loss (densebatch's loss path only).
    Called again, it first undoes the earlier call. Nothing changes when it raises."""
    check_transformers()
    if is_dpo_trainer(trainer):  # TRL's DPOTrainer: pairs planned as units, TRL's collator and loss kept
        if seq_len is not None or source_column is not None or loss_chunk_tokens is not None:
            raise ValueError(
                "dense_batches: DPOTrainer keeps TRL's padded rows and loss: seq_len, source_column and loss_chunk_tokens "
                "do not apply"
            )
        return dense_dpo_batches(trainer, strategy or TokenBudget.name, max_tokens_per_batch, **settings)
    strategy = strategy or DEFAULT_STRATEGY
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
    weights = None
    if source_column is not None:
        if trainer.train_dataset is None:
            raise ValueError("dense_batches: source_column needs the trainer's train_dataset")
        docs = Documents(trainer.train_dataset, source_column=source_column)
        weights = source_factors(docs, strategy, settings["seed"], settings.get("rows_per_batch", 8))
    path = plan_loss(trainer, loss, loss_chunk_tokens, source_weights=weights)
    if source_column is not None and path.head is None:
        if loss == "hf":
            raise ValueError("dense_batches: source_column weighs sources in densebatch's loss path: drop loss='hf'")
        raise ValueError(f"dense_batches: source_column needs densebatch's loss path, which this trainer cannot use: {path.line}")
    if (earlier := installed(trainer)) is not None:  # an earlier call's, put back first
        earlier.undo(trainer)
    loader = dict(
        strategy=strategy, seq_len=seq_len or max_tokens_per_batch, max_tokens_per_batch=max_tokens_per_batch,
        source_column=source_column, **settings,
    )  # fmt: skip
    state = Installed(loader)
    state.bind(trainer, "get_train_dataloader", _get_train_dataloader)
    install_loss(trainer, path, state)
    trainer.__dict__[STATE] = state
    return trainer


def undo_dense_batches(trainer) -> list[str]:
    """Put back what ``dense_batches`` changed on ``trainer`` (its own ``get_train_dataloader``, ``compute_loss``,
    ``get_batch_samples``, ``loss_is_scaled_for_ga``, each as it was before) and return their names, also logged
    in one line; [] when there is nothing to undo. The model needs nothing put back: its ``forward`` is its own
    outside each training step's ``compute_loss``."""
    state = installed(trainer)
    if state is None:
        return []
    names = state.undo(trainer)
    logger.warning(
        "densebatch: undo_dense_batches restored the trainer's own %s; the model's forward is its own", ", ".join(names)
    )
    return names


def _get_train_dataloader(self):
    """The trainer's ``get_train_dataloader`` (bound to it): ``densebatch.dataloader`` over its ``train_dataset``,
    this process's share of every step."""
    if self.train_dataset is None:
        raise ValueError("dense_batches: the trainer has no train_dataset")
    args = self.args
    loader = dataloader(
        self.train_dataset,
        rank=args.process_index,
        world_size=args.world_size,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        **installed(self).loader,
    )
    check_positions(loader.batch_sampler, self.model)
    return loader


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
