"""Where each configuration key takes effect (one concept, 480 lines: a declaration for each of the ~180 keys, which stay together so that a key's neighbours show how to declare it).

``APPLIES`` holds a ``Rule`` (``config/applicability.py``) for every key ``densebatch config --keys``
lists; ``SOURCE_APPLIES`` one for each key of a ``data.sources`` item, judged on that source.
``check_applicability(cfg)`` enforces them: a refusal (``ConfigError``) or the note lines to print. What
the data section reads (records densebatch tokenises, or a corpus of token ids another engine wrote, in
which templates, fields, cleaning and loss masks have no effect) is read off ``readers(cfg)``: one per
source, each with what it sets itself and what it takes from ``data.*``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from densebatch.config.applicability import ALWAYS, COMMANDS, STRATEGY, Rule, above, enforce, get, when
from densebatch.config.data_sections import FieldsConfig, SourceConfig
from densebatch.config.run_sections import RunConfig

FOREIGN = ("megatron", "datatrove", "litdata", "mds")  # formats of token ids another engine wrote (no text)
FLOORED = ("cosine", "linear")  # schedules that decay to a min_lr_ratio
CORPUS = {"data.format": "megatron", "data.path": "corpus"}  # settings of a corpus of token ids, for on / off
HF = {"model.kind": "hf", "model.path": "model-dir"}


# ------------------------------------------------------------------ what the data section reads
@dataclass(frozen=True)
class Reader:
    """How one source of documents is read: the ``data`` section, or one ``data.sources`` item with what it
    leaves unset taken from ``data.*``; ``own``: the keys the source sets itself."""

    format: str
    template: str
    eval_path: str | None
    own: frozenset[str] = frozenset()

    @property
    def foreign(self) -> bool:
        return self.format in FOREIGN

    @property
    def effective_template(self) -> str:
        return "raw" if self.format == "text" else self.template  # a text file's paragraphs are the text


def readers(cfg: RunConfig) -> list[Reader]:
    d = cfg.data
    if not d.sources:
        return [Reader(d.format, d.template, d.eval_path)]
    out = []
    for s in d.sources:
        own = frozenset(f.name for f in dataclasses.fields(SourceConfig) if getattr(s, f.name) is not None)
        out.append(Reader(s.format or d.format, s.template or d.template, s.eval_path, own))
    return out


def _text(cfg: RunConfig) -> bool:
    return any(not r.foreign for r in readers(cfg))


def _taking(cfg: RunConfig, attr: str) -> list[Reader]:
    """The readers that take ``data.<attr>`` (all of them without sources; else the sources that leave it unset)."""
    return [r for r in readers(cfg) if attr not in r.own]


def _formats_now(cfg: RunConfig) -> str:
    formats = sorted({r.format for r in readers(cfg)})
    foreign = all(f in FOREIGN for f in formats)
    return f"data.format is {', '.join(formats)}" + (" (token ids another engine wrote: no text)" if foreign else "")


TEMPLATE_FIELDS = {  # template -> the data.fields keys it reads
    "alpaca": ("instruction", "input", "output"),
    "chatml": ("messages", "role", "content"),
    "chat_template": ("messages", "role", "content"),
    "raw": ("text",),
    "custom": ("output",),
}
PRETOKENISED = ("input_ids", "labels")  # pre-tokenised records, under any template
PAIR_FIELDS = ("prompt", "chosen", "rejected")  # preference pairs (data.pairs), under any template
PREFERENCE = ("dpo", "simpo", "orpo")  # the objectives that train on pairs


def _pairs(cfg: RunConfig) -> bool:
    """Whether the records are read as preference pairs (``data.pairs``, auto: a preference objective)."""
    return cfg.data.pairs is True or (cfg.data.pairs == "auto" and cfg.train.objective in PREFERENCE)


def reads_field(r: Reader, name: str, pairs: bool = False) -> bool:
    """Whether documents read by ``r`` use ``data.fields.<name>`` (``pairs``: the records are preference pairs)."""
    if r.foreign:
        return r.format == "mds" and name == "input_ids"  # mds: the column of token ids
    if name in PAIR_FIELDS:
        return pairs
    return name in PRETOKENISED or name in TEMPLATE_FIELDS[r.effective_template]


def _field_rule(name: str) -> Rule:
    if name in PAIR_FIELDS:
        return Rule(
            lambda cfg, _: _pairs(cfg) and any(reads_field(r, name, True) for r in _taking(cfg, "fields")),
            "records read as preference pairs (data.pairs true, or auto with train.objective dpo, simpo or orpo)",
            lambda cfg: f"data.pairs is {cfg.data.pairs} and train.objective {cfg.train.objective}",
            False,
            {"train.objective": "dpo"},
            {},
            "set train.objective (dpo, simpo or orpo) to train on pairs",
        )
    if name in PRETOKENISED:
        needs, on, off = "data.format of records (not a megatron/datatrove/litdata corpus of token ids)", {}, CORPUS
    else:
        templates = [t for t, names in TEMPLATE_FIELDS.items() if name in names]
        needs, on = f"data.template {' or '.join(templates)}", {"data.template": templates[0]}
        off = {"data.template": "alpaca" if name == "text" else "raw"}
    return Rule(
        lambda cfg, _: any(reads_field(r, name) for r in _taking(cfg, "fields")),
        needs,
        lambda cfg: f"data.template is {', '.join(sorted({r.effective_template for r in readers(cfg)}))}, " + _formats_now(cfg),
        False,
        on,
        off,
        "map the field the template reads, or set data.template",
    )


def _default_data(cfg: RunConfig) -> bool:
    return cfg.data.path is None and not cfg.data.sources


def _data_now(cfg: RunConfig) -> str:
    return (
        "data.path is null (the embedded default dataset)" if _default_data(cfg) else "data.path / data.sources name your files"
    )


def _own_data(needs: str = "data.path or data.sources (files of your own)") -> Rule:
    return Rule(lambda cfg, _: not _default_data(cfg), needs, _data_now, True, {"data.path": "x.json"}, {})


def _default_only(needs: str = "data.path null (the embedded default dataset)", inert: tuple = ()) -> Rule:
    return Rule(lambda cfg, _: _default_data(cfg), needs, _data_now, True, {}, {"data.path": "x.json"}, inert=inert)


def _objective(*names: str) -> Rule:
    """Read by these objectives only; beside another one a note (a file keeps an objective's settings while the
    command line compares objectives)."""
    return when("train.objective", *names, harmless=True, off={"train.objective": "sft"})


def _group_floor(group: str) -> Rule:
    def applies(cfg: RunConfig, _: Any) -> bool:
        own = get(cfg, f"train.{group}.schedule")
        return (cfg.train.schedule if own == "same" else own) in FLOORED

    return Rule(
        applies,
        f"train.{group}.schedule cosine or linear (or same, with train.schedule cosine or linear)",
        lambda cfg: f"train.{group}.schedule is {get(cfg, f'train.{group}.schedule')} and train.schedule {cfg.train.schedule}",
        True,
        {f"train.{group}.schedule": "cosine"},
        {f"train.{group}.schedule": "constant"},
    )


def _text_rule(needs: str, *, harmless: bool) -> Rule:
    return Rule(lambda cfg, _: _text(cfg), needs, _formats_now, harmless, {}, CORPUS)


CLEAN_KEYS = ("fix_encoding", "strip_html", "nfkc", "control_chars", "collapse_whitespace", "terms", "dedupe")
HEALTH_KEYS = (
    "warmup_steps",
    "data_wait_share",
    "memory_headroom",
    "slow_ratio",
    "fill_ratio",
    "clip_share",
    "clip_warmup_steps",
)
GROUPS = ("embeddings", "blocks", "head")

APPLIES: dict[str, Rule] = {
    "output_dir": ALWAYS,
    "seed": ALWAYS,
    # ----------------------------------------------------------------------------- data
    "data.path": ALWAYS,
    "data.sources": ALWAYS,
    "data.format": Rule(
        lambda cfg, _: bool(_taking(cfg, "format")),
        "no data.sources, or a source that sets no format of its own",
        lambda cfg: "every data.sources item sets its own format",
        True,
        {},
        {"data.sources": [{"path": "a.json", "format": "json"}, {"path": "b.json", "format": "json"}]},
    ),
    "data.bytes_dtype": Rule(
        lambda cfg, _: any(r.format == "mds" for r in readers(cfg)),
        "data.format mds (a token column written as bytes)",
        _formats_now,
        False,
        {"data.format": "mds", "data.path": "corpus"},
        {},
    ),
    "data.eval_path": ALWAYS,
    "data.eval_fraction": Rule(
        lambda cfg, _: any(r.eval_path is None for r in readers(cfg)),
        "data.eval_path unset (on data, or on a source)",
        lambda cfg: "every source sets its eval_path" if cfg.data.sources else "data.eval_path names the eval split",
        True,
        {},
        {"data.eval_path": "eval.json"},
    ),
    **{f"data.fields.{f.name}": _field_rule(f.name) for f in dataclasses.fields(FieldsConfig)},
    "data.template": Rule(
        lambda cfg, value: any(not r.foreign and (r.format != "text" or value == "raw") for r in _taking(cfg, "template")),
        "data.format of records densebatch renders (not megatron/datatrove/litdata/mds; format text reads raw)",
        _formats_now,
        False,
        {},
        CORPUS,
    ),
    "data.prompt_format": Rule(
        lambda cfg, _: any(r.effective_template == "custom" and not r.foreign for r in _taking(cfg, "prompt_format")),
        "data.template custom",
        lambda cfg: f"data.template is {cfg.data.template}",
        False,
        {"data.template": "custom"},
        {},
        "set data.template: custom to use it",
    ),
    "data.loss_on": Rule(
        lambda cfg, _: any(not r.foreign for r in _taking(cfg, "loss_on")),
        "data.format of records densebatch tokenises (in a megatron/datatrove/litdata/mds corpus every token but a document's first carries loss)",
        _formats_now,
        False,
        {},
        CORPUS,
        inert=("all",),  # what such a corpus does anyway
    ),
    "data.text_split": Rule(
        lambda cfg, _: any(r.format in ("text", "auto") for r in readers(cfg)),
        "data.format text (or auto, for a .txt file)",
        _formats_now,
        False,
        {"data.format": "text"},
        {"data.format": "json"},
    ),
    "data.chunk_tokens": Rule(
        lambda cfg, _: cfg.data.text_split == "chunks" and any(r.format in ("text", "auto") for r in readers(cfg)),
        "data.text_split chunks (format text)",
        lambda cfg: f"data.text_split is {cfg.data.text_split}",
        False,
        {"data.text_split": "chunks"},
        {},
        "set data.text_split: chunks to cut the text into documents of that many tokens",
    ),
    **{
        f"data.clean.{k}": _text_rule("data.format of records densebatch reads as text (cleaning needs text)", harmless=False)
        for k in CLEAN_KEYS
    },
    **{
        f"data.clean.{k}": _text_rule("data.format of records densebatch reads as text", harmless=False)
        for k in ("min_chars", "max_chars")
    },
    "data.clean.near_threshold": when("data.clean.dedupe", "near", off={"data.clean.dedupe": "exact"}),
    **{f"data.{k}": ALWAYS for k in ("tokenizer", "add_tokens", "add_special_tokens", "pad_id", "max_seq_len", "overlong")},
    **{
        f"data.{k}": _text_rule("data.format of records densebatch tokenises (not megatron/datatrove/litdata/mds)", harmless=True)
        for k in ("num_proc", "chunk_records", "shard_tokens", "on_bad_record")
    },
    "data.cache_dir": ALWAYS,
    "data.pairs": ALWAYS,
    "data.verify_inputs": _own_data(),
    "data.default.num_records": _default_only(),
    "data.default.seed": _default_only(),
    # ------------------------------------------------------------------------- batching
    "batching.strategy": ALWAYS,
    "batching.mode": ALWAYS,
    **{
        f"batching.{k}": STRATEGY
        for k in (
            "rows_per_batch",
            "max_tokens_per_batch",
            "seq_len",
            "long_docs",
            "mega_batch_mult",
            "bundle_tokens",
            "drop_last",
        )
    },
    "batching.pad_to_multiple_of": ALWAYS,
    "batching.mlm_probability": when(
        "batching.mode", "mlm", on={"batching.mode": "mlm", **HF}, off={"batching.mode": "causal", **HF}
    ),
    "batching.prefetch": ALWAYS,
    "batching.shard_docs": ALWAYS,
    # ---------------------------------------------------------------------------- model
    "model.kind": ALWAYS,
    "model.path": ALWAYS,  # hf: the model's directory; gpt: a saved reference GPT (model/__init__.saved_gpt)
    **{
        f"model.{k}": when("model.kind", "gpt", harmless=True, off=HF)  # the model directory's config.json sets it
        for k in ("n_layer", "n_head", "n_embd", "block_size", "dropout", "vocab_size")
    },
    "model.attention": Rule(
        lambda cfg, value: (
            cfg.model.kind == "gpt" or cfg.model.attn_implementation == "densebatch" or value in ("auto", "masked")
        ),
        "model.kind gpt, or model.attn_implementation densebatch",
        lambda cfg: f"model.attn_implementation is {cfg.model.attn_implementation}",
        False,
        {},
        {**HF, "model.attn_implementation": "sdpa"},
        "transformers' own kernels take a 4-D document mask: use auto or masked",
    ),
    "model.gradient_checkpointing": ALWAYS,
    **{
        f"model.{k}": when(
            "model.kind",
            "hf",
            on=HF,
            off={"model.kind": "gpt"},
            fix="the reference GPT trains in float32 through model.attention",
        )
        for k in ("attn_implementation", "dtype")
    },
    "model.lora.r": when(
        "model.kind",
        "hf",
        on=HF,
        off={"model.kind": "gpt"},
        fix="LoRA adapts Hugging Face models: set it to 0 for the reference GPT",
    ),
    **{f"model.lora.{k}": above("model.lora.r", on=8, base=HF) for k in ("alpha", "dropout", "target_modules")},
    # ---------------------------------------------------------------------------- train
    **{f"train.{k}": ALWAYS for k in ("max_steps", "max_epochs", "max_tokens", "lr", "schedule", "warmup_steps")},
    "train.min_lr_ratio": Rule(
        lambda cfg, _: cfg.train.schedule in FLOORED or any(get(cfg, f"train.{g}.schedule") in FLOORED for g in GROUPS),
        "train.schedule cosine or linear (or a layer group's)",
        lambda cfg: f"train.schedule is {cfg.train.schedule}",
        True,
        {"train.schedule": "cosine"},
        {"train.schedule": "constant"},
    ),
    **{f"train.{k}": ALWAYS for k in ("lr_mult_embeddings", "lr_mult_blocks", "lr_mult_head", "layer_lr_decay")},
    **{f"train.optimizer.{k}": ALWAYS for k in ("weight_decay", "beta1", "beta2", "eps")},
    "train.optimizer.decay_all": above("train.optimizer.weight_decay", on=0.1),
    **{f"train.{g}.{k}": ALWAYS for g in GROUPS for k in ("schedule", "warmup_steps")},
    **{f"train.{g}.min_lr_ratio": _group_floor(g) for g in GROUPS},
    "train.batch_schedule.ramp_steps": ALWAYS,
    "train.batch_schedule.ramp_start": above("train.batch_schedule.ramp_steps", on=5),
    "train.batch_schedule.ramp_unit": above("train.batch_schedule.ramp_steps", on=5),
    "train.batch_schedule.backoff_patience": ALWAYS,
    **{
        f"train.batch_schedule.{k}": above("train.batch_schedule.backoff_patience", on=2, base={"eval.every_steps": 5})
        for k in ("backoff_factor", "backoff_floor", "backoff_max")
    },
    "train.batch_schedule.backoff_cap": Rule(
        lambda cfg, _: cfg.train.batch_schedule.backoff_patience > 0 and cfg.train.batch_schedule.backoff_factor > 1,
        "train.batch_schedule.backoff_patience > 0 with backoff_factor > 1 (growth)",
        lambda cfg: (
            f"train.batch_schedule.backoff_patience is {cfg.train.batch_schedule.backoff_patience} and "
            f"backoff_factor {cfg.train.batch_schedule.backoff_factor:g}"
        ),
        True,
        {"train.batch_schedule.backoff_patience": 2, "eval.every_steps": 5, "train.batch_schedule.backoff_factor": 2.0},
        {"train.batch_schedule.backoff_patience": 2, "eval.every_steps": 5},
    ),
    "train.batch_schedule.lr_scaling": Rule(
        lambda cfg, _: cfg.train.batch_schedule.ramp_steps > 0 or cfg.train.batch_schedule.backoff_patience > 0,
        "train.batch_schedule.ramp_steps > 0 or backoff_patience > 0",
        lambda cfg: "train.batch_schedule.ramp_steps and backoff_patience are 0 (one batch size)",
        True,
        {"train.batch_schedule.ramp_steps": 5},
        {},
    ),
    "train.grad_accum_batches": Rule(
        lambda cfg, _: cfg.train.loss_tokens_per_step is None,
        "train.loss_tokens_per_step unset (a step of loss tokens takes as many batches as it needs)",
        lambda cfg: f"train.loss_tokens_per_step is {cfg.train.loss_tokens_per_step}",
        False,
        {},
        {"train.loss_tokens_per_step": 96},
        "set one of the two",
    ),
    "train.loss_tokens_per_step": ALWAYS,
    "train.label_smoothing": ALWAYS,  # sft: label smoothing; dpo, simpo: the share of flipped preferences
    "train.objective": ALWAYS,
    "train.beta": _objective(*PREFERENCE),
    "train.reference": _objective("dpo"),
    "train.simpo_gamma": _objective("simpo"),
    "train.cpo_alpha": _objective("simpo"),
    "train.context_parallel": ALWAYS,  # under torchrun (config/checks.py refuses it where it cannot run)
    "train.source_balance": STRATEGY,  # reweighs a mixture's budget-sized batches only (data/plan/rules.unread_notes)
    "train.grad_clip": ALWAYS,
    "train.grad_clip_mode": above("train.grad_clip"),
    **{
        f"train.{k}": ALWAYS
        for k in ("precision", "compile", "device", "log_every", "progress", "distributed", "report_to", "plots")
    },
    **{f"train.guard.{k}": ALWAYS for k in ("spike_zscore", "max_bad_steps", "rollback_lr_factor")},
    "train.guard.spike_window": above("train.guard.spike_zscore", on=6.0),
    "train.health.enabled": ALWAYS,
    **{
        f"train.health.{k}": when("train.health.enabled", True, harmless=True, off={"train.health.enabled": False})
        for k in HEALTH_KEYS
    },
    "train.memory_limit_gb": ALWAYS,
    # ----------------------------------------------------------------------------- eval
    **{
        f"eval.{k}": Rule(
            lambda cfg, _: cfg.data.eval_fraction > 0 or cfg.data.eval_path is not None or any(r.eval_path for r in readers(cfg)),
            "an eval split (data.eval_path, or data.eval_fraction > 0)",
            lambda cfg: "data.eval_fraction is 0 and no data.eval_path is set",
            True,
            {},
            {"data.eval_fraction": 0.0},
        )
        for k in ("every_steps", "max_tokens", "max_batches")
    },
    "eval.patience": Rule(
        lambda cfg, _: cfg.eval.every_steps > 0,
        "eval.every_steps > 0 (early stopping watches the evaluations during a run)",
        lambda cfg: "eval.every_steps is 0 (one evaluation, at the end)",
        False,
        {"eval.every_steps": 5},
        {},
        "set eval.every_steps too",
    ),
    "eval.accuracy_samples": _default_only(inert=(0,)),  # 0: no accuracy check, as on data of one's own
    "eval.max_new_tokens": Rule(
        lambda cfg, _: _default_data(cfg) and cfg.eval.accuracy_samples > 0,
        "the embedded default dataset's accuracy check (data.path null, eval.accuracy_samples > 0)",
        lambda cfg: _data_now(cfg) if not _default_data(cfg) else "eval.accuracy_samples is 0",
        True,
        {},
        {"eval.accuracy_samples": 0},
    ),
    # ----------------------------------------------------------------------- checkpoint
    **{f"checkpoint.{k}": ALWAYS for k in ("every_steps", "keep_last", "mirror_dir", "resume", "async")},
    # --------------------------------------------------------------------------- finder
    **{
        f"finder.{k}": COMMANDS
        for k in ("lr_start", "lr_end", "lr_steps", "smoothing", "diverge", "heldout_batches", "trials")
        + ("memory_reserve", "max_probes", "throughput_share")
    },
    "finder.trials_always": above("finder.trials", on=3),
    "finder.trial_steps": above("finder.trials", on=3),
}


def _source(test: Callable[[Reader, Any], bool], needs: str) -> Rule:
    """A rule of a ``data.sources`` item's key: ``test(reader of that source, value)``."""
    return Rule(
        lambda cfg, iv: test(readers(cfg)[iv[0]], iv[1]),
        needs,
        lambda cfg, i: (
            f"data.sources[{i}] is read as format {readers(cfg)[i].format}, template {readers(cfg)[i].effective_template}"
        ),
    )


SOURCE_APPLIES: dict[str, Rule] = {  # data.sources[i].<key>, judged on that source
    **{k: ALWAYS for k in ("path", "name", "weight", "format", "eval_path")},
    "template": _source(
        lambda r, value: not r.foreign and (r.format != "text" or value == "raw"),
        "a source densebatch renders (not a megatron/datatrove/litdata/mds corpus; format text reads raw)",
    ),
    "fields": _source(lambda r, _: not r.foreign or r.format == "mds", "a source of records (or mds: its token column)"),
    "prompt_format": _source(
        lambda r, _: r.effective_template == "custom" and not r.foreign, "a source whose template is custom"
    ),
    "loss_on": _source(lambda r, _: not r.foreign, "a source densebatch tokenises (not a megatron/datatrove/litdata/mds corpus)"),
}


def check_applicability(cfg: RunConfig, base: RunConfig | None = None) -> list[str]:
    """Every key of ``cfg`` set away from its default (or ``base``'s value) where it has no effect: ``ConfigError``
    for the first that is not harmless, else the note lines of those that are (``applicability.enforce``)."""
    return enforce(cfg, APPLIES, SOURCE_APPLIES, base)
