"""One setup for every command that trains or probes a model: configuration, documents, model, loaders.

``train``, ``find-lr`` and ``find-batch`` build through ``setup`` (and ``eval`` through
``eval_loader``), so the range test and the budget finder probe exactly the model, loss and batches
that ``train`` optimises: the same prepared documents (rank 0 prepares, the others then read its
cache), the same initial weights (seeded right before the model is built; added tokens' rows start
as the mean of the others), the same label smoothing, the same context check and the same plans.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from densebatch.atomic import check_writable
from densebatch.config import RunConfig
from densebatch.data.load.collate import collator_from_config
from densebatch.data.load.loader import StepLoader
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.rules import (
    full_context_settings,
    longest_train_row,
    loss_tokens_cut,
    sized_by_budget,
    truncation_cap,
)
from densebatch.data.plan.source_balance import batch_balance
from densebatch.data.plan.steps import StepSettings
from densebatch.data.plan.store_epochs import eval_documents
from densebatch.data.prepare.parts import prepare_share
from densebatch.data.prepare.pipeline import Prepared
from densebatch.data.prepare.vocab import added_tokens_line
from densebatch.data.store.store import DocumentStore
from densebatch.errors import ConfigError, UserError
from densebatch.model import build_model
from densebatch.model.attention import resolve_backend
from densebatch.model.hf.checks import check_model_dir
from densebatch.model.hf.lora import lora_summary
from densebatch.model.hf.weights import fill_from_files, missing_weights, weight_files
from densebatch.model.io import check_saved_gpt
from densebatch.run.configure import resolve_config  # noqa: F401 - where the commands that build models find it
from densebatch.run.context import context_mesh
from densebatch.run.data_commands import prepare_data
from densebatch.run.preference import is_pairs, pair_loading
from densebatch.train.distributed import Distributed, check_device
from densebatch.train.loop import resolve_device
from densebatch.train.meta_init import InitRecord, MetaInitError, materialise, record_init, recording, storage_key
from densebatch.train.parallel.mesh import ContextRanks


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def longest_row(cfg: RunConfig, prepared: Prepared) -> tuple[int, str]:
    """The longest row any batch of the run can hold (train and full-context eval), and the key that sets it."""
    train, key = longest_train_row(cfg.batching, prepared.train.max_length)
    longest = max(train, prepared.eval.max_length if prepared.eval is not None else 0)
    m = cfg.batching.pad_to_multiple_of
    return -(-longest // m) * m, key


def check_context(model, cfg: RunConfig, prepared: Prepared) -> None:
    """Rows longer than the model's context would fail deep inside the model: refuse them up front."""
    ctx = getattr(model, "max_positions", None)
    row, key = longest_row(cfg, prepared)
    if ctx is not None and row > ctx:
        what = "model.block_size" if cfg.model.kind == "gpt" else f"the model's context ({cfg.model.path})"
        raise ConfigError(
            f"{key}: rows of up to {row} tokens exceed {what} of {ctx} positions; lower {key}"
            + (" or raise model.block_size" if cfg.model.kind == "gpt" else "")
        )


def prepare_on_every_rank(cfg: RunConfig, dist: Distributed) -> Prepared:
    """Every rank tokenises its share of what is not prepared yet (``prepare_share``); rank 0 then assembles
    the entry (or finds the cache) and prints the summary; the others then read what it wrote."""
    if dist.enabled:
        problem: UserError | None = None
        try:
            prepare_share(cfg.data, dist.rank, dist.world_size)
        except UserError as e:  # bad input: every rank reads the same records and says the same
            problem = e
        if dist.agree(problem is not None):  # one rank failing stops all: none waits at the barrier below
            raise problem or UserError("data: preparing the documents failed on another rank (its message says why)")
        dist.barrier()
    problem = None
    if dist.is_main:
        try:  # the bad input only the whole pass finds (a malformed line under bpe:N, the eval split): every rank stops
            prepared = prepare_data(cfg.data, cfg.seed)
        except UserError as e:
            problem = e
        else:
            print(prepared.summary, flush=True)
            if (line := added_tokens_line(prepared.tokenizer.added)) is not None:
                print(line, flush=True)
    if dist.agree(problem is not None):  # in place of the barrier: none waits for a rank that failed
        raise problem or UserError("data: preparing the documents failed on rank 0 (its message says why)")
    if not dist.is_main:
        prepared = prepare_data(cfg.data, cfg.seed)
    return prepared


MAX_CUT_SHARE = 0.5  # long_docs: truncate may cut at most this share of the training loss tokens


def check_truncation(cfg: RunConfig, prepared: Prepared) -> str | None:
    """What ``batching.long_docs: truncate`` cuts of the training targets: ``ConfigError`` when it would leave
    none, or cut more than ``MAX_CUT_SHARE`` of them (a run that learns from what is left would look fine
    and be wrong); otherwise a line saying what is cut (None when nothing is)."""
    cut = truncation_cap(cfg.batching)
    store = prepared.train
    if cut is None:
        return None
    cap, key = cut
    lost, docs = loss_tokens_cut(store, cap)
    if not docs:
        return None
    total = int(store.meta.get("num_loss_tokens") or np.asarray(store.loss_mask).sum(dtype=np.int64))
    what = f"{lost} of {total} loss tokens in {docs} of {len(store)} documents longer than {cap} tokens"
    if total and lost / total > MAX_CUT_SHARE:
        raise ConfigError(
            f"batching.long_docs: truncate would cut {what} (more than {MAX_CUT_SHARE:.0%}): use long_docs: split, or raise {key}"
        )
    return f"batching.long_docs: truncate cuts {what}"


def build_run_model(cfg: RunConfig, prepared: Prepared, device: torch.device, on_meta: bool = False):
    """(the run's model, not wrapped; the record of its initialisation or None; why it was not built on the
    meta device, or None): seeded first (its initial weights depend only on ``seed``), added tokens' rows
    the mean of the others, the run's label smoothing, context checked. On ``device``; or with ``on_meta``
    and a model whose initialisation can be replayed (``train/meta_init.py``), on the meta device with the
    record, for ``materialise_run_model`` once it is sharded."""
    tok = prepared.tokenizer

    def build(empty_weights: bool = False, after_load=None):
        seed_everything(cfg.seed)
        return build_model(
            cfg.model, vocab_size=tok.vocab_size, base_vocab_size=tok.base_vocab_size, empty_weights=empty_weights,
            after_load=after_load, task=cfg.batching.mode,
            label_smoothing=cfg.train.label_smoothing if cfg.train.objective == "sft" else 0.0,  # dpo's is its own
        )  # fmt: skip

    record, why = None, None
    if on_meta and cfg.model.kind == "hf":
        model, record, why = hf_on_meta(cfg.model.path, build)
    elif on_meta:
        try:
            model, record = record_init(build)
        except MetaInitError as e:
            model, why = build(), str(e)
    else:
        model = build()
    check_context(model, cfg, prepared)
    return (model if record is not None else model.to(device)), record, why


def hf_on_meta(path: str, build):
    """(model, record, why not) of the Hugging Face model in ``path``, built by ``build(empty_weights=,
    after_load=)`` (``build_model`` after seeding), whose weights each rank reads in slices; LoRA
    adapters replayed from the record of what the whole build draws after loading (meta_init)."""
    if weight_files(path) is None:
        return build(), None, "no safetensors weights to read in slices"
    record = InitRecord()
    model = build(empty_weights=True, after_load=recording(record))
    params = dict(model.named_parameters())
    if missing := missing_weights(model, [n for n in params if "lora_" not in n]):
        return build(), None, f"the weight files lack {missing[0]} (and {len(missing) - 1} more)"
    record.names = {storage_key(p): n for n, p in params.items() if "lora_" in n}  # what the ops make
    if problem := record.problem_of(record.names):
        return build(), None, f"a LoRA adapter's initialisation {problem}"
    record.fill = lambda shards: fill_from_files(model, shards)
    return model, record, None


def materialise_run_model(cfg: RunConfig, *, model, record: InitRecord, device: torch.device, dist: Distributed) -> None:
    """Each rank's shards of a model built on the meta device, bit for bit those of the whole build."""
    seed_everything(cfg.seed)
    materialise(model, record, device)
    if dist.is_main:
        n = sum(p.numel() for p in model.parameters())
        print(
            f"model: built on the meta device; each of {dist.world_size} ranks materialised only its shards of {n:,} parameters",
            flush=True,
        )


def eval_settings(cfg: RunConfig, store: DocumentStore, lengths=None) -> PlanSettings:
    """The plan of every evaluation (inside a run and ``densebatch eval``): the run's batching, with
    rows long enough for the longest document, so no document is split and every strategy scores
    the same loss (``lengths``: as laid out, when that is not as stored: pairs with their prompt twice)."""
    longest = store.max_length if lengths is None else int(np.max(lengths, initial=0))
    return full_context_settings(PlanSettings.from_config(cfg.batching), longest)


def eval_store(cfg: RunConfig, store: DocumentStore) -> DocumentStore:
    """What every evaluation scores of ``store`` (an eval split): its documents that ``eval.max_tokens``
    selects (``store_epochs.eval_documents``), the whole split when it fits."""
    docs = eval_documents(store.lengths, cfg.eval.max_tokens, cfg.seed)
    return store if docs is None else store.subset(docs)


def collation(cfg: RunConfig, store: DocumentStore, reference=None):
    """(the collator of ``store``, the lengths its plans see: None when as stored): preference pairs'
    (``run/preference.py``: their layout, the reference table of ``train.reference: precompute``), or the
    batching mode's."""
    if is_pairs(store):
        return pair_loading(cfg, store, reference)
    return collator_from_config(cfg.batching, store.meta, cfg.seed), None


def eval_loader(
    cfg: RunConfig, store: DocumentStore, dist: Distributed | None = None, ranks: ContextRanks | None = None, reference=None
) -> StepLoader:
    """The loader of ``store`` (an eval split; only what ``eval.max_tokens`` selects) under
    ``eval_settings``: one batch a step, no prefetch. Cap its batches with ``iter_epoch(0, eval.max_batches)``.
    ``ranks``: the data × context mesh; the batches are dealt over its data ranks (None: over ``dist``'s).
    ``reference``: a precomputed reference's table of these pairs (``train.reference: precompute``)."""
    dist = dist or Distributed()
    store = eval_store(cfg, store)
    collator, lengths = collation(cfg, store, reference)
    ranks = ranks or ContextRanks(data_rank=dist.rank, data_size=dist.world_size)
    steps = StepSettings(1, None, ranks.data_size, ranks.data_rank)
    settings = eval_settings(cfg, store, lengths)
    return StepLoader(store, settings=settings, collator=collator, seed=cfg.seed, steps=steps, prefetch=0, lengths=lengths)


def build_loaders(
    cfg: RunConfig, prepared: Prepared, dist: Distributed, ranks: ContextRanks | None = None, reference: dict | None = None
):
    """(train StepLoader, eval batches factory or None), their steps dealt over the data ranks of ``ranks`` (the
    context ranks of a data rank read the same rows; None: every rank is a data rank); ``reference``: {split:
    table} of a precomputed reference (preference pairs)."""
    settings = PlanSettings.from_config(cfg.batching)
    t = cfg.train
    ranks = ranks or ContextRanks(data_rank=dist.rank, data_size=dist.world_size)
    steps = StepSettings(t.grad_accum_batches, t.loss_tokens_per_step, ranks.data_size, ranks.data_rank)
    reference = reference or {}
    collator, lengths = collation(cfg, prepared.train, reference.get("train"))
    loader = StepLoader(
        prepared.train,
        settings=settings,
        collator=collator,
        seed=cfg.seed,
        steps=steps,
        prefetch=cfg.batching.prefetch,
        weights=prepared.weights,
        lengths=lengths,
    )
    if prepared.eval is None:
        return loader, None
    evaluation = eval_loader(cfg, prepared.eval, dist, ranks, reference.get("eval"))
    return loader, lambda: evaluation.iter_epoch(0, cfg.eval.max_batches)  # a global cap: N ranks score what 1 does


def source_weights(cfg: RunConfig, prepared: Prepared, loader: StepLoader | None = None) -> list[float] | None:
    """Each source's weight of its loss tokens in the gradient (``train.source_balance``; None: one source,
    or every loss token alike): ``data/plan/source_balance.py``'s factors of the training documents, for
    the plans sized by a token budget (packed, token_budget), whose steps hold about as many loss tokens
    each. random and length_grouped batches hold ``rows_per_batch`` rows and weigh sources as they do.
    ``loader``: the run's, whose epoch-0 plan already drew a weighted mixture's documents."""
    if cfg.train.source_balance != "batches" or not sized_by_budget(cfg.batching.strategy) or is_pairs(prepared.train):
        return None  # preference pairs weigh alike
    store = prepared.train
    counts = store.lengths if cfg.batching.mode == "mlm" else None  # masked-LM targets: a share of every token
    selection = loader.selection(0) if loader is not None else None
    factors = batch_balance(
        store, weights=prepared.weights, seed=cfg.seed, rows=cfg.batching.rows_per_batch, counts=counts, selection=selection
    )
    return None if factors is None else [float(f) for f in factors]


def usable_device(name: str) -> torch.device:
    """``train.device`` resolved (``resolve_device``), refused in one line when it names cuda on a machine or a
    torch build without it."""
    check_device(name)
    return resolve_device(name)


def training_device(cfg: RunConfig, dist: Distributed) -> torch.device:
    """The device a run trains on, refused in one line when this machine cannot train there: ``train.device``
    cuda without CUDA, or a ``model.attention`` kernel with no backward pass on it (flex on CPU; varlen
    without CUDA FlashAttention), which would otherwise fail inside the first step."""
    device = dist.device if dist.enabled else usable_device(cfg.train.device)
    if cfg.model.kind == "gpt" or cfg.model.attn_implementation == "densebatch":  # densebatch's kernels
        resolve_backend(cfg.model.attention, device, training=True)
    return device


@dataclass
class Setup:
    """What ``setup`` built: the configuration, the ranks, the documents and the model on its device."""

    cfg: RunConfig
    dist: Distributed
    prepared: Prepared
    model: torch.nn.Module
    device: torch.device
    init: InitRecord | None = None  # the model is on the meta device until materialise_run_model
    context: ContextRanks = field(default_factory=ContextRanks)  # the data x context mesh (train.context_parallel)


def setup(cfg: RunConfig, dist: Distributed, on_meta: bool = False) -> Setup:
    """Documents and model as every training command builds them (``cfg`` already resolved). What can be
    refused without work is refused first: a wrong ``model.path``, an ``output_dir`` that cannot be written
    (``data.cache_dir`` is tried when an entry is to be written: a complete entry reads without writing).
    ``on_meta``: the model is to be sharded, built on the meta device where it can be (``build_run_model``)."""
    device = training_device(cfg, dist)
    if cfg.model.kind == "hf":  # a wrong model.path is refused before the data is prepared
        check_model_dir(cfg.model.path, cfg.batching.mode)
    elif cfg.model.path:  # the reference GPT from a saved one: an empty or Hugging Face directory is a mistake
        check_saved_gpt(cfg.model.path)
    context = context_mesh(cfg, dist)  # train.context_parallel: refused in one line now, or the ranks' mesh
    problem = None
    if dist.is_main:  # train holds its lock there already; the finders write their results there at the end
        try:
            check_writable(cfg.output_dir, "output_dir")
        except UserError as e:
            problem = e
    if dist.agree(problem is not None):  # every rank stops: none waits for rank 0 at the data barrier
        raise problem or UserError(f"output_dir {cfg.output_dir}: rank 0 cannot write it (see its message)")
    prepared = prepare_on_every_rank(cfg, dist)
    if (cut := check_truncation(cfg, prepared)) is not None and dist.is_main:
        print(cut, flush=True)
    model, record, why = build_run_model(cfg, prepared, device, on_meta)
    if dist.is_main and why is not None:
        print(
            f"model: built whole on each rank, then sharded (its initialisation cannot be replayed shard by shard: {why})",
            flush=True,
        )
    if dist.is_main and (line := lora_summary(model)) is not None:
        print(line, flush=True)
    return Setup(cfg, dist, prepared, model, device, record, context)
