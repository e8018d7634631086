"""tests/fixtures (the book facts without ../shared/data) agree with the shared data they derive from."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _make_fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fixtures_are_what_make_fixtures_writes_from_the_shared_data(shared_dir, tmp_path):
    """Regenerated from ../shared/data into a temporary directory, every fixture file is the same."""
    _make_fixtures().main(shared_dir, tmp_path)
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(FIXTURES) for p in FIXTURES.rglob("*") if p.is_file() and p.suffix != ".py")
    for f in files:
        if f.suffix == ".npz":  # compare arrays: a zip's bytes may differ with its writer
            new, old = np.load(tmp_path / f), np.load(FIXTURES / f)
            assert sorted(new.files) == sorted(old.files)
            assert all(np.array_equal(new[k], old[k]) for k in new.files), f"{f} is stale: run tests/fixtures/make_fixtures.py"
        else:
            assert (tmp_path / f).read_bytes() == (FIXTURES / f).read_bytes(), (
                f"{f} is stale: run tests/fixtures/make_fixtures.py"
            )


def test_fixtures_are_small_and_carry_their_licenses():
    size = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert size < 200 * 1024
    licenses = {p.name for p in (FIXTURES / "licenses").iterdir()}
    assert {"rasbt_LLMs-from-scratch_LICENSE.txt", "LICENSE_openai_gpt2.txt"} <= licenses
    records = [json.loads(x) for x in (FIXTURES / "book" / "records.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["index"] for r in records][:2] == [0, 1] and len(records) < 20  # an excerpt, not the data set
