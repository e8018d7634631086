"""Cross-field rules of a run configuration, each in one place (one field alone is checked by its type)."""

from __future__ import annotations

import string

from densebatch.config.data_sections import DataConfig
from densebatch.config.model_section import ModelConfig
from densebatch.config.run_sections import RunConfig
from densebatch.errors import ConfigError


def prompt_fields(prompt_format: str, key: str = "data.prompt_format") -> list[str]:
    """The record fields a custom prompt format names; ConfigError (naming ``key``) for positional or malformed
    ones, and for conversions (``{q!r}``) and format specs (``{q:>9}``): a field's text goes in as it is."""
    try:
        parts = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(prompt_format) if name is not None]
    except ValueError as e:
        raise ConfigError(f"{key}: {e} (write literal braces as {{{{ and }}}})") from None
    names = [name for name, _, _ in parts]
    if any(not n or not n.isidentifier() for n in names):
        raise ConfigError(f"{key}: every placeholder must name a record field, like {{question}}; got {names}")
    for name, spec, conv in parts:
        if spec or conv:
            written = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            raise ConfigError(
                f"{key}: placeholder {written} has a "
                + ("conversion" if conv else "format spec")
                + f"; a record field goes in as its text: write {{{name}}} (literal braces as {{{{ and }}}})"
            )
    return names


def _check(cfg: RunConfig) -> None:
    """Cross-field rules that one field alone cannot express."""
    d, b, m = cfg.data, cfg.batching, cfg.model
    if d.template == "custom" and not d.sources:
        if not d.prompt_format:
            raise ConfigError("data.prompt_format: required when data.template is custom, e.g. 'Question: {question}\\nAnswer: '")
        prompt_fields(d.prompt_format)
    _check_sources(d)
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction: expected a number in [0, 1); got {d.eval_fraction}")
    if not 0.5 <= d.clean.near_threshold <= 1.0:
        raise ConfigError(f"data.clean.near_threshold: expected a number in [0.5, 1]; got {d.clean.near_threshold}")
    if not 0.0 < b.mlm_probability < 1.0:
        raise ConfigError(f"batching.mlm_probability: expected a number in (0, 1); got {b.mlm_probability}")
    if b.mode == "mlm" and m.kind != "hf":
        raise ConfigError(
            "batching.mode: mlm trains an encoder masked LM (model.kind: hf, a directory saved as ...ForMaskedLM); "
            "the reference GPT is a causal model: set batching.mode: causal"
        )
    if b.mode == "mlm" and m.lora.r:
        raise ConfigError("model.lora.r: LoRA adapts causal LMs here; batching.mode mlm trains the whole encoder (set it to 0)")
    if m.kind == "hf" and not m.path:
        raise ConfigError("model.path: required when model.kind is hf (a local directory with config.json)")
    if m.kind == "gpt" and m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd: expected a multiple of model.n_head ({m.n_head}); got {m.n_embd}")
    _check_hf_model(m)
    _check_probabilities(cfg)
    _check_objective(cfg)
    if not 0.0 < cfg.train.guard.rollback_lr_factor <= 1.0:
        raise ConfigError(
            f"train.guard.rollback_lr_factor: expected a number in (0, 1]; got {cfg.train.guard.rollback_lr_factor}"
        )
    _check_schedules(cfg)
    _check_finders(cfg)


PREFERENCE = ("dpo", "simpo", "orpo")  # the objectives that train on pairs


def _check_objective(cfg: RunConfig) -> None:
    """train.objective against the data it reads (pairs or documents) and the keys each objective reads."""
    t, d = cfg.train, cfg.data
    eps = t.label_smoothing
    if t.objective == "sft":
        if not 0.0 <= eps < 1.0:
            raise ConfigError(f"train.label_smoothing: expected a number in [0, 1); got {eps}")
        if d.pairs is True:
            raise ConfigError("data.pairs: true trains on preference pairs: set train.objective to dpo, simpo or orpo")
        return
    if d.pairs is False:
        raise ConfigError(f"data.pairs: false, but train.objective {t.objective} trains on preference pairs (set it to auto)")
    if t.objective == "orpo" and eps:
        raise ConfigError("train.label_smoothing: orpo has no label smoothing (TRL's ORPOTrainer neither); set it to 0")
    if not 0.0 <= eps < 0.5:
        raise ConfigError(f"train.label_smoothing: {t.objective}: the share of flipped preferences, in [0, 0.5); got {eps}")
    if not t.beta > 0.0:
        raise ConfigError(f"train.beta: expected a number above 0; got {t.beta}")
    if cfg.batching.mode == "mlm":
        raise ConfigError(f"batching.mode: mlm trains an encoder; train.objective {t.objective} needs a causal LM")
    if t.context_parallel > 1:
        raise ConfigError(
            f"train.context_parallel: a pair's branches are not split over context ranks: set it to 1 for {t.objective}"
        )


def _check_hf_model(m: ModelConfig) -> None:
    """What LoRA and the weights' dtype allow (which keys only Hugging Face models read: ``config/applies.py``)."""
    if not 0.0 <= m.lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout: expected a probability in [0, 1); got {m.lora.dropout}")
    if m.lora.r and m.lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha: expected a positive scale; got {m.lora.alpha}")
    if m.dtype == "float16" and not m.lora.r:
        raise ConfigError(
            "model.dtype: float16 weights cannot be trained themselves (loss scaling refuses float16 gradients); "
            "use bfloat16, or LoRA (model.lora.r > 0: the adapters train in float32)"
        )


def _check_probabilities(cfg: RunConfig) -> None:
    """Ranges torch enforces only once the model or optimizer is built (a traceback by then): [0, 1) each."""
    o = cfg.train.optimizer
    for key, value in (
        ("model.dropout", cfg.model.dropout),
        ("train.optimizer.beta1", o.beta1),
        ("train.optimizer.beta2", o.beta2),
    ):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key}: expected a number in [0, 1); got {value}")


def _check_sources(d: DataConfig) -> None:
    """A mixture: paths set, names unique, weights on every source or on none, a custom prompt where needed."""
    if not d.sources:
        return
    if d.path is not None or d.eval_path is not None:
        which = "data.path" if d.path is not None else "data.eval_path"
        raise ConfigError(f"{which}: unset it when data.sources is set (give each source its path and eval_path)")
    seen: dict[str, int] = {}
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not s.path:
            raise ConfigError(f"{key}.path: required (the source's file or directory)")
        if s.label in seen:
            raise ConfigError(
                f"{key}.name: {s.label!r} already names data.sources[{seen[s.label]}]; give each source its own name"
            )
        seen[s.label] = i
        if (s.template or d.template) == "custom":
            fmt = s.prompt_format or d.prompt_format
            if not fmt:
                raise ConfigError(f"{key}.prompt_format: required when the source's template is custom")
            prompt_fields(fmt, f"{key}.prompt_format" if s.prompt_format else "data.prompt_format")
    weighted = [s.weight is not None for s in d.sources]
    if any(weighted) and not all(weighted):
        i = weighted.index(False)
        raise ConfigError(f"data.sources[{i}].weight: set a weight on every source, or on none (natural shares)")
    if all(weighted) and not any(s.weight > 0 for s in d.sources):
        raise ConfigError("data.sources[0].weight: at least one source needs a weight > 0")


def _check_finders(cfg: RunConfig) -> None:
    """``auto`` values and the finders' ranges."""
    f = cfg.finder
    if not 0.0 <= f.memory_reserve <= 0.9:
        raise ConfigError(f"finder.memory_reserve: expected a share in [0, 0.9]; got {f.memory_reserve}")
    if not 0.0 < f.lr_start < f.lr_end:
        raise ConfigError(f"finder.lr_start: expected 0 < lr_start < finder.lr_end ({f.lr_end}); got {f.lr_start}")
    if not 0.0 <= f.smoothing < 1.0:
        raise ConfigError(f"finder.smoothing: expected a weight in [0, 1); got {f.smoothing}")
    if not 0.0 < f.throughput_share <= 1.0:
        raise ConfigError(f"finder.throughput_share: expected a share in (0, 1]; got {f.throughput_share}")
    if f.trials == 1:
        raise ConfigError("finder.trials: expected 0 (off) or at least 2 rates to compare; got 1")


def _check_schedules(cfg: RunConfig) -> None:
    """Batch-size schedule and layer-wise rates: ranges that depend on whether the feature is on."""
    t = cfg.train
    if not 0.0 < t.layer_lr_decay <= 1.0:
        raise ConfigError(f"train.layer_lr_decay: expected a number in (0, 1]; got {t.layer_lr_decay}")
    s = t.batch_schedule
    if s.ramp_steps and not 0.0 < s.ramp_start <= 1.0:
        raise ConfigError(
            f"train.batch_schedule.ramp_start: expected a fraction of the target step in (0, 1]; got {s.ramp_start}"
        )
    if s.backoff_patience:
        if s.backoff_factor <= 0.0 or s.backoff_factor == 1.0:
            raise ConfigError(
                f"train.batch_schedule.backoff_factor: expected a positive number other than 1; got {s.backoff_factor}"
            )
        if not 0.0 < s.backoff_floor <= 1.0:
            raise ConfigError(f"train.batch_schedule.backoff_floor: expected a number in (0, 1]; got {s.backoff_floor}")
        if not cfg.eval.every_steps:
            raise ConfigError("train.batch_schedule.backoff_patience: a back-off watches evaluations; set eval.every_steps too")
