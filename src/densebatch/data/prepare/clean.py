"""Text cleaning: opt-in steps on field values and record filters, each counting what it changed.

Per field value, in this order (each only when enabled in ``data.clean``):
``fix_encoding`` (ftfy's repair of mojibake, double-encoded UTF-8 and stray surrogates, nothing else),
``strip_html`` (tags removed, entities decoded, script/style bodies dropped, block tags → newline),
``nfkc`` (Unicode NFKC), ``control_chars`` (Unicode Cc removed except newline and tab; ``\\r\\n`` →
``\\n``), ``collapse_whitespace`` (runs of spaces/tabs → one space, trailing spaces cut, at most one
blank line, ends stripped), ``terms`` (a user's dictionary: each whole word or phrase replaced by its
standard form, case-sensitively, the longest match first; a term is whole when no letter, digit or
underscore touches it).
Per rendered record: ``min_chars`` / ``max_chars`` (length of the whole rendered text). ``dedupe`` (exact or
near copies of earlier records) needs every record and is decided once all are rendered (``dedupe.py``);
``Cleaner.values`` holds the cleaned field values of the record just rendered, its content for near dedupe.

``changed[step]`` counts *records* in which the step changed at least one value; ``dropped[step]``
counts records a filter removed (plus ``emptied`` for records whose required field became empty).
"""

from __future__ import annotations

import json
import re
import unicodedata
from html.parser import HTMLParser
from pathlib import Path

from densebatch.config import CleanConfig
from densebatch.data.prepare.dedupe import dedupe_mode
from densebatch.errors import ConfigError

_BLOCK_TAGS = {"p", "br", "div", "li", "ul", "ol", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "hr", "table"}
_SKIP_TAGS = {"script", "style"}
_TAG_HINT = re.compile(r"<[A-Za-z/!]|&[#A-Za-z0-9]+;")
_SPACES = re.compile(r"[^\S\n]+")  # whitespace other than newline
_TRAILING = re.compile(r" +\n")
_BLANKS = re.compile(r"\n{3,}")


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)  # entities decoded inside data
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in _SKIP_TAGS:
            self._skip += 1
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in _SKIP_TAGS:
            self._skip = max(0, self._skip - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def strip_html(text: str) -> str:
    """Visible text of an HTML fragment; text without tags or entities comes back unchanged."""
    if not _TAG_HINT.search(text):
        return text
    parser = _TextExtractor()
    parser.feed(text)
    parser.close()
    return "".join(parser.parts)


def remove_control_chars(text: str) -> str:
    text = text.replace("\r\n", "\n")
    return "".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc")


def collapse_whitespace(text: str) -> str:
    return collapse_inner_whitespace(text).strip()


def collapse_inner_whitespace(text: str) -> str:
    """``collapse_whitespace`` without cutting the text's own ends."""
    text = _SPACES.sub(" ", text)
    text = _TRAILING.sub("\n", text)
    text = text.replace("\n ", "\n")
    return _BLANKS.sub("\n\n", text)


def _nfkc(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def encoding_fixer():
    """ftfy's repair of encoding damage only (mojibake, double-encoded UTF-8, surrogates), or a one-line
    ConfigError naming the extra."""
    try:
        import ftfy
    except ImportError:
        raise ConfigError("data.clean.fix_encoding needs the ftfy package: pip install 'densebatch[ftfy]'") from None
    only_encoding = ftfy.TextFixerConfig(
        unescape_html=False, remove_terminal_escapes=False, uncurl_quotes=False, fix_latin_ligatures=False,
        fix_character_width=False, fix_line_breaks=False, remove_control_chars=False, normalization=None, explain=False,
    )  # fmt: skip
    return lambda text: ftfy.fix_text(text, only_encoding)


_ARROWS = re.compile(r"\s*(?:->|→|\t)\s*")


def read_terms(path: str) -> dict[str, str]:
    """The dictionary of ``data.clean.terms``: a JSON object, or ``from -> to`` lines (``→`` or a tab also
    separate; blank lines and lines starting with ``#`` skipped). A one-line ConfigError names a bad line:
    an empty side (an empty ``to`` would delete the word), or a term given two different replacements."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.clean.terms {path}: cannot be read ({type(e).__name__}: {e})") from None
    where = f"data.clean.terms {path}"
    if text.lstrip().startswith(("{", "[")):
        try:
            pairs = json.loads(text, object_pairs_hook=lambda p: p)
        except ValueError as e:
            raise ConfigError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(pairs, list) or not all(isinstance(p, tuple) for p in pairs):
            raise ConfigError(f'{where}: expected a JSON object of terms to replacements, like {{"JS": "JavaScript"}}')
        if not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in pairs):
            raise ConfigError(f"{where}: expected a JSON object of non-empty strings to non-empty strings")
        return _terms_table(((f"{where}: key {k!r}", k, v) for k, v in pairs))
    lines = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = _ARROWS.split(line.strip(), maxsplit=1)
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ConfigError(f"{where}:{n}: expected 'from -> to', both sides non-empty; got {line.strip()!r}")
        lines.append((f"{where}:{n}", *parts))
    return _terms_table(lines)


def _terms_table(entries) -> dict[str, str]:
    """{from: to} of (where, from, to) entries; a term given two different replacements is a ConfigError."""
    table: dict[str, str] = {}
    first: dict[str, str] = {}
    for where, old, new in entries:
        if table.get(old, new) != new:
            raise ConfigError(f"{where}: {old!r} -> {new!r}, but {first[old]} gave {old!r} -> {table[old]!r}")
        table[old] = new
        first.setdefault(old, where)
    return table


def term_replacer(table: dict[str, str]):
    """Replace each whole-word occurrence of a key of ``table`` by its value, longest key first."""
    if not table:
        return lambda text: text
    keys = sorted(table, key=len, reverse=True)
    pattern = re.compile(r"(?<!\w)(?:" + "|".join(re.escape(k) for k in keys) + r")(?!\w)")
    return lambda text: pattern.sub(lambda m: table[m.group(0)], text)


class Cleaner:
    """Applies ``CleanConfig`` to field values (``transform``) and rendered records (``keep``)."""

    def __init__(self, cfg: CleanConfig, keep_edges: bool = False) -> None:
        """``keep_edges``: ``collapse_whitespace`` keeps a value's leading and trailing white space (a block of
        running text, ``text_blocks.py``, whose edges are not the text's)."""
        self.cfg = cfg
        self.steps = [
            (name, make())
            for name, make in (
                ("fix_encoding", encoding_fixer),
                ("strip_html", lambda: strip_html),
                ("nfkc", lambda: _nfkc),
                ("control_chars", lambda: remove_control_chars),
                ("collapse_whitespace", lambda: collapse_inner_whitespace if keep_edges else collapse_whitespace),
                ("terms", lambda: term_replacer(read_terms(cfg.terms))),
            )
            if getattr(cfg, name)
        ]
        self.changed: dict[str, int] = {name: 0 for name, _ in self.steps}
        self.dropped: dict[str, int] = {}
        self._touched: set[str] = set()  # steps that changed something in the current record
        self.values: list[str] = []  # the current record's field values, cleaned

    @property
    def active(self) -> bool:
        c = self.cfg
        return bool(self.steps or dedupe_mode(c) != "off" or c.min_chars or c.max_chars)

    def start_record(self) -> None:
        self._touched = set()
        self.values = []

    def transform(self, value: str) -> str:
        for name, fn in self.steps:
            new = fn(value)
            if new != value:
                self._touched.add(name)
                value = new
        self.values.append(value)
        return value

    @property
    def touched(self) -> set[str]:
        """The steps that changed something since ``start_record``."""
        return self._touched

    def finish_record(self) -> None:
        """Count the steps that changed the record just rendered (call once per rendered record)."""
        for name in self._touched:
            self.changed[name] += 1

    def drop(self, step: str, n: int = 1) -> None:
        self.dropped[step] = self.dropped.get(step, 0) + n

    def keep(self, rendered: str) -> bool:
        """Length filters on the rendered text; counts a drop when False."""
        n = len(rendered)
        if self.cfg.min_chars and n < self.cfg.min_chars:
            self.drop("min_chars")
            return False
        if self.cfg.max_chars and n > self.cfg.max_chars:
            self.drop("max_chars")
            return False
        return True
