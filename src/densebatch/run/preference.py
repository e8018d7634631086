"""The wiring of preference training: how pairs are laid, their collator and lengths, the reference, the steps.

``prompt_layout``: a pair's prompt is laid once (its branches kept apart by the attention) unless the run asks
for a kernel that cannot draw that mask (``model.attention: varlen``, FlashAttention), when it is laid twice;
the run's report says so once (``run/report.py``). ``pair_loading``: the collator and the lengths the planner
sees (as stored, or with the prompt twice). ``check_pair_rows``: a pair is never split, so the longest must fit
a row. ``reference_tables``: ``train.reference: precompute``, every pair scored once by the starting weights
and stored beside the prepared pairs (``cache_dir/<entry>/reference/<weights key>-<split>.npy``), read back by a
later run with the same weights. ``preference_steps``: what the trainer hands its steps to.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np

from densebatch.atomic import write_file
from densebatch.config import RunConfig
from densebatch.data.load.loader import StepLoader
from densebatch.data.load.pair_collate import PairCollator, laid_lengths
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.rules import full_context_settings, longest_row
from densebatch.data.plan.steps import StepSettings
from densebatch.data.store.pair_layout import pair_spans
from densebatch.data.store.store import DocumentStore, read_ranges
from densebatch.errors import ConfigError
from densebatch.train.objectives.losses import objective_from_config
from densebatch.train.objectives.reference import LiveReference, reference_table, weights_key
from densebatch.train.objectives.steps import PreferenceSteps

REFERENCE_DIR = "reference"  # inside the prepared pairs' cache entry


def is_pairs(store: DocumentStore | None) -> bool:
    return store is not None and bool(store.meta.get("pairs"))


def prompt_layout(cfg: RunConfig) -> tuple[bool, str | None]:
    """(whether each pair's prompt is laid once, the report's line when it is laid twice)."""
    densebatch_kernel = cfg.model.kind == "gpt" or cfg.model.attn_implementation == "densebatch"
    if cfg.model.attention == "varlen" and densebatch_kernel:
        return False, (
            "pairs: each prompt is laid twice (prompt + chosen, prompt + rejected): model.attention varlen "
            "(FlashAttention) cannot keep a pair's rejected answer from its chosen one; flex, segmented and masked can"
        )
    return True, None


def prefix_lengths(store: DocumentStore) -> np.ndarray:
    """(pairs,) each stored pair's prompt tokens before its last (read from the masks, window by window)."""
    first, n = store.doc_spans(np.arange(len(store)))
    mask = read_ranges(store.loss_mask, first, first + n)
    return pair_spans(mask, n)[:, 0]


def pair_loading(cfg: RunConfig, store: DocumentStore, reference: np.ndarray | None = None):
    """(the collator of ``store``'s pairs, the lengths the planner sees: None when as stored)."""
    shared, _ = prompt_layout(cfg)
    objective = objective_from_config(cfg.train)
    meta = store.meta
    pad = meta.get("pad_id") if meta.get("pad_id") is not None else meta["eos_id"]
    collator = PairCollator(
        pad, cfg.batching.pad_to_multiple_of, shared=shared, prompt_targets=bool(objective and objective.prompt_targets),
        reference=reference,
    )  # fmt: skip
    lengths = None if shared else laid_lengths(store.lengths, prefix_lengths(store), shared)
    return collator, lengths


def check_pair_rows(cfg: RunConfig, longest: int) -> None:
    """A pair is planned whole: ``ConfigError`` naming the key when its row could not hold the longest."""
    row, setting = longest_row(cfg.batching, longest)
    if row < longest:
        raise ConfigError(
            f"batching.{setting}: a preference pair takes up to {longest} tokens in a row (its prompt, then both answers) "
            f"and is never split: raise batching.{setting} to at least {longest}, or lower data.max_seq_len"
        )


def reference_tables(cfg: RunConfig, *, model, prepared, stores: dict, device, dist) -> dict[str, np.ndarray]:
    """``train.reference: precompute``: {split: (pairs, 2) table} of each of ``stores`` (split -> the store its
    loader reads) scored by ``model`` as it starts, read from beside the prepared pairs when a run with the
    same weights, precision and pairs wrote them, else computed (every rank its share) and written by rank 0."""
    gather = dist.gather_object if dist.enabled else None
    key = weights_key(model, extra=f"{cfg.train.precision}|{cfg.batching.mode}", gather=gather)
    out = {}
    for split, store in stores.items():
        ids = hashlib.sha256(np.asarray(store.lengths, np.int64).tobytes()).hexdigest()[:8]  # an eval selection's own
        path = Path(prepared.cache_dir) / REFERENCE_DIR / f"{key}-{split}-{len(store)}-{ids}.npy"
        if path.is_file():
            out[split] = np.load(path, allow_pickle=False)
            continue
        collator, lengths = pair_loading(cfg, store)
        longest = int(np.max(lengths, initial=0)) if lengths is not None else store.max_length
        settings = full_context_settings(PlanSettings.from_config(cfg.batching), longest)  # no pair split
        loader = StepLoader(
            store, settings=settings, collator=collator, seed=cfg.seed, steps=StepSettings(1, None, dist.world_size, dist.rank),
            prefetch=0, lengths=lengths,
        )  # fmt: skip
        table = reference_table(
            model, loader.iter_epoch(0), num_pairs=len(store), device=device, precision=cfg.train.precision,
            all_reduce_sum=dist.all_reduce_sum if dist.enabled else None,
        )  # fmt: skip
        if dist.is_main:
            buf = io.BytesIO()
            np.save(buf, table, allow_pickle=False)
            write_file(path, buf.getvalue())
        out[split] = table
    if dist.enabled:
        dist.barrier()
    return out


def preference_steps(cfg: RunConfig, model, sharded: bool = False) -> PreferenceSteps | None:
    """What the trainer hands its steps to under a preference objective (None for sft): with the live reference
    (a frozen copy of ``model`` as it starts, or its LoRA base) when dpo reads it live."""
    objective = objective_from_config(cfg.train)
    if objective is None:
        return None
    live = None
    if objective.needs_reference and cfg.train.reference == "live":
        if sharded and not getattr(model, "lora", False):
            raise ConfigError(
                "train.reference: live keeps a whole copy of the starting weights beside the sharded model under fsdp: "
                "use train.reference: precompute (or LoRA, whose base is the reference)"
            )
        live = LiveReference(model)
    return PreferenceSteps(objective, live)


def pairs_before_training(cfg: RunConfig, *, model, prepared, device, dist, eval_store=None) -> dict | None:
    """What a run on preference pairs settles before its loaders: every pair fits a row whole
    (``check_pair_rows``), and ``train.reference: precompute``'s tables ({split: table}; None otherwise),
    of the training pairs and the held-out ones every evaluation scores (``eval_store``: those of
    ``eval.max_tokens``' selection, whose documents the table's rows follow)."""
    _, lengths = pair_loading(cfg, prepared.train)  # evaluations' rows hold their longest pair (full context)
    check_pair_rows(cfg, int(np.max(lengths, initial=0)) if lengths is not None else prepared.train.max_length)
    objective = objective_from_config(cfg.train)
    if objective is None or not objective.needs_reference or cfg.train.reference != "precompute":
        return None
    stores = {"train": prepared.train}
    if prepared.eval is not None:
        stores["eval"] = eval_store(cfg, prepared.eval) if eval_store is not None else prepared.eval
    return reference_tables(cfg, model=model, prepared=prepared, stores=stores, device=device, dist=dist)
