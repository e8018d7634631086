"""Hugging Face tokenizer files: what a directory's config says (special tokens, chat template), whether a
``tokenizer.json`` encodes text at all, and writing every densebatch tokenizer so that
``transformers.AutoTokenizer.from_pretrained`` loads it.

A saved directory holds ``tokenizer.json`` (the ``tokenizers`` library's file: vocabulary, merges,
added tokens), ``tokenizer_config.json`` (``eos_token``, ``pad_token``, ``mask_token``, the chat
template, and whatever else the tokenizer's own config carried) and ``special_tokens_map.json``.
The byte-level default tokenizer has no file of its own, so one is built here: a BPE with no merges
whose 256 base tokens are the bytes in GPT-2's byte-to-character alphabet (id b = byte b), then
``<|endoftext|>``, ``<|mask|>``, ``<|pad|>`` and any added tokens, in densebatch's order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from densebatch.errors import ConfigError, read_json_object

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_DROPPED_KEYS = ("added_tokens_decoder", "chat_template", "auto_map")  # rewritten or meaningless once saved here


PROBE = "The quick brown fox jumps over the lazy dog, 12 times."  # any tokenizer of text gives it ids


def check_encodes(tok, name: str) -> None:
    """``ConfigError`` when ``tok`` turns text into no ids: every document would be its end-of-text alone (a
    ``tokenizer.json`` written with an empty vocabulary: transformers' ``GPT2TokenizerFast(vocab_file=...,
    merges_file=...).save_pretrained`` once wrote one)."""
    try:
        ids = tok.encode(PROBE, add_special_tokens=False).ids
    except Exception:  # a word-level vocabulary without an unknown token: it encodes what it knows
        return
    if not ids:
        raise ConfigError(
            f"data.tokenizer: {name} encodes text to no ids (its vocabulary holds {tok.get_vocab_size()}): every "
            "document would be its end-of-text alone; make it again (from GPT-2's vocab.json + merges.txt: docs/data.md)"
        )


def token_text(value) -> str | None:
    """A special token's string in a config (plain, or an AddedToken dict with ``content``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"data.tokenizer: {path} is not a valid JSON object") from None
    if not isinstance(data, dict):
        raise ConfigError(f"data.tokenizer: {path} is not a valid JSON object")
    return data


_SAVED_FIELDS = {  # densebatch_tokenizer.json's fields: (whether a value fits, what it must be)
    "pad_id": (lambda v: v is None or type(v) is int, "an integer or null"),
    "base_vocab_size": (lambda v: type(v) is int and v > 0, "a positive integer"),
    "name": (lambda v: isinstance(v, str), "a string"),
    "eos_token": (lambda v: isinstance(v, str), "a string"),
    "mask_token": (lambda v: v is None or isinstance(v, str), "a string or null"),
}

_ADDED = {  # kind -> (what each entry of "added" is, whether an entry fits)
    "byte": ("[text, special] pairs", lambda a: isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and a[0] != ""),
    "hf": (  # the tokens added to the saved tokenizer.json, with their ids
        '{"content", "id", "special"} objects',
        lambda a: isinstance(a, dict) and isinstance(a.get("content"), str) and type(a.get("id")) is int,
    ),
}


def read_saved_meta(path: Path) -> dict:
    """The ``densebatch_tokenizer.json`` that ``Tokenizer.save`` wrote, checked: ``ConfigError`` in one line
    naming the file and the field when it is not JSON, not an object, or a field has the wrong type."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{path} is not a tokenizer densebatch saved: {why}")

    meta = read_json_object(path, "a tokenizer densebatch saved")
    kind = meta.setdefault("kind", "hf")
    if kind not in ("byte", "hf"):
        raise bad(f"kind must be 'byte' or 'hf' (got {_shown(kind)})")
    for key, (fits, what) in _SAVED_FIELDS.items():
        if key in meta and not fits(meta[key]):
            raise bad(f"{key} must be {what} (got {_shown(meta[key])})")
    added = meta.setdefault("added", [])
    what, fits = _ADDED[kind]
    if not isinstance(added, list) or not all(map(fits, added)):
        wrong = added if not isinstance(added, list) else next(a for a in added if not fits(a))
        raise bad(f"added must be a list of {what} (got {_shown(wrong)})")
    return meta


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_config(directory: Path) -> dict:
    """``tokenizer_config.json`` with ``special_tokens_map.json``'s entries filling its gaps ({} when neither exists)."""
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        p = directory / name
        if p.is_file():
            config.update({k: v for k, v in read_json(p).items() if v is not None})
    return config


def read_chat_template(directory: Path, config: dict) -> str | None:
    """The directory's default chat template: ``chat_template.jinja``, ``chat_template.json`` or the config's
    ``chat_template`` (a string, or a list of named templates whose ``default`` is used)."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    value = config.get("chat_template")
    if (directory / "chat_template.json").is_file():
        value = read_json(directory / "chat_template.json").get("chat_template", value)
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value.strip() else None


def template_variables(config: dict) -> dict[str, str]:
    """The special tokens a chat template sees by name (``bos_token``, ``eos_token``, ...), as transformers passes them."""
    out = {}
    for key in SPECIAL_KEYS:
        text = token_text(config.get(key))
        if text is not None:
            out[key] = text
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_level_tokenizer(specials: Sequence[str], added: Sequence[tuple[str, bool]]):
    """A ``tokenizers.Tokenizer`` giving densebatch's byte-level ids: byte b -> b, then ``specials``, then ``added``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for content, special in added:  # one at a time: ids follow the order given
        token = AddedToken(content, special=special, normalized=False)
        tok.add_special_tokens([token]) if special else tok.add_tokens([token])
    return tok


def write_hf_files(directory: Path, tok, hf_tokenizer, config: dict | None = None, chat_template: str | None = None) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` for densebatch tokenizer
    ``tok`` whose ``tokenizers.Tokenizer`` is ``hf_tokenizer``; ``config`` is the source directory's own config
    (kept, except what is rewritten here), ``chat_template`` its chat template."""
    hf_tokenizer.save(str(directory / "tokenizer.json"))
    cfg = {k: v for k, v in (config or {}).items() if k not in _DROPPED_KEYS}
    cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    cfg["eos_token"] = hf_tokenizer.id_to_token(tok.eos_id)
    cfg["pad_token"] = hf_tokenizer.id_to_token(tok.pad_id)
    if tok.mask_id is not None:
        cfg["mask_token"] = hf_tokenizer.id_to_token(tok.mask_id)
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False), encoding="utf-8")
    specials = {k: token_text(cfg[k]) for k in SPECIAL_KEYS if token_text(cfg.get(k)) is not None}
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=1, ensure_ascii=False), encoding="utf-8")
