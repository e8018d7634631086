"""Fixtures of the data tests: small record files in every format, a fresh cache directory, and the book's
facts (GPT-2 BPE, records, token ids) from ../shared/data or, where it is absent, from tests/fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import shared_data_dir

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


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    d = shared_data_dir()
    if d is None:
        pytest.skip("../shared/data is absent")
    return d


# ---------------------------------------------------------------- book facts without ../shared
# tests/fixtures holds small derived fixtures (tests/fixtures/make_fixtures.py writes them from
# ../shared/data): the book tests run on them wherever the shared data is absent.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def expand_gpt2_subset(out: Path) -> Path:
    """The fixture's GPT-2 subset (the byte alphabet, <|endoftext|> and the merges its texts need,
    original ids) widened to GPT-2's 50,257 ids: every unused id gets a placeholder string that no
    merge can make, so the loader sees GPT-2's vocabulary size and end-of-text id 50256."""
    vocab = json.loads((FIXTURES / "gpt2-subset" / "vocab.json").read_text(encoding="utf-8"))
    used = set(vocab.values())
    vocab.update({f"<|unused-{i}|>": i for i in range(max(used) + 1) if i not in used})
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(dict(sorted(vocab.items(), key=lambda kv: kv[1]))), encoding="utf-8")
    (out / "merges.txt").write_bytes((FIXTURES / "gpt2-subset" / "merges.txt").read_bytes())
    return out


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    """../shared/data/gpt2, or the fixture's subset of it (the same ids on the texts the tests use)."""
    d = shared_data_dir()
    return d / "gpt2" if d is not None else expand_gpt2_subset(tmp_path_factory.mktemp("gpt2-subset"))


@pytest.fixture(scope="session")
def gpt2(gpt2_dir):
    from densebatch.data.prepare.tokenizers import load_tokenizer

    return load_tokenizer(str(gpt2_dir))


@pytest.fixture(scope="session")
def book_records() -> dict[int, dict]:
    """The book's records by index: all 1,100 from ../shared, else the few the fixture keeps."""
    d = shared_data_dir()
    if d is not None:
        return dict(enumerate(json.loads((d / "instruction-data.json").read_text(encoding="utf-8"))))
    lines = (FIXTURES / "book" / "records.jsonl").read_text(encoding="utf-8").splitlines()
    return {r.pop("index"): r for r in map(json.loads, lines)}


@pytest.fixture(scope="session")
def book_ids():
    """The fixture's GPT-2 ids of book items: (n_train, {index: ids}, token count of every record)."""
    import numpy as np

    z = np.load(FIXTURES / "book" / "ids.npz")
    off = z["offsets"]
    items = {int(i): z["tokens"][off[k] : off[k + 1]].astype(int).tolist() for k, i in enumerate(z["index"])}
    return int(z["n_train"]), items, z["lengths"].astype(np.int64)
