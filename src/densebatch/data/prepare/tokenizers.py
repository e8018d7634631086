"""Tokenizers: turn text into ids and back, behind one small interface, offline.

``load_tokenizer(spec)`` understands:

- ``"auto"``: the model's own tokenizer when the run trains a Hugging Face model whose directory
  holds one, else ``"default"``. The run resolves it once, up front (``resolve_tokenizer_spec``),
  so every command and the saved configuration name the tokenizer actually used; an unresolved
  ``"auto"`` (no model directory known) loads as ``"default"``.
- ``"default"``: a self-contained byte-level tokenizer (ids 0..255 are the UTF-8 bytes, then
  ``<|endoftext|>`` 256, ``<|mask|>`` 257, ``<|pad|>`` 258). Needs no files, never changes.
- a ``tokenizer.json`` file, or a local Hugging Face model directory holding one: read with the
  ``tokenizers`` library; the end-of-text token comes from ``tokenizer_config.json`` /
  ``special_tokens_map.json`` (``eos_token``), else from a well-known name.
- a directory with GPT-2 style ``vocab.json`` + ``merges.txt`` (byte-level BPE; end-of-text
  ``<|endoftext|>``, 50256 for GPT-2).
- a directory written by ``Tokenizer.save`` (so a checkpoint carries its tokenizer).
- ``"bpe:N"``: a byte-level BPE of ``N`` ids learned from the run's own training text at prepare
  time (``learned_bpe.train_bpe``), stored with the prepared documents. ``load_tokenizer`` returns a
  ``PendingBPE`` placeholder for it; ``prepare`` trains and caches the real one.

Every tokenizer has ``encode``, ``encode_batch``, ``decode``, ``eos_id``, ``pad_id`` (default: eos),
``mask_id`` (or None), ``vocab_size``, ``name``, ``special_ids``, ``fingerprint()`` (content hash for
cache keys), ``chat_template`` (the Jinja template of a Hugging Face tokenizer directory, or None) and
``save(dir)``, which writes files both ``load_tokenizer`` and transformers' ``AutoTokenizer`` read
(``tokenizer_files``). The three special-token strings of the byte-level tokenizer are *not* special
in text (text is just bytes); the Hugging Face tokenizers keep their library's behaviour.

Vocabulary extension: ``added`` (``(text, special)`` pairs, from ``data.add_tokens``,
``data.add_special_tokens`` and the chatml template's markers: ``requested_tokens``) become single ids
matched whole in text; a string already in the vocabulary keeps its id, new ones get the next ids in
order. ``tok.added`` lists the new ones and ``tok.base_vocab_size`` the size before them (what a model
grows its embeddings from).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from densebatch.data.prepare.tokenizer_files import (
    byte_level_tokenizer,
    check_encodes,
    read_chat_template,
    read_config,
    read_saved_meta,
    template_variables,
    token_text,
    write_hf_files,
)
from densebatch.data.prepare.vocab import Added, alternation, requested_tokens, unique_tokens, utf8
from densebatch.errors import ConfigError

SAVED_META = "densebatch_tokenizer.json"
# Names tried, in order, when a tokenizer.json comes without a config naming its end-of-text token.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
_MASK_NAMES = ("<|mask|>", "<mask>", "[MASK]")


class Tokenizer:
    """Common interface; subclasses implement ``encode_batch`` and ``decode``."""

    name: str
    eos_id: int
    pad_id: int
    mask_id: int | None
    vocab_size: int
    base_vocab_size: int  # before densebatch added tokens
    added: list[dict]  # tokens densebatch added: {"content", "id", "special"}, ids >= base_vocab_size
    chat_template: str | None = None
    template_variables: dict[str, str] = {}  # bos_token, eos_token, ... as a chat template sees them

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def special_ids(self) -> list[int]:
        return sorted({i for i in (self.eos_id, self.pad_id, self.mask_id) if i is not None})

    def fingerprint(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> dict:
        return {
            "name": self.name,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "mask_id": self.mask_id,
            "vocab_size": self.vocab_size,
            "base_vocab_size": self.base_vocab_size,
            "added_tokens": self.added,
            "fingerprint": self.fingerprint(),
        }

    def save(self, directory: str | Path) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_pad(self, pad_id: int | None) -> int:
        pad = self.eos_id if pad_id is None else int(pad_id)
        if not 0 <= pad < self.vocab_size:
            raise ConfigError(f"data.pad_id: expected an id in [0, {self.vocab_size}) for tokenizer {self.name}; got {pad_id}")
        return pad


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids; three special ids above them, then added tokens. Deterministic, no files."""

    SPECIALS = ("<|endoftext|>", "<|mask|>", "<|pad|>")

    def __init__(self, pad_id: int | None = None, added: Added = ()) -> None:
        self.name = "default"
        self.eos_id, self.mask_id = 256, 257
        self.base_vocab_size = 256 + len(self.SPECIALS)
        self.requested = unique_tokens(added)
        ids = {t: 256 + i for i, t in enumerate(self.SPECIALS)}  # an added base special is matched, keeps its id
        self.added = []
        for content, special in self.requested:
            if content not in ids:
                ids[content] = self.base_vocab_size + len(self.added)
                self.added.append({"content": content, "id": ids[content], "special": special})
        self._ids = {t: ids[t] for t, _ in self.requested}  # the strings matched whole in text
        self._text = {i: t for t, i in ids.items()}
        self._pattern = alternation(self._ids)
        self.vocab_size = self.base_vocab_size + len(self.added)
        self.pad_id = self._check_pad(pad_id)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # utf8: a surrogate from undecodable input maps back to its raw byte, another lone one to U+FFFD.
        if self._pattern is None:
            return [list(utf8(t)) for t in texts]
        out = []
        for t in texts:
            ids, pos = [], 0
            for m in self._pattern.finditer(t):
                ids += utf8(t[pos : m.start()])
                ids.append(self._ids[m.group()])
                pos = m.end()
            out.append(ids + list(utf8(t[pos:])))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", "replace"))
            run = bytearray()
            out.append(self._text.get(i, f"<|{i}|>"))
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)

    def fingerprint(self) -> str:
        if not self.requested:
            return "byte-v1"
        return "byte-v1+" + hashlib.sha256(json.dumps(self.requested).encode()).hexdigest()[:16]

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        meta = {"kind": "byte", "pad_id": self.pad_id, "added": self.requested}
        (d / SAVED_META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        hf = byte_level_tokenizer(self.SPECIALS, [(a["content"], a["special"]) for a in self.added])
        assert hf.get_vocab_size(with_added_tokens=True) == self.vocab_size, "the exported ids are densebatch's"
        write_hf_files(d, self, hf)


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (tokenizer.json or byte-level BPE files) plus its special ids, its directory's
    config (special tokens, chat template) and the tokens densebatch added to it."""

    def __init__(
        self,
        tok,
        *,
        name: str,
        eos_token: str,
        mask_token: str | None = None,
        pad_id: int | None = None,
        added: Added = (),
        config: dict | None = None,
        chat_template: str | None = None,
    ) -> None:
        from tokenizers import AddedToken

        self._tok = tok
        self.name = name
        self.eos_token = eos_token
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise ConfigError(f"data.tokenizer: {name}: end-of-text token {eos_token!r} is not in the vocabulary")
        self.eos_id = int(eos)
        check_encodes(tok, name)
        self.base_vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.added = []
        for content, special in unique_tokens(added):  # one at a time: new ids follow the order given
            before = tok.token_to_id(content)
            token = AddedToken(content, special=special, normalized=False)
            tok.add_special_tokens([token]) if special else tok.add_tokens([token])
            if before is None:
                self.added.append({"content": content, "id": int(tok.token_to_id(content)), "special": special})
        self.mask_token = mask_token
        self.mask_id = None if mask_token is None else tok.token_to_id(mask_token)
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.pad_id = self._check_pad(pad_id)
        self.config = dict(config or {})
        self.chat_template = chat_template
        self.template_variables = template_variables(self.config)
        self._fingerprint: str | None = None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # add_special_tokens=False: densebatch appends the end-of-text itself, by position.
        try:
            "".join(texts).encode("utf-8")  # one pass: undecodable bytes (surrogates) are rare
        except UnicodeEncodeError:
            texts = [utf8(t).decode("utf-8", "replace") for t in texts]
        fast = getattr(self._tok, "encode_batch_fast", None)  # the same ids without character offsets
        return [e.ids for e in (fast or self._tok.encode_batch)(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        # The serialised tokenizer covers vocabulary, merges, normalisers and added tokens.
        if self._fingerprint is None:
            h = hashlib.sha256(self._tok.to_str().encode("utf-8"))
            h.update(json.dumps([self.eos_token, self.mask_token]).encode())
            self._fingerprint = "hf-" + h.hexdigest()[:32]
        return self._fingerprint

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        meta = {
            "kind": "hf",
            "name": self.name,
            "eos_token": self.eos_token,
            "mask_token": self.mask_token,
            "pad_id": self.pad_id,
            "base_vocab_size": self.base_vocab_size,
            "added": self.added,
        }
        (d / SAVED_META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        write_hf_files(d, self, self._tok, self.config, self.chat_template)


def load_data_tokenizer(cfg) -> Tokenizer:
    """The tokenizer a ``DataConfig`` prepares with: ``data.tokenizer`` plus the tokens it adds."""
    return load_tokenizer(cfg.tokenizer, cfg.pad_id, requested_tokens(cfg))


def _first_known(tok, names: Sequence[str]) -> str | None:
    return next((n for n in names if tok.token_to_id(n) is not None), None)


def _load_tokenizer_json(
    path: Path, *, name: str, pad_id: int | None, eos_token: str | None = None, mask_token: str | None = None, added: Added = ()
) -> HFTokenizer:
    from tokenizers import Tokenizer as _Tok

    try:
        tok = _Tok.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for malformed files
        raise ConfigError(f"data.tokenizer: cannot read {path}: {e}") from None
    config = read_config(path.parent)
    eos_token = eos_token or token_text(config.get("eos_token")) or _first_known(tok, _EOS_NAMES)
    if eos_token is None:
        raise ConfigError(
            f"data.tokenizer: {path}: cannot tell the end-of-text token; add tokenizer_config.json with "
            f'"eos_token" beside it (tried {", ".join(_EOS_NAMES)})'
        )
    mask_token = mask_token or token_text(config.get("mask_token")) or _first_known(tok, _MASK_NAMES)
    chat_template = read_chat_template(path.parent, config)
    return HFTokenizer(
        tok,
        name=name,
        eos_token=eos_token,
        mask_token=mask_token,
        pad_id=pad_id,
        added=added,
        config=config,
        chat_template=chat_template,
    )


def _load_bpe_files(directory: Path, pad_id: int | None, added: Added = ()) -> HFTokenizer:
    from tokenizers import ByteLevelBPETokenizer

    try:
        bpe = ByteLevelBPETokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"))
    except Exception as e:
        raise ConfigError(f"data.tokenizer: cannot read GPT-2 BPE files in {directory}: {e}") from None
    tok = bpe._tokenizer  # the underlying tokenizers.Tokenizer: same encode/save as tokenizer.json ones
    config = read_config(directory)
    eos = token_text(config.get("eos_token")) or "<|endoftext|>"
    if tok.token_to_id(eos) is None:
        raise ConfigError(f"data.tokenizer: {directory}/vocab.json has no {eos!r} (the end-of-text token)")
    # As Hugging Face's GPT2TokenizerFast: the end-of-text string in text maps to its one id.
    tok.add_special_tokens([eos])
    chat_template = read_chat_template(directory, config)
    return HFTokenizer(
        tok, name=str(directory), eos_token=eos, pad_id=pad_id, added=added, config=config, chat_template=chat_template
    )


class PendingBPE(Tokenizer):
    """``bpe:N`` before training: knows its size and identity (for cache keys), encodes nothing."""

    def __init__(self, spec: str, pad_id: int | None, added: Added = ()) -> None:
        try:
            self.vocab_size = int(spec.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"data.tokenizer: expected bpe:N with an integer N (e.g. bpe:2048); got {spec!r}") from None
        if not 300 <= self.vocab_size <= 1_000_000:
            raise ConfigError(
                f"data.tokenizer: bpe:N needs N between 300 and 1000000 (256 bytes + merges); got {self.vocab_size}"
            )
        self.name = spec
        self.requested_pad_id = pad_id
        self.requested = unique_tokens(added)
        self.base_vocab_size = self.vocab_size
        self.added = []
        self.eos_id = self.pad_id = 0  # unknown until trained
        self.mask_id = None

    def fingerprint(self) -> str:
        # the cache key also hashes the input text and every setting
        return "pending-" + self.name + (json.dumps(self.requested) if self.requested else "")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        raise RuntimeError("bpe:N tokenizer used before prepare trained it")


def has_tokenizer_files(directory: str | Path) -> bool:
    """True when ``directory`` holds a tokenizer ``load_tokenizer`` can read (tokenizer.json, GPT-2
    vocab.json + merges.txt, or one saved by ``Tokenizer.save``)."""
    d = Path(directory).expanduser()
    return d.is_dir() and (
        (d / SAVED_META).is_file()
        or (d / "tokenizer.json").is_file()
        or ((d / "vocab.json").is_file() and (d / "merges.txt").is_file())
    )


def resolve_tokenizer_spec(data_tokenizer: str, model_dir: str | Path | None) -> str:
    """The tokenizer spec a run uses: ``data_tokenizer`` itself, except ``"auto"``, which becomes
    ``model_dir`` when that holds a tokenizer (a Hugging Face model trained with its own tokenizer,
    as pre-tokenised data made for it needs) and ``"default"`` otherwise. ``model_dir``: the
    model directory of a ``model.kind: hf`` run, None for any other model."""
    if str(data_tokenizer) != "auto":
        return str(data_tokenizer)
    if model_dir is not None and has_tokenizer_files(model_dir):
        return str(model_dir)
    return "default"


def load_tokenizer(spec: str | Path = "default", pad_id: int | None = None, added: Added = ()) -> Tokenizer:
    """Load the tokenizer named by ``spec`` (see the module docstring) with ``added`` tokens; ``pad_id`` None = eos."""
    if str(spec) in ("default", "auto"):
        return ByteTokenizer(pad_id, added)
    if str(spec).startswith("bpe:"):
        return PendingBPE(str(spec), pad_id, added)
    p = Path(spec).expanduser()
    if p.is_file():
        return _load_tokenizer_json(p, name=str(spec), pad_id=pad_id, added=added)
    if p.is_dir():
        if (p / SAVED_META).is_file():
            meta = read_saved_meta(p / SAVED_META)  # checked: a damaged file is named, not a traceback
            pad = meta.get("pad_id") if pad_id is None else pad_id
            if meta.get("kind") == "byte":
                return ByteTokenizer(pad, [*map(tuple, meta.get("added", [])), *added])
            tok = _load_tokenizer_json(
                p / "tokenizer.json",
                name=meta.get("name", str(spec)),
                pad_id=pad,
                eos_token=meta.get("eos_token"),
                mask_token=meta.get("mask_token"),
                added=added,
            )
            # the tokens added before saving are in tokenizer.json already: keep what they were added to
            tok.added = meta.get("added", []) + tok.added
            tok.base_vocab_size = int(meta.get("base_vocab_size", tok.base_vocab_size))
            return tok
        if (p / "tokenizer.json").is_file():
            return _load_tokenizer_json(p / "tokenizer.json", name=str(spec), pad_id=pad_id, added=added)
        if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            return _load_bpe_files(p, pad_id, added)
        raise ConfigError(f"data.tokenizer: directory '{spec}' has neither tokenizer.json nor vocab.json + merges.txt")
    raise ConfigError(
        f"data.tokenizer: '{spec}' not found; expected 'default', a tokenizer.json file, a local Hugging Face "
        "model directory, or a directory with vocab.json + merges.txt"
    )
