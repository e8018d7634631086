"""Prompt templates: turn one record into text segments, each marked as carrying loss or not.

``render(record, cfg, transform)`` returns ``[(text, carries_loss), ...]``; ``prepare`` tokenizes each
segment on its own and concatenates, so the prompt/response boundary is exact *by position* (no
search for a token value). Templates (``data.template``):

- ``alpaca`` (byte for byte as in "Build a Large Language Model (From Scratch)", ch. 7)::

      Below is an instruction that describes a task. Write a response that appropriately completes the request.

      ### Instruction:
      {instruction}

      ### Input:            <- these two lines (and the blank line above) only when input is non-empty
      {input}

      ### Response:
      {output}              <- the response: carries loss with loss_on=response

- ``chatml``: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message; with loss_on=response only
  each assistant turn's ``{content}<|im_end|>`` carries loss. (Its two markers are added to the
  tokenizer as special tokens, so each is one id: ``vocab.requested_tokens``.)
- ``chat_template``: the messages rendered by the tokenizer's own Jinja chat template, byte for byte as
  transformers' ``apply_chat_template``; each assistant reply carries loss, placed by position
  (``chat_template.ChatTemplate``, passed in as ``chat``).
- ``raw``: the text field, all of it carrying loss.
- ``custom``: ``data.prompt_format`` with ``{named}`` record fields as the prompt, ``fields.output`` as
  the response.

A field that is missing, null, empty or of the wrong type raises ``RecordError(reason, message)``; a
missing one is named with the fields the record has and those the template reads (``missing_fields``,
which ``prepare`` also applies once to the columns of a CSV, Parquet or Hugging Face dataset).
``transform`` (the cleaning steps) is applied to each field value the template uses, never to the
template's own text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from densebatch.config import DataConfig, prompt_fields
from densebatch.data.prepare.chat_template import ChatTemplate, ChatTemplateError
from densebatch.errors import ConfigError

Segment = tuple[str, bool]
Transform = Callable[[str], str]

ALPACA_PREAMBLE = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class RecordError(Exception):
    """A record lacks what the template needs; ``reason`` is a short key used for counting."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class EmptiedByCleaning(Exception):
    """A required field was non-empty in the input but empty after cleaning (a cleaning drop)."""


def _identity(s: str) -> str:
    return s


def _required_str(record: dict, key: str, transform: Transform, allow_numbers: bool = False) -> str:
    if key not in record:
        raise RecordError("missing_field", f"missing field '{key}' (set data.fields to map your field names)")
    value = record[key]
    if value is None:
        raise RecordError("null_field", f"field '{key}' is null")
    if allow_numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise RecordError("wrong_type", f"field '{key}' should be a string, got {type(value).__name__}")
    if not value.strip():
        raise RecordError("empty_field", f"field '{key}' is empty")
    out = transform(value)
    if not out.strip():
        raise EmptiedByCleaning(key)
    return out


def _optional_str(record: dict, key: str, transform: Transform) -> str:
    value = record.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError("wrong_type", f"field '{key}' should be a string, got {type(value).__name__}")
    return transform(value) if value.strip() else ""


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca prompt up to and including ``### Response:\\n`` (what a model is asked to continue)."""
    text = f"{ALPACA_PREAMBLE}\n\n### Instruction:\n{instruction}"
    if input:
        text += f"\n\n### Input:\n{input}"
    return text + "\n\n### Response:\n"


def _alpaca(record: dict, cfg: DataConfig, transform: Transform) -> list[Segment]:
    f = cfg.fields
    instruction = _required_str(record, f.instruction, transform)
    inp = _optional_str(record, f.input, transform)
    output = _required_str(record, f.output, transform)
    return [(alpaca_prompt(instruction, inp), False), (output, True)]


def _messages(record: dict, cfg: DataConfig, transform: Transform) -> list[dict]:
    """The record's messages as ``{"role", "content", ...}`` (content cleaned), checked; other keys kept."""
    f = cfg.fields
    if f.messages not in record:
        raise RecordError("missing_field", f"missing field '{f.messages}' (a list of chat messages)")
    messages = record[f.messages]
    if messages is None:
        raise RecordError("null_field", f"field '{f.messages}' is null")
    if not isinstance(messages, list):
        raise RecordError("wrong_type", f"field '{f.messages}' should be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise RecordError("empty_field", f"field '{f.messages}' is an empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RecordError("wrong_type", f"{f.messages}[{i}] should be an object with '{f.role}' and '{f.content}'")
        try:
            role = _required_str(m, f.role, _identity)
            content = _required_str(m, f.content, transform)
        except RecordError as e:
            raise RecordError(e.reason, f"{f.messages}[{i}]: {e.message}") from None
        rest = {k: v for k, v in m.items() if k not in (f.role, f.content)}
        out.append({**rest, "role": role, "content": content})
    if cfg.loss_on == "response" and not any(m["role"] == "assistant" for m in out):
        raise RecordError("no_response", f"no message with role 'assistant' in '{f.messages}': nothing would carry loss")
    return out


def _chatml(record: dict, cfg: DataConfig, transform: Transform) -> list[Segment]:
    segments: list[Segment] = []
    for m in _messages(record, cfg, transform):
        role, content = m["role"], m["content"]
        if role == "assistant":
            segments += [(f"{IM_START}{role}\n", False), (f"{content}{IM_END}", True), ("\n", False)]
        else:
            segments.append((f"{IM_START}{role}\n{content}{IM_END}\n", False))
    return segments


def _chat_template(record: dict, cfg: DataConfig, transform: Transform, chat: ChatTemplate | None) -> list[Segment]:
    if chat is None:  # prepare builds it from the tokenizer (ChatTemplate.of), which says when there is none
        raise ValueError("template chat_template: render() needs the tokenizer's ChatTemplate (chat=...)")
    messages = _messages(record, cfg, transform)
    try:
        return chat.segments(messages, loss_on_replies=cfg.loss_on == "response")
    except ChatTemplateError as e:
        where = f"{cfg.fields.messages}[{e.index}]: " if e.index is not None else ""
        raise RecordError("chat_template", where + e.message) from None


def _raw(record: dict, cfg: DataConfig, transform: Transform) -> list[Segment]:
    return [(_required_str(record, cfg.fields.text, transform), True)]


def _custom(record: dict, cfg: DataConfig, transform: Transform) -> list[Segment]:
    # load_config checked that prompt_format is set and well formed (a DataConfig built by hand: ValueError)
    if not cfg.prompt_format:
        raise ValueError("DataConfig.prompt_format is required with template custom")
    values = {n: _required_str(record, n, transform, allow_numbers=True) for n in prompt_fields(cfg.prompt_format)}
    prompt = cfg.prompt_format.format(**values)
    return [(prompt, False), (_required_str(record, cfg.fields.output, transform, allow_numbers=True), True)]


TEMPLATES = {"alpaca": _alpaca, "chatml": _chatml, "raw": _raw, "custom": _custom}
NAMES = (*TEMPLATES, "chat_template")


def template_fields(cfg: DataConfig) -> list[tuple[str, str, bool]]:
    """The record fields ``cfg.template`` reads: ``(name, the setting that names it, required)``."""
    f, t = cfg.fields, cfg.template
    if cfg.pairs is True:  # preference pairs (pairs.py): the answers; the prompt may be implicit in them
        return [(f.chosen, "data.fields.chosen", True), (f.rejected, "data.fields.rejected", True), (f.prompt, "data.fields.prompt", False)]  # fmt: skip
    if t == "alpaca":
        return [(f.instruction, "data.fields.instruction", True), (f.output, "data.fields.output", True), (f.input, "data.fields.input", False)]  # fmt: skip
    if t in ("chatml", "chat_template"):
        return [(f.messages, "data.fields.messages", True)]
    if t == "raw":
        return [(f.text, "data.fields.text", True)]
    if t == "custom" and cfg.prompt_format:
        return [(n, "data.prompt_format", True) for n in prompt_fields(cfg.prompt_format)] + [(f.output, "data.fields.output", True)]  # fmt: skip
    return []


def _listed(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
    return shown or "none"


def missing_fields(found: list[str], cfg: DataConfig, noun: str = "field") -> str | None:
    """None when ``found`` (a record's fields, or a file's columns: ``noun``) holds every field the template
    needs; else one sentence naming the missing ones, those found, those the template reads, and the fix::

        missing field 'instruction' (found fields: question, answer; template alpaca reads instruction,
        output and, if present, input): map yours with --data.fields.instruction=FIELD
    """
    reads = template_fields(cfg)
    missing = list(dict.fromkeys((name, key) for name, key, required in reads if required and name not in found))
    if not missing:
        return None
    plural = "s" if len(missing) > 1 else ""
    wanted = ", ".join(dict.fromkeys(n for n, _, required in reads if required))
    optional = [n for n, _, required in reads if not required]
    if optional:
        wanted += f" and, if present, {', '.join(optional)}"
    mapped = " ".join(f"--{key}={noun.upper()}" for _, key in missing if key != "data.prompt_format")
    fixes = [f"map yours with {mapped}"] if mapped else []
    if any(key == "data.prompt_format" for _, key in missing):
        fixes.append("name yours in data.prompt_format")
    if noun == "column":
        fixes[0] = "rename the columns or " + fixes[0]
    return (
        f"missing {noun}{plural} {', '.join(repr(n) for n, _ in missing)} (found {noun}s: {_listed(list(found))}; "
        f"template {cfg.template} reads {wanted}): {', or '.join(fixes)}"
    )


def _segments(record: dict, cfg: DataConfig, transform: Transform, chat: ChatTemplate | None) -> list[Segment]:
    if cfg.template not in NAMES:
        raise ConfigError(f"data.template: expected one of {', '.join(NAMES)}; got {cfg.template!r}")
    if (problem := missing_fields(list(record), cfg)) is not None:
        raise RecordError("missing_field", problem)
    if cfg.template == "chat_template":
        return _chat_template(record, cfg, transform, chat)
    return TEMPLATES[cfg.template](record, cfg, transform)


def render(record: dict, cfg: DataConfig, transform: Transform = _identity, chat: ChatTemplate | None = None) -> list[Segment]:
    """Segments of one record; with loss_on=all every segment carries loss. Adjacent equal flags merge.
    ``chat``: the tokenizer's chat template, for ``template: chat_template``."""
    segments = _segments(record, cfg, transform, chat)
    if cfg.loss_on == "all":
        segments = [(t, True) for t, _ in segments]
    merged: list[Segment] = []
    for text, flag in segments:
        if merged and merged[-1][1] == flag:
            merged[-1] = (merged[-1][0] + text, flag)
        elif text:
            merged.append((text, flag))
    return merged


def prompt_text(record: dict, cfg: DataConfig, chat: ChatTemplate | None = None) -> str:
    """What a model is given to answer ``record`` (every segment before the first response segment)."""
    segments = _segments(record, dataclasses.replace(cfg, loss_on="response"), _identity, chat)
    out = []
    for text, flag in segments:
        if flag:
            break
        out.append(text)
    return "".join(out)


def render_text(record: dict, cfg: DataConfig, chat: ChatTemplate | None = None) -> str:
    """The whole rendered text of a record (prompt and response), for display and tests."""
    return "".join(t for t, _ in render(record, cfg, chat=chat))
