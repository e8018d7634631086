"""What a metric sink logs of a record: its numeric scalars, flattened, at its step."""

from __future__ import annotations

from typing import Any


def flatten(record: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": 1, "b": {"c": 2}}`` → ``{"a": 1, "b/c": 2}`` (``kind`` and ``step`` left out at the top)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if not prefix and key in ("kind", "step"):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def numeric_scalars(record: dict) -> dict[str, float]:
    """The numeric fields of ``record`` (flattened), as floats; NaN and inf are kept, bools are not numbers."""
    return {k: float(v) for k, v in flatten(record).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def record_step(record: dict) -> int | None:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None
