"""The documented field: a dataclass field whose help text (and minimum) ``densebatch config`` shows."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def _f(default: Any, help: str, minimum: float | None = None, **kw: Any) -> Any:
    meta = {"help": help}
    if minimum is not None:
        meta["minimum"] = minimum
    if callable(default) and not isinstance(default, (int, float, str, bool)):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)
