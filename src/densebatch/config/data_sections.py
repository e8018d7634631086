"""Configuration sections of what a run reads and how it batches it: data (and its sources), batching."""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from densebatch.config.field import _f


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
        "input_ids",
        "Field with pre-tokenised ids (any format): a record that has it is used as is, its ids from data.tokenizer "
        "(format mds: the column of token ids; at this default, input_ids or else tokens).",
    )
    labels: str = _f("labels", "Optional field with per-token labels of pre-tokenised records (-100 = no loss).")
    prompt: str = _f(
        "prompt",
        "data.pairs: field with the prompt (a string, or chat messages); absent = the instruction and input fields "
        "(alpaca), else the common start of chosen and rejected (TRL's implicit prompt).",
    )
    chosen: str = _f("chosen", "data.pairs: field with the preferred answer (a string, or chat messages).")
    rejected: str = _f("rejected", "data.pairs: field with the answer that is not preferred (a string, or chat messages).")


@dataclass
class CleanConfig:
    """Text cleaning; each step is opt-in and reports how many records it changed or dropped."""

    fix_encoding: bool = _f(
        False,
        "Repair mojibake (e.g. â€™ for ’), double-encoded UTF-8 and stray surrogates with ftfy (extra densebatch[ftfy]); "
        "quotes, widths and line breaks are left as they are.",
    )
    strip_html: bool = _f(False, "Remove HTML tags and decode HTML entities.")
    nfkc: bool = _f(False, "Unicode NFKC normalisation.")
    control_chars: bool = _f(False, "Remove control characters (keeps newline and tab).")
    collapse_whitespace: bool = _f(False, "Collapse runs of spaces/tabs; at most one blank line.")
    terms: str | None = _f(
        None,
        "A dictionary of terms to standardise: a JSON object {from: to}, or one 'from -> to' (or 'from → to', or "
        "from<TAB>to) per line; whole words or phrases, matched case-sensitively, longest first; applied last.",
    )
    dedupe: bool | Literal["off", "exact", "near"] = _f(
        False,
        "Drop duplicate records, the first copy kept: off (false); exact (true): the rendered text repeats an earlier "
        "record's; near: also near copies of an earlier kept record's content (MinHash over 5-word shingles of the "
        "lowercased words; extra densebatch[dedupe]). In a mixture, also copies of an earlier source's records.",
    )
    near_threshold: float = _f(
        0.8, "dedupe near: the estimated Jaccard similarity of two records' word shingles at which they are copies (0.5-1)."
    )
    min_chars: int = _f(0, "Drop records whose rendered text is shorter than this (0 = off).", minimum=0)
    max_chars: int = _f(0, "Drop records whose rendered text is longer than this (0 = off).", minimum=0)


@dataclass
class DefaultDataConfig:
    """The embedded default dataset, generated from a seed with no files."""

    num_records: int = _f(6000, "Records to generate (train + eval).", minimum=10)
    seed: int = _f(1234, "Seed of the generator (independent of the run seed), in [0, 2**63).", minimum=0)


Format = Literal["auto", "json", "jsonl", "csv", "parquet", "text", "hf_disk", "megatron", "datatrove", "litdata", "mds"]
Template = Literal["alpaca", "chatml", "chat_template", "raw", "custom"]


@dataclass
class SourceConfig:
    """One source of a mixture (``data.sources``); a field left unset follows the same ``data.*`` key."""

    path: str = _f("", "Input file or directory of this source, or a glob pattern of files (corpus/*.jsonl) (required).")
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
        """The source's name: ``name``, else the file name without its suffix (a pattern's: the folder's
        that holds what it matches, ``corpus`` for ``corpus/*.jsonl``)."""
        if self.name:
            return self.name
        path = Path(self.path)
        while glob.has_magic(str(path)) and not path.exists() and path.parent != path:  # an existing file is itself
            path = path.parent
        return (path.name if path != Path(self.path) else path.stem) or path.name or str(self.path)


@dataclass
class DataConfig:
    path: str | None = _f(
        None,
        "Input file or directory, or a glob pattern of files (corpus/*.jsonl), each prepared on its own; none = the embedded default dataset (or data.sources).",
    )
    sources: list[SourceConfig] = _f(
        list,
        "A mixture instead of data.path: a list of sources, each {path, name, weight, format, template, fields, "
        "prompt_format, loss_on, eval_path} (unset keys follow data.*); one tokenizer for all. See docs/data.md.",
    )
    format: Format = _f(
        "auto",
        "Input format; auto = from the file name (a directory = Hugging Face save_to_disk); megatron / datatrove / litdata / mds = "
        "token ids an engine wrote (PREFIX.bin + PREFIX.idx; NAME.ds + .ds.index; index.json + chunks; index.json + "
        "MDS shards), read in place (docs/data.md).",
    )
    bytes_dtype: Literal["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"] | None = _f(
        None,
        "format mds: the dtype of the ids in a token column encoded as bytes (llm-foundry's tokens: int64); none = "
        "such a column is refused (ndarray columns record their own).",
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
    pairs: bool | Literal["auto"] = _f(
        "auto",
        "Records are preference pairs (fields.prompt, fields.chosen, fields.rejected), each prepared as one unit: "
        "the prompt once, then each answer (docs/preference.md); auto = when train.objective is dpo, simpo or orpo.",
    )
    loss_on: Literal["all", "response"] = _f(
        "response",
        "Tokens carrying loss: all, or only the response / assistant turns (batching.mode mlm: all, every token may be masked).",
    )
    text_split: Literal["blank_lines", "chunks"] = _f(
        "blank_lines",
        "format text: split the file into documents on blank lines, or cut its running text (read in blocks of "
        "~64 KiB of whole lines, streamed) into chunk_tokens-token documents.",
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
    num_proc: int = _f(
        0,
        "Worker processes that tokenise the records, chunk by chunk (0 = the cores available); the prepared documents "
        "are the same for any number.",
        minimum=0,
    )
    chunk_records: int = _f(
        4096,
        "Records a preparation worker takes at once: its memory, and what a rerun after a crash does not redo.",
        minimum=1,
    )
    shard_tokens: int = _f(
        1 << 27,
        "Tokens of a prepared store's shard (whole documents; a longer one alone): bounds each file of the store; "
        "any value gives the same documents.",
        minimum=1,
    )
    on_bad_record: Literal["error", "skip"] = _f(
        "error", "A malformed record stops the run (error) or is counted and skipped (skip)."
    )
    cache_dir: str = _f(".densebatch-cache", "Where tokenised documents are cached (keyed by the inputs and the settings).")
    verify_inputs: Literal["identity", "hash"] = _f(
        "identity",
        "How the cache knows its inputs: identity (each input file's path, size and modification time: a cache hit "
        "reads no input) or hash (SHA-256 of every input byte, read on every run: for inputs rewritten in place "
        "with their size and modification time kept).",
    )
    default: DefaultDataConfig = _f(DefaultDataConfig, "The embedded default dataset.")


# ----------------------------------------------------------------------------------- batching
@dataclass
class BatchingConfig:
    strategy: Literal["random", "length_grouped", "token_budget", "packed"] = _f(
        "packed",
        "random: fixed rows per batch; length_grouped: HF-style mega-batches sorted by length (rows of bundled "
        "short documents unless bundle_tokens is 0); "
        "token_budget: rows x longest <= max_tokens_per_batch; packed: documents packed into rows of seq_len.",
    )
    mode: Literal["causal", "mlm"] = _f("causal", "causal language modelling, or mlm (masked-LM labels).")
    rows_per_batch: int = _f(
        8,
        "Rows per batch for random and length_grouped (a length_grouped row may be a bundle of short documents); for "
        "packed and token_budget, the random batches whose source weighting train.source_balance follows.",
        minimum=1,
    )
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
    bundle_tokens: int | Literal["auto"] = _f(
        "auto",
        "packed, token_budget and length_grouped: documents of at most this many tokens are bundled at random (each "
        "attending to itself), so rows and batches mix lengths, tasks and sources like random samples; auto = seq_len / 4 "
        "(packed), max_tokens_per_batch / 5 (token_budget), the 90th percentile of lengths but at most half the longest "
        "(length_grouped); 0 = off: rows of one length (one task), which train worse; length_grouped with 0 is Hugging "
        "Face's group_by_length.",
        minimum=0,
    )
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
