"""Vocabulary extension: the tokens a data configuration adds to its tokenizer, each once, checked.

``requested_tokens(cfg)`` is the ordered list of ``(text, special)`` pairs: the chatml template's
markers when any source uses chatml, then ``data.add_special_tokens``, then ``data.add_tokens``.
New ids follow that order, so the same configuration always gives the same ids.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from densebatch.data.prepare.templates import IM_END, IM_START
from densebatch.errors import ConfigError

Added = Sequence[tuple[str, bool]]  # (text, special) of each token to add


def unique_tokens(added: Added) -> list[tuple[str, bool]]:
    """``added`` with repeats dropped (the first occurrence decides); an empty string is a ``ConfigError``."""
    out, seen = [], set()
    for content, special in added:
        if not isinstance(content, str) or not content:
            raise ConfigError(f"data.add_tokens / data.add_special_tokens: expected non-empty strings; got {content!r}")
        if content not in seen:
            seen.add(content)
            out.append((content, bool(special)))
    return out


def alternation(strings) -> re.Pattern | None:
    """Leftmost-longest matching of ``strings`` (as the tokenizers library matches added tokens)."""
    if not strings:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(strings, key=len, reverse=True)))


def requested_tokens(cfg) -> list[tuple[str, bool]]:
    """The tokens a ``DataConfig`` adds: chatml's markers (when a source uses chatml), then
    ``add_special_tokens``, then ``add_tokens``; each once."""
    templates = {s.template or cfg.template for s in cfg.sources} if cfg.sources else {cfg.template}
    out = [(IM_START, True), (IM_END, True)] if "chatml" in templates else []
    out += [(t, True) for t in cfg.add_special_tokens] + [(t, False) for t in cfg.add_tokens]
    return unique_tokens(out)


def added_tokens_line(added: Sequence[dict], limit: int = 20) -> str | None:
    """``added tokens: <|im_start|>=259, <|im_end|>=260`` (a tokenizer's ``added``: ``{"content", "id", ...}``
    in id order), or None when none were added; printed once when a run's data are prepared. A token
    with spaces or control characters is shown quoted; past ``limit`` tokens, how many more."""
    if not added:
        return None
    shown = [f"{_shown(a['content'])}={a['id']}" for a in added[:limit]]
    more = f", ... and {len(added) - limit} more" if len(added) > limit else ""
    return f"added tokens: {', '.join(shown)}{more}"


def _shown(content: str) -> str:
    return content if content.isprintable() and not any(c.isspace() for c in content) else repr(content)


# Surrogates that surrogateescape cannot map back to a byte (it maps U+DC80..U+DCFF, what undecodable
# input bytes were read as): a lone \ud800 in a JSON string, say.
_UNMAPPABLE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def utf8(text: str) -> bytes:
    """``text`` as UTF-8; an undecodable input byte read as a surrogate maps back to that byte
    (surrogateescape), any other lone surrogate becomes U+FFFD (never an exception: a tokenizer must not
    stop a prepare on one character; ``data.clean.fix_encoding`` repairs such text where it can)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return _UNMAPPABLE.sub("\ufffd", text).encode("utf-8", "surrogateescape")
