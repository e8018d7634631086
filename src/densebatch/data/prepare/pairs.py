"""Preference pairs: one record's prompt and its chosen and rejected answers as text segments, through the template.

``pair_segments(record, cfg, transform, chat)`` reads a record in TRL's preference formats and returns the
prompt's segments (never a loss) and each answer's segments (with the template's loss flags):

- explicit prompt: ``prompt`` / ``chosen`` / ``rejected`` (``data.fields``): strings, or chat messages (the
  prompt a list of messages, each answer a list holding the reply);
- implicit prompt: ``chosen`` and ``rejected`` alone, each the whole text or conversation; the prompt is their
  common start (TRL's ``extract_prompt``: the longest common prefix of messages, or of characters, a space
  before the cut going with the answers);
- with no prompt field, the alpaca template takes the record's instruction (and input), so that the embedded
  default dataset's pairs are its own records with a wrong answer added, and the custom template its
  ``prompt_format`` of the record's fields.

Strings go through the template as a prompt and its response: alpaca's prompt, custom's ``prompt_format``
(its record fields), raw's text as it is; chatml and chat_template make the prompt a user message and each
answer an assistant reply. Messages need chatml or chat_template: the conversation prompt + answer is
rendered whole (byte for byte as for a document) and cut where the prompt, with the assistant turn opened,
ends (chatml's ``<|im_start|>assistant\\n``, the chat template's ``add_generation_prompt``); a template that
does not render that prompt as the start of the whole is refused for the record, not guessed.

A bad pair is a ``RecordError`` with its reason, which ``prepare`` counts or raises as ``data.on_bad_record``
says: ``empty_answer`` (an answer with no text), ``identical_answers`` (chosen and rejected render the same),
besides the fields' own reasons; ``prompt_too_long`` is judged once tokenised (``documents.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from densebatch.config import DataConfig, prompt_fields
from densebatch.data.prepare.chat_template import ChatTemplate, ChatTemplateError
from densebatch.data.prepare.templates import (
    IM_END,
    IM_START,
    EmptiedByCleaning,
    RecordError,
    Segment,
    Transform,
    alpaca_prompt,
)


@dataclass
class PairSegments:
    prompt: list[Segment]  # what both answers follow; carries no loss
    chosen: list[Segment]  # the preferred answer, with the template's loss flags
    rejected: list[Segment]


def _text(value, key: str, transform: Transform, *, allow_empty: bool = False, answer: bool = False) -> str:
    if value is None:
        raise RecordError("null_field", f"field '{key}' is null")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise RecordError(
            "wrong_type", f"field '{key}' should be a string or a list of chat messages, got {type(value).__name__}"
        )
    out = transform(value) if value.strip() else ""
    if value.strip() and not out.strip():
        raise EmptiedByCleaning(key)
    if not out.strip() and not allow_empty:
        if answer:
            raise RecordError("empty_answer", f"field '{key}' is empty (a pair needs two answers)")
        raise RecordError("empty_field", f"field '{key}' is empty")
    return out


def _messages(value, key: str, cfg: DataConfig, transform: Transform) -> list[dict]:
    f = cfg.fields
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RecordError("wrong_type", f"{key}[{i}] should be an object with '{f.role}' and '{f.content}'")
        role, content = m.get(f.role), m.get(f.content)
        if not isinstance(role, str) or not role:
            raise RecordError("missing_field", f"{key}[{i}]: missing '{f.role}'")
        if not isinstance(content, str):
            raise RecordError("wrong_type", f"{key}[{i}]: '{f.content}' should be a string")
        rest = {k: v for k, v in m.items() if k not in (f.role, f.content)}
        out.append({**rest, "role": role, "content": transform(content) if content.strip() else ""})
    return out


def _common_prompt(chosen, rejected):
    """TRL's ``extract_prompt``: (prompt, chosen rest, rejected rest) cut where the two first differ (a space
    just before the cut goes with the answers); one a prefix of the other cuts before the shorter's last item."""
    n = min(len(chosen), len(rejected))
    if n == 0:
        return chosen[:0], chosen, rejected
    idx = n - 1
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _answers(record: dict, cfg: DataConfig):
    f = cfg.fields
    values = []
    for key in (f.chosen, f.rejected):
        if key not in record:
            have = ", ".join(sorted(map(str, record))[:12]) or "none"
            raise RecordError(
                "missing_field",
                f"missing field '{key}' of a preference pair (found fields: {have}): map yours with --data.fields.chosen, "
                "--data.fields.rejected (and --data.fields.prompt)",
            )
        v = record[key]
        if v is None:
            raise RecordError("null_field", f"field '{key}' is null")
        values.append(v)
    return values


def _is_chat(value) -> bool:
    return isinstance(value, list)


def pair_segments(record: dict, cfg: DataConfig, transform: Transform, chat: ChatTemplate | None = None) -> PairSegments:
    """The prompt and both answers of ``record`` (see the module docstring); ``RecordError`` for a bad pair."""
    f = cfg.fields
    chosen, rejected = _answers(record, cfg)
    if _is_chat(chosen) != _is_chat(rejected):
        raise RecordError("wrong_type", f"fields '{f.chosen}' and '{f.rejected}' should both be strings or both chat messages")
    prompt = record.get(f.prompt)
    if prompt is None or _is_chat(prompt) != _is_chat(chosen):  # TRL: a prompt of the other kind is not the prompt
        if cfg.template == "alpaca" and not _is_chat(chosen) and record.get(f.instruction) is not None:
            instruction = _text(record[f.instruction], f.instruction, transform)
            extra = record.get(f.input)
            given = alpaca_prompt(instruction, _text(extra, f.input, transform, allow_empty=True) if extra is not None else "")
            return _finish(_string_pair(given, chosen, rejected, cfg, transform, chat, record, rendered=True), f)
        if cfg.template == "custom" and cfg.prompt_format and set(prompt_fields(cfg.prompt_format)) <= set(record):
            return _finish(_string_pair(None, chosen, rejected, cfg, transform, chat, record), f)  # the format's fields
        prompt, chosen, rejected = _common_prompt(chosen, rejected)
        if not prompt:
            raise RecordError(
                "missing_field",
                f"no field '{f.prompt}' and '{f.chosen}' and '{f.rejected}' share no start to take as the prompt "
                "(set --data.fields.prompt)",
            )
    if _is_chat(chosen):
        return _finish(_chat_pair(prompt, chosen, rejected, cfg, transform, chat), f)
    return _finish(_string_pair(prompt, chosen, rejected, cfg, transform, chat, record), f)


def _finish(pair: PairSegments, f) -> PairSegments:
    if "".join(t for t, _ in pair.chosen) == "".join(t for t, _ in pair.rejected):
        raise RecordError("identical_answers", f"fields '{f.chosen}' and '{f.rejected}' give the same answer: nothing to prefer")
    return pair


def _string_pair(
    prompt, chosen, rejected, cfg: DataConfig, transform, chat, record: dict, rendered: bool = False
) -> PairSegments:
    f = cfg.fields
    answers = [_text(a, k, transform, answer=True) for a, k in ((chosen, f.chosen), (rejected, f.rejected))]
    if cfg.template in ("chatml", "chat_template"):
        text = prompt if rendered else _text(prompt, f.prompt, transform)
        user = [{"role": "user", "content": text}]
        return _conversation(user, [[{"role": "assistant", "content": a}] for a in answers], cfg, chat)
    if rendered:
        given = prompt
    elif cfg.template == "alpaca":
        given = alpaca_prompt(_text(prompt, f.prompt, transform))
    elif cfg.template == "custom":
        if not cfg.prompt_format:
            raise ValueError("DataConfig.prompt_format is required with template custom")
        fields = record if prompt is None else {**record, f.prompt: prompt}  # the (maybe implicit) prompt by its name
        values = {}
        for name in prompt_fields(cfg.prompt_format):
            if name not in fields:
                raise RecordError("missing_field", f"missing field '{name}' that data.prompt_format names")
            values[name] = _text(fields[name], name, transform)
        given = cfg.prompt_format.format(**values)
    else:  # raw: the prompt's text as it is
        given = _text(prompt, f.prompt, transform)
    return PairSegments([(given, False)], *[_flags([(a, True)], cfg) for a in answers])


def _chat_pair(prompt, chosen, rejected, cfg: DataConfig, transform, chat) -> PairSegments:
    f = cfg.fields
    if cfg.template not in ("chatml", "chat_template"):
        raise RecordError(
            "wrong_type",
            f"chat messages in '{f.chosen}' and '{f.rejected}' need data.template chatml or chat_template "
            f"(template {cfg.template} reads strings)",
        )
    if not _is_chat(prompt):
        raise RecordError("wrong_type", f"field '{f.prompt}' should be chat messages, as the answers are")
    p = _messages(prompt, f.prompt, cfg, transform)
    answers = [_messages(a, k, cfg, transform) for a, k in ((chosen, f.chosen), (rejected, f.rejected))]
    for a, k in zip(answers, (f.chosen, f.rejected)):
        if not a or not "".join(m["content"] for m in a).strip():
            raise RecordError("empty_answer", f"field '{k}' has no reply (a pair needs two answers)")
    return _conversation(p, answers, cfg, chat)


def _conversation(prompt: list[dict], answers: list[list[dict]], cfg: DataConfig, chat: ChatTemplate | None) -> PairSegments:
    """Each answer's conversation rendered whole and cut at the end of the prompt with the reply's turn opened."""
    parts = []
    given = None
    for answer in answers:
        whole = _render(prompt + answer, cfg, chat)
        if cfg.template == "chatml":
            opened = "".join(t for t, _ in _render(prompt, cfg, chat)) + f"{IM_START}{answer[0]['role']}\n"
        else:
            try:
                opened = chat.render(prompt, add_generation_prompt=True)
            except ChatTemplateError as e:
                raise RecordError("chat_template", e.message) from None
        text = "".join(t for t, _ in whole)
        if not text.startswith(opened):
            raise RecordError(
                "chat_template",
                "the template does not render the prompt (with the reply's turn opened) as the start of the whole "
                "conversation, so the answer cannot be placed by position",
            )
        if given is not None and opened != given:
            raise RecordError("chat_template", "the template renders the prompt differently before each answer")
        given = opened
        parts.append(_flags(_cut(whole, len(opened)), cfg))
    return PairSegments([(given, False)], *parts)


def _render(messages: list[dict], cfg: DataConfig, chat: ChatTemplate | None) -> list[Segment]:
    if cfg.template == "chatml":
        out: list[Segment] = []
        for m in messages:
            if m["role"] == "assistant":
                out += [(f"{IM_START}assistant\n", False), (f"{m['content']}{IM_END}", True), ("\n", False)]
            else:
                out.append((f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n", False))
        return out
    if chat is None:
        raise ValueError("template chat_template: pair_segments() needs the tokenizer's ChatTemplate (chat=...)")
    try:
        return chat.segments(messages, loss_on_replies=True)
    except ChatTemplateError as e:
        raise RecordError("chat_template", e.message) from None


def _cut(segments: list[Segment], at: int) -> list[Segment]:
    """The segments after character ``at`` of their joined text."""
    out, pos = [], 0
    for text, flag in segments:
        end = pos + len(text)
        if end > at:
            out.append((text[max(0, at - pos) :], flag))
        pos = end
    return out


def _flags(segments: list[Segment], cfg: DataConfig) -> list[Segment]:
    """Adjacent equal flags merged; with ``loss_on: all`` the whole answer carries loss."""
    merged: list[Segment] = []
    for text, flag in segments:
        flag = flag or cfg.loss_on == "all"
        if merged and merged[-1][1] == flag:
            merged[-1] = (merged[-1][0] + text, flag)
        elif text:
            merged.append((text, flag))
    return merged


def pair_text(record: dict, cfg: DataConfig, chat: ChatTemplate | None = None) -> str:
    """The whole rendered text of a pair (prompt, chosen, rejected, end to end): what a learned tokenizer reads."""
    p = pair_segments(record, cfg, lambda text: text, chat)
    return "".join(t for t, _ in [*p.prompt, *p.chosen, *p.rejected])
