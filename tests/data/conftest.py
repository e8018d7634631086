"""Fixtures of the data tests: small record files in every format and a fresh cache directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from densebatch.config import DataConfig

RECORDS = [
    {"instruction": "Say hi.", "input": "", "output": "hi"},
    {"instruction": "Uppercase the word.", "input": "cat", "output": "CAT"},
    {"instruction": "Add.", "input": "2 + 2", "output": "4"},
]


def write_jsonl(path: Path, records, raw_lines=()) -> Path:
    lines = [json.dumps(r) for r in records] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def records() -> list[dict]:
    return [dict(r) for r in RECORDS]


@pytest.fixture(name="write_jsonl")
def _write_jsonl_fixture():
    return write_jsonl


@pytest.fixture
def data_cfg(tmp_path):
    """A DataConfig factory writing its cache under tmp_path."""

    def make(**kw) -> DataConfig:
        kw.setdefault("cache_dir", str(tmp_path / "cache"))
        kw.setdefault("eval_fraction", 0.0)
        return DataConfig(**kw)

    return make


def _shared_data_dir() -> Path | None:
    """../shared/data beside the repository, or $DENSEBATCH_SHARED/data (as tests/conftest.py)."""
    import os

    env = os.environ.get("DENSEBATCH_SHARED")
    repo = Path(__file__).resolve().parents[2]
    for cand in ([Path(env) / "data"] if env else []) + [repo.parent / "shared" / "data"]:
        if (cand / "README.md").is_file():
            return cand
    return None


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    d = _shared_data_dir()
    if d is None:
        pytest.skip("../shared/data is absent")
    return d


@pytest.fixture(scope="session")
def gpt2(shared_dir):
    from densebatch.data.tokenizers import load_tokenizer

    return load_tokenizer(str(shared_dir / "gpt2"))
