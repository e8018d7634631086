"""The documented field: a dataclass field whose help text (and minimum) ``densebatch config`` shows."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def _f(default: Any, help: str, minimum: float | None = None, key: str | None = None, **kw: Any) -> Any:
    """``key``: the name in YAML and on the command line when it cannot be the field's (a Python keyword:
    ``checkpoint.async`` is the field ``async_``)."""
    meta = {"help": help}
    if key is not None:
        meta["key"] = key
    if minimum is not None:
        meta["minimum"] = minimum
    if callable(default) and not isinstance(default, (int, float, str, bool)):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def key_of(f: Any) -> str:
    """A dataclass field's name in YAML and on the command line."""
    return f.metadata.get("key", f.name)
