"""Run configuration: one YAML file mapped onto nested, documented dataclasses, plus CLI overrides.

Every field carries its documentation in ``metadata["help"]`` (shown by ``densebatch config``); a
field whose value is one of a fixed set is typed ``Literal[...]``, the one place its choices live. ``load_config`` reads a YAML file,
applies ``--section.key=value`` overrides and validates everything; any mistake raises
``ConfigError`` naming the key and what was expected. No ``exec``, no class names in strings.
"""

from __future__ import annotations

import dataclasses
import json
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from densebatch.errors import ConfigError


def _f(default: Any, help: str, minimum: float | None = None, **kw: Any) -> Any:
    meta = {"help": help}
    if minimum is not None:
        meta["minimum"] = minimum
    if callable(default) and not isinstance(default, (int, float, str, bool)):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


# --------------------------------------------------------------------------------------- data
@dataclass
class FieldsConfig:
    """Which record fields hold what. Only the fields the template needs must exist."""

    instruction: str = _f("instruction", "Field with the instruction (alpaca template).")
    input: str = _f("input", "Field with the optional input (alpaca); empty or absent means none.")
    output: str = _f("output", "Field with the response (alpaca and custom templates).")
    messages: str = _f("messages", "Field with a list of chat messages (chatml template).")
    role: str = _f("role", "Key of a chat message's role (user / assistant / system).")
    content: str = _f("content", "Key of a chat message's text.")
    text: str = _f("text", "Field with plain text (raw template).")
    input_ids: str = _f(
        "input_ids", "Field with pre-tokenised ids (any format): a record that has it is used as is, its ids from data.tokenizer."
    )
    labels: str = _f("labels", "Optional field with per-token labels of pre-tokenised records (-100 = no loss).")


@dataclass
class CleanConfig:
    """Text cleaning; each step is opt-in and reports how many records it changed or dropped."""

    strip_html: bool = _f(False, "Remove HTML tags and decode HTML entities.")
    nfkc: bool = _f(False, "Unicode NFKC normalisation.")
    control_chars: bool = _f(False, "Remove control characters (keeps newline and tab).")
    collapse_whitespace: bool = _f(False, "Collapse runs of spaces/tabs; at most one blank line.")
    dedupe: bool = _f(False, "Drop records whose rendered text exactly repeats an earlier one.")
    min_chars: int = _f(0, "Drop records whose rendered text is shorter than this (0 = off).", minimum=0)
    max_chars: int = _f(0, "Drop records whose rendered text is longer than this (0 = off).", minimum=0)


@dataclass
class DefaultDataConfig:
    """The embedded default dataset, generated from a seed with no files."""

    num_records: int = _f(6000, "Records to generate (train + eval).", minimum=10)
    seed: int = _f(1234, "Seed of the generator (independent of the run seed).")


Format = Literal["auto", "json", "jsonl", "csv", "parquet", "text", "hf_disk"]
Template = Literal["alpaca", "chatml", "chat_template", "raw", "custom"]


@dataclass
class SourceConfig:
    """One source of a mixture (``data.sources``); a field left unset follows the same ``data.*`` key."""

    path: str = _f("", "Input file or directory of this source (required).")
    name: str | None = _f(None, "Name in reports and metrics; none = the file (or directory) name without its suffix.")
    weight: float | None = _f(
        None,
        "Relative share of an epoch's tokens (up- or down-sampled from the seed); none on every source = natural "
        "shares (each document once per epoch). See docs/data.md.",
        minimum=0.0,
    )
    format: Format | None = _f(None, "Input format; none = data.format.")
    template: Template | None = _f(None, "Prompt template; none = data.template.")
    fields: FieldsConfig | None = _f(None, "Field mapping; none = data.fields.")
    prompt_format: str | None = _f(None, "custom template's prompt; none = data.prompt_format.")
    loss_on: Literal["all", "response"] | None = _f(None, "Tokens carrying loss; none = data.loss_on.")
    eval_path: str | None = _f(None, "This source's evaluation file; none = hold out data.eval_fraction of its records.")

    @property
    def label(self) -> str:
        """The source's name: ``name``, else the file name without its suffix."""
        return self.name or Path(self.path).stem or Path(self.path).name


@dataclass
class DataConfig:
    path: str | None = _f(None, "Input file or directory; none = the embedded default dataset (or data.sources).")
    sources: list[SourceConfig] = _f(
        list,
        "A mixture instead of data.path: a list of sources, each {path, name, weight, format, template, fields, "
        "prompt_format, loss_on, eval_path} (unset keys follow data.*); one tokenizer for all. See docs/data.md.",
    )
    format: Format = _f(
        "auto",
        "Input format; auto = from the file name (a directory = Hugging Face save_to_disk).",
    )
    eval_path: str | None = _f(None, "Separate evaluation file; none = hold out eval_fraction of records.")
    eval_fraction: float = _f(0.05, "Share of records held out for evaluation when eval_path is unset.", minimum=0.0)
    fields: FieldsConfig = _f(FieldsConfig, "Field mapping.")
    template: Template = _f(
        "alpaca",
        "Prompt template: alpaca, chatml (chat messages), chat_template (messages rendered with the tokenizer's own "
        "Jinja chat template), raw (plain text) or custom (prompt_format).",
    )
    prompt_format: str | None = _f(None, "custom template: prompt with {named} record fields; the response is fields.output.")
    loss_on: Literal["all", "response"] = _f("response", "Tokens carrying loss: all, or only the response / assistant turns.")
    text_split: Literal["blank_lines", "chunks"] = _f(
        "blank_lines",
        "format text: split the file into documents on blank lines or fixed-size chunks.",
    )
    chunk_tokens: int = _f(1024, "format text with text_split=chunks: tokens per chunk.", minimum=1)
    clean: CleanConfig = _f(CleanConfig, "Text cleaning.")
    tokenizer: str = _f(
        "auto",
        "auto (model.kind hf: the model directory's tokenizer when it has one; else default), default "
        "(self-contained byte-level), bpe:N (learned from the training text), a tokenizer.json file, a local "
        "Hugging Face model directory, or a directory with GPT-2 vocab.json + merges.txt.",
    )
    add_tokens: list[str] = _f(
        list, "Strings that become single new ids of the tokenizer (the model's embeddings grow to match)."
    )
    add_special_tokens: list[str] = _f(
        list,
        "As add_tokens, as special tokens (template chatml adds its <|im_start|> and <|im_end|> itself).",
    )
    pad_id: int | None = _f(None, "Padding id; none = the end-of-text id.")
    max_seq_len: int = _f(1024, "Longest document in tokens (end-of-text included).", minimum=2)
    overlong: Literal["truncate", "drop"] = _f(
        "truncate", "Documents over max_seq_len: truncate (keeping a final target) or drop."
    )
    on_bad_record: Literal["error", "skip"] = _f(
        "error", "A malformed record stops the run (error) or is counted and skipped (skip)."
    )
    cache_dir: str = _f(".densebatch-cache", "Where tokenised documents are cached (keyed by content hash).")
    default: DefaultDataConfig = _f(DefaultDataConfig, "The embedded default dataset.")


# ----------------------------------------------------------------------------------- batching
@dataclass
class BatchingConfig:
    strategy: Literal["random", "length_grouped", "token_budget", "packed"] = _f(
        "packed",
        "random: fixed rows per batch; length_grouped: HF-style mega-batches sorted by length; "
        "token_budget: rows x longest <= max_tokens_per_batch; packed: documents packed into rows of seq_len.",
    )
    mode: Literal["causal", "mlm"] = _f("causal", "causal language modelling, or mlm (masked-LM labels).")
    rows_per_batch: int = _f(8, "Rows per batch for random and length_grouped.", minimum=1)
    max_tokens_per_batch: int | Literal["auto"] = _f(
        8192,
        "Token slots (rows x T) per batch for token_budget and packed; auto = the largest budget whose worst batch "
        "fits the memory (train.memory_limit_gb, or the GPU's free memory), found before training (densebatch find-batch).",
        minimum=1,
    )
    seq_len: int = _f(1024, "Row length of packed rows.", minimum=2)
    long_docs: Literal["split", "truncate"] = _f("split", "packed: documents longer than seq_len are split or truncated.")
    pad_to_multiple_of: int = _f(1, "Pad the row length up to a multiple of this (8, 64, ...).", minimum=1)
    mega_batch_mult: int = _f(50, "length_grouped: batches per sorted mega-batch (as Hugging Face).", minimum=1)
    drop_last: bool = _f(False, "random / length_grouped: drop the last incomplete batch.")
    mlm_probability: float = _f(0.15, "mlm: share of non-special tokens selected, in (0, 1): 0 and 1 are refused.", minimum=0.0)
    prefetch: int = _f(2, "Steps collated ahead in a background thread (0 = none).", minimum=0)
    shard_docs: int = _f(
        1 << 20,
        "Plan an epoch in shards of this many documents (a seeded random sample each), interleaved: planning "
        "memory stays bounded for corpora of any size; one shard (the whole corpus) below it.",
        minimum=1,
    )


# -------------------------------------------------------------------------------------- model
@dataclass
class LoraConfig:
    """LoRA adapters for model.kind hf (through peft: pip install 'densebatch[lora]'); only they train."""

    r: int = _f(0, "Rank of the adapters; 0 = off (every weight trains).", minimum=0)
    alpha: float = _f(16.0, "Scale of the adapters' update: alpha / r x B A.", minimum=0.0)
    dropout: float = _f(0.0, "Dropout on the adapters' input, in [0, 1).", minimum=0.0)
    target_modules: list[str] = _f(
        list,
        "Modules to adapt, by name (e.g. q_proj,v_proj), or all-linear; empty = the architecture's attention "
        "projections (peft's default). See docs/hf-models.md.",
    )


@dataclass
class ModelConfig:
    kind: Literal["gpt", "hf"] = _f("gpt", "gpt: the reference decoder; hf: a Hugging Face causal LM.")
    path: str | None = _f(None, "hf: a local directory with config.json (weights optional: random init when absent).")
    n_layer: int = _f(4, "gpt: transformer blocks.", minimum=1)
    n_head: int = _f(4, "gpt: attention heads.", minimum=1)
    n_embd: int = _f(128, "gpt: width.", minimum=1)
    block_size: int = _f(1024, "gpt: context length (largest position + 1).", minimum=2)
    dropout: float = _f(0.0, "gpt: dropout probability.", minimum=0.0)
    vocab_size: int | None = _f(None, "gpt: vocabulary size; none = the tokenizer's.")
    attention: Literal["auto", "flex", "varlen", "segmented", "masked"] = _f(
        "auto",
        "Document-isolating attention: auto (fastest that isolates here), flex, varlen, segmented (length-bucketed "
        "causal SDPA per document, any device), masked (SDPA with a block mask).",
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    attn_implementation: Literal["sdpa", "eager"] = _f(
        "sdpa",
        "hf: transformers' attention; eager for architectures SDPA cannot compute (Gemma 2's soft-capping). Both "
        "isolate packed documents (flash, flex and paged are refused). See docs/hf-models.md.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32",
        "hf: dtype the weights are loaded and trained in (the optimizer's master weights too): bfloat16 halves "
        "their memory, but updates below its precision are lost (best with LoRA); float16 only with LoRA.",
    )
    lora: LoraConfig = _f(LoraConfig, "hf: LoRA adapters (off while r is 0).")


# -------------------------------------------------------------------------------------- train
@dataclass
class GroupScheduleConfig:
    """One layer group's own learning-rate schedule; every field left at its default follows train.*."""

    schedule: Literal["same", "cosine", "linear", "constant"] = _f(
        "same", "This group's schedule after its warm-up; same = train.schedule."
    )
    warmup_steps: int | None = _f(None, "This group's linear warm-up steps; none = train.warmup_steps.", minimum=0)
    min_lr_ratio: float | None = _f(
        None, "This group's final learning rate as a share of its peak; none = train.min_lr_ratio.", minimum=0.0
    )


@dataclass
class HealthConfig:
    """Thresholds of the run's health warnings (train/health.py, docs/observability.md); each cause warns once."""

    enabled: bool = _f(
        True, "Warn (console, metrics.jsonl, summary) when the data wait, memory, throughput, fill rate or clipping look wrong."
    )
    warmup_steps: int = _f(20, "Steps not judged at the start (memory excepted).", minimum=0)
    data_wait_share: float = _f(
        0.2, "Warn when steps wait on data for more than this share of their time (last 50 steps).", minimum=0.0
    )
    memory_margin: float = _f(
        0.05,
        "Warn when a step's peak memory comes within this share of train.memory_limit_gb (none: the CUDA device's memory, "
        "or on CPU the machine's or container's).",
        minimum=0.0,
    )
    slow_ratio: float = _f(
        0.5, "Warn when the median tokens/s of the last 20 steps falls below this share of the run's median.", minimum=0.0
    )
    fill_ratio: float = _f(
        0.7, "Warn when the median fill rate of the last 20 steps falls below this share of the run's median.", minimum=0.0
    )
    clip_share: float = _f(
        0.5, "Warn when the gradient norm is clipped on more than this share of the last 50 steps.", minimum=0.0
    )
    clip_warmup_steps: int = _f(200, "Steps before the clipping check starts (early gradients are large by nature).", minimum=0)


@dataclass
class TrainConfig:
    max_steps: int | None = _f(None, "Stop after this many optimizer steps.", minimum=1)
    max_epochs: float | None = _f(None, "Stop after this many epochs (fractions allowed).", minimum=0.0)
    max_tokens: int | None = _f(None, "Stop after this many real tokens.", minimum=1)
    lr: float | Literal["auto"] = _f(
        3e-4,
        "Peak learning rate; auto = the learning-rate range test's suggestion (densebatch find-lr), run before training.",
        minimum=0.0,
    )
    min_lr_ratio: float = _f(0.1, "Final learning rate as a share of lr (cosine / linear).", minimum=0.0)
    schedule: Literal["cosine", "linear", "constant"] = _f("cosine", "Learning-rate schedule after warm-up.")
    warmup_steps: int = _f(0, "Linear warm-up steps.", minimum=0)
    weight_decay: float = _f(0.1, "AdamW weight decay (not on norms, biases or embeddings unless decay_all).", minimum=0.0)
    decay_all: bool = _f(False, "Apply weight decay to every parameter.")
    beta1: float = _f(0.9, "AdamW beta1.", minimum=0.0)
    beta2: float = _f(0.95, "AdamW beta2.", minimum=0.0)
    eps: float = _f(1e-8, "AdamW epsilon.", minimum=0.0)
    lr_mult_embeddings: float = _f(1.0, "Learning-rate multiplier of the embedding layers.", minimum=0.0)
    lr_mult_blocks: float = _f(1.0, "Learning-rate multiplier of the transformer blocks.", minimum=0.0)
    lr_mult_head: float = _f(1.0, "Learning-rate multiplier of the final norm and output head.", minimum=0.0)
    layer_lr_decay: float = _f(
        1.0,
        "Layer-wise decay, in (0, 1]: the block at depth d from the top learns at lr x lr_mult_blocks x this^d (1 = off).",
        minimum=0.0,
    )
    embeddings: GroupScheduleConfig = _f(GroupScheduleConfig, "Learning-rate schedule of the embeddings group.")
    blocks: GroupScheduleConfig = _f(GroupScheduleConfig, "Learning-rate schedule of the transformer blocks.")
    head: GroupScheduleConfig = _f(GroupScheduleConfig, "Learning-rate schedule of the final norm and output head.")
    ramp_steps: int = _f(
        0,
        "Batch-size ramp: tokens per step grow linearly from ramp_start x the target to the target over this many "
        "steps (0 = off); with ramp_unit tokens, over as many tokens as this many full steps hold.",
        minimum=0,
    )
    ramp_start: float = _f(0.25, "Batch-size ramp: the first step's size as a fraction of the target, in (0, 1].", minimum=0.0)
    ramp_unit: Literal["steps", "tokens"] = _f("steps", "Batch-size ramp: linear in steps, or in the tokens consumed.")
    batch_backoff_patience: int = _f(
        0,
        "Batch-size back-off: evaluations without a new best eval loss before tokens per step are multiplied by "
        "batch_backoff_factor (0 = off; needs eval.every_steps).",
        minimum=0,
    )
    batch_backoff_factor: float = _f(0.5, "Batch-size back-off: the factor per plateau (above 1: grow instead).", minimum=0.0)
    batch_backoff_floor: float = _f(
        0.125, "Batch-size back-off: the smallest step it reaches, as a fraction of the target, in (0, 1].", minimum=0.0
    )
    batch_backoff_cap: float = _f(
        4.0, "Batch-size growth (factor above 1): the largest step, as a fraction of the target.", minimum=1.0
    )
    batch_backoff_max: int = _f(3, "Batch-size back-off: the most changes in a run.", minimum=1)
    lr_batch_scaling: Literal["none", "sqrt", "linear"] = _f(
        "none",
        "Learning rate under a batch-size ramp or back-off: none (unchanged), sqrt (x fraction^0.5) or linear (x fraction).",
    )
    grad_accum_batches: int = _f(1, "Batches per optimizer step (ignored when loss_tokens_per_step is set).", minimum=1)
    loss_tokens_per_step: int | None = _f(None, "Accumulate batches until this many loss tokens per step.", minimum=1)
    label_smoothing: float = _f(
        0.0,
        "Label smoothing of the training loss, in [0, 1): the target distribution is (1 - e) onehot + e / vocab "
        "(as torch's cross_entropy); per token, so exact under any batching. Evaluation reports plain cross-entropy.",
        minimum=0.0,
    )
    grad_clip: float = _f(1.0, "Clip the gradient norm to this (0 = off); adaptive: the ceiling.", minimum=0.0)
    grad_clip_mode: Literal["fixed", "adaptive"] = _f(
        "fixed", "fixed threshold, or adaptive (z-score of running grad-norm statistics)."
    )
    precision: Literal["fp32", "bf16", "fp16"] = _f("fp32", "fp32, bf16 (autocast) or fp16 (autocast + loss scaling).")
    compile: bool = _f(False, "torch.compile the model.")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto (cuda when present), cpu or cuda.")
    log_every: int = _f(1, "Write metrics every this many steps.", minimum=1)
    progress: bool = _f(True, "Show a progress bar.")
    spike_zscore: float = _f(6.0, "Loss spike: robust z-score over the window above this rolls back (0 = off).", minimum=0.0)
    spike_window: int = _f(50, "Steps in the moving window of the spike detector.", minimum=5)
    max_bad_steps: int = _f(3, "Consecutive non-finite steps that trigger a rollback.", minimum=1)
    rollback_lr_factor: float = _f(0.5, "Multiply the learning rate by this after a rollback.", minimum=0.0)
    distributed: Literal["auto", "ddp", "fsdp"] = _f(
        "auto",
        "Under torchrun: ddp (replicated model, gradients all-reduced) or fsdp (FSDP2 fully_shard: parameters, "
        "gradients and optimizer state sharded over ranks); auto = ddp when launched by torchrun.",
    )
    report_to: list[Literal["tensorboard", "csv"]] = _f(
        list, "Metric sinks besides metrics.jsonl: tensorboard (event files under output_dir/tensorboard), csv."
    )
    plots: bool = _f(True, "At the end of the run, draw its plots into output_dir/plots (when matplotlib is installed).")
    health: HealthConfig = _f(HealthConfig, "Health warnings: their thresholds.")
    memory_limit_gb: float | None = _f(
        None,
        "Memory a budget of max_tokens_per_batch: auto may use, in GB: on CPU the whole process's peak resident "
        "memory (none = resident now + MemAvailable), on CUDA a cap on the device memory (none = its free memory).",
        minimum=0.0,
    )
    memory_margin: float = _f(
        0.1,
        "Share of the memory limit the budget finder keeps free (fragmentation, evaluation, checkpoint copies), in [0, 0.9].",
        minimum=0.0,
    )


@dataclass
class EvalConfig:
    every_steps: int = _f(0, "Evaluate every this many steps (0 = only at the end).", minimum=0)
    max_batches: int | None = _f(None, "Cap on evaluation batches (none = the whole split).", minimum=1)
    patience: int = _f(0, "Early stopping: evaluations without improvement before stopping (0 = off).", minimum=0)
    accuracy_samples: int = _f(200, "Embedded default: held-out prompts answered greedily for exact-match accuracy.", minimum=0)
    max_new_tokens: int = _f(64, "Longest generated answer in the accuracy check.", minimum=1)


@dataclass
class CheckpointConfig:
    every_steps: int = _f(0, "Save every this many steps (0 = only at the end and on SIGTERM/SIGINT).", minimum=0)
    keep_last: int = _f(3, "Keep the newest this many checkpoints.", minimum=1)
    mirror_dir: str | None = _f(None, "Second location that receives a verified copy of every checkpoint.")
    resume: Literal["never", "auto"] = _f("never", "auto: continue from the newest verified checkpoint; never: start fresh.")


@dataclass
class FinderConfig:
    """The learning-rate range test (densebatch find-lr, train.lr: auto) and the budget finder (find-batch)."""

    lr_start: float = _f(1e-6, "Range test: the first learning rate.", minimum=0.0)
    lr_end: float = _f(1.0, "Range test: the last learning rate (reached only if the loss never diverges).", minimum=0.0)
    lr_steps: int = _f(100, "Range test: optimizer steps from lr_start to lr_end (rates grow exponentially).", minimum=2)
    smoothing: float = _f(0.8, "Range test: weight of the loss's exponential moving average, in [0, 1).", minimum=0.0)
    diverge: float = _f(
        4.0, "Range test: stop when the smoothed loss exceeds this times its minimum (or, after falling, its start).", minimum=1.0
    )
    max_probes: int = _f(10, "Budget finder: most probe steps (each a forward, backward and optimizer step).", minimum=2)
    throughput_share: float = _f(
        0.9, "Budget finder: report the smallest budget reaching this share of the best measured throughput.", minimum=0.0
    )


@dataclass
class RunConfig:
    output_dir: str = _f("runs/default", "Where metrics, checkpoints and the final model go.")
    seed: int = _f(0, "Seed of everything random in the run.")
    data: DataConfig = _f(DataConfig, "Data preparation.")
    batching: BatchingConfig = _f(BatchingConfig, "Batch planning and collation.")
    model: ModelConfig = _f(ModelConfig, "Model.")
    train: TrainConfig = _f(TrainConfig, "Optimisation.")
    eval: EvalConfig = _f(EvalConfig, "Evaluation.")
    checkpoint: CheckpointConfig = _f(CheckpointConfig, "Checkpoints and resume.")
    finder: FinderConfig = _f(FinderConfig, "Learning-rate range test and token-budget finder.")


# ------------------------------------------------------------------------------- loading logic
def choices_of(tp: Any) -> tuple | None:
    """The allowed values of a ``Literal[...]`` field (or ``Literal[...] | None``); None otherwise."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            if typing.get_origin(a) is Literal:
                return typing.get_args(a)
    return None


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, args))
    if typing.get_origin(tp) is list:
        return f"a list (each {_type_name(args[0])})"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    if dataclasses.is_dataclass(tp):  # a section inside a list or an optional one: data.sources[1].fields
        return _build(tp, value, key)
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}: expected one of {', '.join(map(str, typing.get_args(tp)))}; got {value!r}")
    if origin is list:
        if isinstance(value, str):  # from the command line: --train.report_to=tensorboard,csv (or [a, b])
            value = [v.strip() for v in value.strip().strip("[]").split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if dataclasses.is_dataclass(a) and isinstance(value, dict):
                return _build(a, value, key)  # its own errors name the key inside it
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"in section '{prefix}'" if prefix else "at the top level"
        raise ConfigError(
            f"unknown key '{prefix + '.' if prefix else ''}{unknown[0]}' {where}; expected one of: {', '.join(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in data:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], key)
            continue
        value = _coerce(key, data[name], tp)
        minimum = f.metadata.get("minimum")
        if minimum is not None and isinstance(value, (int, float)) and value < minimum:  # not "auto"
            raise ConfigError(f"{key}: expected a value >= {minimum}; got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def prompt_fields(prompt_format: str) -> list[str]:
    """The record fields a custom prompt format names; ConfigError for positional or malformed ones."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(prompt_format) if name is not None]
    except ValueError as e:
        raise ConfigError(f"data.prompt_format: {e} (write literal braces as {{{{ and }}}})") from None
    if any(not n or not n.isidentifier() for n in names):
        raise ConfigError(f"data.prompt_format: every placeholder must name a record field, like {{question}}; got {names}")
    return names


def _check(cfg: RunConfig) -> None:
    """Cross-field rules that one field alone cannot express."""
    d, b, m = cfg.data, cfg.batching, cfg.model
    if d.template == "custom" and not d.sources:
        if not d.prompt_format:
            raise ConfigError("data.prompt_format: required when data.template is custom, e.g. 'Question: {question}\\nAnswer: '")
        prompt_fields(d.prompt_format)
    _check_sources(d)
    if m.kind == "hf" and m.attention not in ("auto", "masked"):
        raise ConfigError(
            f"model.attention: {m.attention!r} is not available for Hugging Face models; use auto or masked "
            "(SDPA with a 4-D document mask, the backend tests show isolates packed documents)"
        )
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction: expected a number in [0, 1); got {d.eval_fraction}")
    if not 0.0 < b.mlm_probability < 1.0:
        raise ConfigError(f"batching.mlm_probability: expected a number in (0, 1); got {b.mlm_probability}")
    if m.kind == "hf" and not m.path:
        raise ConfigError("model.path: required when model.kind is hf (a local directory with config.json)")
    if m.kind == "gpt" and m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd: expected a multiple of model.n_head ({m.n_head}); got {m.n_embd}")
    _check_hf_model(m)
    if b.strategy == "packed" and b.max_tokens_per_batch != "auto" and b.seq_len > b.max_tokens_per_batch:
        raise ConfigError(
            f"batching.max_tokens_per_batch: expected at least batching.seq_len ({b.seq_len}) so one packed row fits; got {b.max_tokens_per_batch}"
        )
    if not 0.0 <= cfg.train.label_smoothing < 1.0:
        raise ConfigError(f"train.label_smoothing: expected a number in [0, 1); got {cfg.train.label_smoothing}")
    if not 0.0 < cfg.train.rollback_lr_factor <= 1.0:
        raise ConfigError(f"train.rollback_lr_factor: expected a number in (0, 1]; got {cfg.train.rollback_lr_factor}")
    _check_schedules(cfg)
    _check_finders(cfg)


def _check_hf_model(m: ModelConfig) -> None:
    """Keys that only Hugging Face models read, and what LoRA and the weights' dtype allow."""
    if m.kind == "gpt":
        for key, value, default in (("attn_implementation", m.attn_implementation, "sdpa"), ("dtype", m.dtype, "float32")):
            if value != default:
                raise ConfigError(
                    f"model.{key}: applies to model.kind hf; the reference GPT takes {default} (see model.attention)"
                )
        if m.lora.r:
            raise ConfigError("model.lora.r: LoRA adapts Hugging Face models (model.kind hf); set it to 0 for the reference GPT")
    if not 0.0 <= m.lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout: expected a probability in [0, 1); got {m.lora.dropout}")
    if m.lora.r and m.lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha: expected a positive scale; got {m.lora.alpha}")
    if m.dtype == "float16" and not m.lora.r:
        raise ConfigError(
            "model.dtype: float16 weights cannot be trained themselves (loss scaling refuses float16 gradients); "
            "use bfloat16, or LoRA (model.lora.r > 0: the adapters train in float32)"
        )


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
            prompt_fields(fmt)
    weighted = [s.weight is not None for s in d.sources]
    if any(weighted) and not all(weighted):
        i = weighted.index(False)
        raise ConfigError(f"data.sources[{i}].weight: set a weight on every source, or on none (natural shares)")
    if all(weighted) and not any(s.weight > 0 for s in d.sources):
        raise ConfigError("data.sources[0].weight: at least one source needs a weight > 0")


def _check_finders(cfg: RunConfig) -> None:
    """``auto`` values and the finders' ranges."""
    b, t, f = cfg.batching, cfg.train, cfg.finder
    if b.max_tokens_per_batch == "auto" and b.strategy not in ("token_budget", "packed"):
        raise ConfigError(
            f"batching.max_tokens_per_batch: auto sizes token_budget and packed batches; {b.strategy} batches hold "
            "batching.rows_per_batch rows: set a number, or use batching.strategy token_budget or packed"
        )
    if not 0.0 <= t.memory_margin <= 0.9:
        raise ConfigError(f"train.memory_margin: expected a share in [0, 0.9]; got {t.memory_margin}")
    if not 0.0 < f.lr_start < f.lr_end:
        raise ConfigError(f"finder.lr_start: expected 0 < lr_start < finder.lr_end ({f.lr_end}); got {f.lr_start}")
    if not 0.0 <= f.smoothing < 1.0:
        raise ConfigError(f"finder.smoothing: expected a weight in [0, 1); got {f.smoothing}")
    if not 0.0 < f.throughput_share <= 1.0:
        raise ConfigError(f"finder.throughput_share: expected a share in (0, 1]; got {f.throughput_share}")


def _check_schedules(cfg: RunConfig) -> None:
    """Batch-size schedule and layer-wise rates: ranges that depend on whether the feature is on."""
    t = cfg.train
    if not 0.0 < t.layer_lr_decay <= 1.0:
        raise ConfigError(f"train.layer_lr_decay: expected a number in (0, 1]; got {t.layer_lr_decay}")
    if t.ramp_steps and not 0.0 < t.ramp_start <= 1.0:
        raise ConfigError(f"train.ramp_start: expected a fraction of the target step in (0, 1]; got {t.ramp_start}")
    if t.batch_backoff_patience:
        if t.batch_backoff_factor <= 0.0 or t.batch_backoff_factor == 1.0:
            raise ConfigError(
                f"train.batch_backoff_factor: expected a positive number other than 1; got {t.batch_backoff_factor}"
            )
        if not 0.0 < t.batch_backoff_floor <= 1.0:
            raise ConfigError(f"train.batch_backoff_floor: expected a number in (0, 1]; got {t.batch_backoff_floor}")
        if not cfg.eval.every_steps:
            raise ConfigError("train.batch_backoff_patience: a back-off watches evaluations; set eval.every_steps too")


def parse_override(arg: str) -> tuple[list[str], Any]:
    """``--train.lr=3e-4`` → (["train", "lr"], 0.0003). Values are read as YAML scalars."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body:
        raise ConfigError(f"override '{arg}': expected --section.key=value")
    key, raw = body.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, (dict, list)):
        value = raw  # a bare string like "[x]" is not a structure here
    return key.split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read ``path`` (YAML; None = defaults), apply overrides, validate. Raises ``ConfigError``."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' not found")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    for arg in overrides:
        keys, value = parse_override(arg)
        node = data
        for i, k in enumerate(keys):
            if isinstance(node, list):  # --data.sources.1.weight=3: an item of a list of sections
                if not k.isdigit() or int(k) >= len(node):
                    raise ConfigError(f"override '{arg}': '{k}' is not an index of '{keys[i - 1]}' (0 .. {len(node) - 1})")
                k = int(k)
            elif not isinstance(node, dict):
                raise ConfigError(f"override '{arg}': '{keys[i - 1]}' is not a section")
            if i == len(keys) - 1:
                node[k] = value
                break
            nxt = node[k] if isinstance(node, list) else node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            node = nxt
    return config_from_dict(data)


def config_from_dict(data: dict) -> RunConfig:
    """Validate a plain dict (a parsed YAML file, or a config stored in a checkpoint)."""
    cfg = _build(RunConfig, data, "")
    _check(cfg)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved configuration as YAML (re-loadable with ``load_config``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def config_fingerprint(section: Any) -> str:
    """Stable JSON of a config section, for cache keys."""
    return json.dumps(dataclasses.asdict(section), sort_keys=True)


def describe(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every field, for ``densebatch config --help-keys`` and the docs."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key))
            continue
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(item):  # a list of sections: the list, then each item's keys
            rows.append((key, "[]", f.metadata.get("help", "")))
            rows.extend(describe(item, f"{key}[i]"))
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # a list: show its empty default, not null
            default = f.default_factory()
        help_ = f.metadata.get("help", "")
        if (choices := choices_of(tp)) is not None:
            help_ += f" [{' | '.join(map(str, choices))}]"
        rows.append((key, json.dumps(default), help_))
    return rows
