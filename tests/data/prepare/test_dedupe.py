"""Duplicate removal (data/prepare/dedupe.py): exact and near copies, the first kept, the same store for
any number of processes; a mixture's later source against its earlier ones; the held-out leakage count;
``inspect`` showing records before and after cleaning."""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest
from in_memory_prepare import in_memory

from densebatch.config import CleanConfig, DataConfig, SourceConfig
from densebatch.data.prepare.dedupe import lsh_shape
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.tokenizers import load_tokenizer
from densebatch.errors import ConfigError, DataError

pytest.importorskip("datasketch")

_WORDS = "river stone light garden paper window music cloud forest bridge candle silver market winter ocean".split()


def _answer(seed: int, n: int = 120) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) + str(rng.randrange(50)) for _ in range(n)) + "."


def _rec(instruction: str, output: str, **extra) -> dict:
    return {"instruction": instruction, "input": "", "output": output, **extra}


A, B, C = _answer(1), _answer(2), _answer(3)
ONE_WORD = A.split()
ONE_WORD[60] = "changed"
RECORDS = [
    _rec("Describe the scene.", A),  # 0: kept
    _rec("Summarise the text.", B),  # 1: kept
    _rec("Describe the scene.", A),  # 2: an exact copy of 0
    _rec("DESCRIBE  the scene!", A.upper().replace(" ", "  ")),  # 3: case, spaces and punctuation differ from 0
    _rec("Describe the scene.", " ".join(ONE_WORD)),  # 4: one word of 120 changed
    _rec("List the items.", C),  # 5: kept
    _rec("Summarise the text.", B.replace(" ", ", ", 5)),  # 6: commas added to 1
    _rec("Short.", "yes"),  # 7: kept (a short text is one shingle)
    _rec("Short.", "no"),  # 8: kept
]


def _texts(store) -> list[str]:
    tok = load_tokenizer("default")
    return [tok.decode(store.document(i)[0].tolist()) for i in range(len(store))]


def _files(entry) -> dict[str, bytes]:
    return {str(p.relative_to(entry)): p.read_bytes() for p in sorted(entry.rglob("*")) if p.is_file()}


def test_exact_drops_exact_copies_and_near_drops_near_copies_too(data_cfg, tmp_path, write_jsonl):
    path = str(write_jsonl(tmp_path / "a.jsonl", RECORDS))
    off = prepare(data_cfg(path=path))
    exact = prepare(data_cfg(path=path, clean=CleanConfig(dedupe="exact")))
    assert prepare(data_cfg(path=path, clean=CleanConfig(dedupe=True))).cache_dir == exact.cache_dir  # true means exact
    near = prepare(data_cfg(path=path, clean=CleanConfig(dedupe="near")))
    assert len({off.cache_dir, exact.cache_dir, near.cache_dir}) == 3  # the mode is in the cache key
    assert len(off.train) == 9 and off.summary.cleaning_dropped == {}
    assert exact.summary.cleaning_dropped == {"dedupe": 1} and len(exact.train) == 8
    assert near.summary.cleaning_dropped == {"dedupe": 1, "dedupe_near": 3} and len(near.train) == 5
    texts = _texts(near.train)
    assert len(set(texts)) == 5 and [sum(A[:40] in t for t in texts), sum(B[:40] in t for t in texts)] == [1, 1]
    assert texts == [t for i, t in enumerate(_texts(off.train)) if i in (0, 1, 5, 7, 8)]  # the first copies, in order
    strict = prepare(data_cfg(path=path, clean=CleanConfig(dedupe="near", near_threshold=0.99)))
    assert strict.summary.cleaning_dropped == {"dedupe": 1, "dedupe_near": 2}  # one word changed is not a copy at 0.99
    assert lsh_shape(0.8) == (21, 6)


def test_near_dedupe_gives_the_same_store_for_any_number_of_processes(data_cfg, tmp_path, write_jsonl):
    pretokenised = [{"input_ids": [5, 6, 7, i], "labels": [-100, 6, 7, i]} for i in range(4)]  # no text: no part
    recs = pretokenised + [dict(r, id=i) for i in range(4) for r in RECORDS]  # ids: no record alike, texts repeat
    path = str(write_jsonl(tmp_path / "a.jsonl", recs))
    cfg = dict(path=path, eval_fraction=0.2, clean=CleanConfig(dedupe="near", collapse_whitespace=True))
    with pytest.MonkeyPatch.context() as m:  # the in-memory build, the reference
        in_memory(m)
        ref = prepare(data_cfg(cache_dir=str(tmp_path / "ref"), **cfg))
    for n in (1, 2):  # 10 chunks of 4 records: copies across chunks and processes
        got = prepare(data_cfg(cache_dir=str(tmp_path / f"n{n}"), num_proc=n, chunk_records=4, **cfg))
        assert _files(got.cache_dir) == _files(ref.cache_dir), n
    s = ref.summary
    assert s.cleaning_dropped == {"dedupe": 28, "dedupe_near": 3} and s.records_kept == 9 and s.eval_repeats_train == 0


def _mixture(tmp_path, first: list[dict], second: list[dict], dedupe) -> DataConfig:
    for name, recs in (("one", first), ("two", second)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    sources = [SourceConfig(path=str(tmp_path / f"{n}.jsonl")) for n in ("one", "two")]
    return DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), eval_fraction=0.0, clean=CleanConfig(dedupe=dedupe))


def test_a_later_source_repeating_an_earlier_one_is_dropped_and_counted(tmp_path):
    first = [RECORDS[0], RECORDS[1]]
    second = [RECORDS[5], RECORDS[2], RECORDS[3], RECORDS[8]]  # an exact and a near copy of the first source's
    exact = prepare(_mixture(tmp_path, first, second, "exact"))
    facts = {x["name"]: x for x in exact.summary.sources}
    assert facts["two"]["duplicates_of_earlier_sources"] == 1 and facts["two"]["documents"] == 3
    assert facts["one"]["duplicates_of_earlier_sources"] == 0 and facts["one"]["documents"] == 2
    assert exact.summary.cleaning_dropped == {"dedupe_cross_source": 1} and "dup of earlier" in str(exact.summary)
    near = prepare(_mixture(tmp_path, first, second, "near"))
    assert {x["name"]: x["duplicates_of_earlier_sources"] for x in near.summary.sources} == {"one": 0, "two": 2}
    assert len(near.train) == 4 and len(set(_texts(near.train))) == 4
    off = prepare(_mixture(tmp_path, first, second, False))
    assert len(off.train) == 6
    # the second source's entry depends on the first: another first source, another entry for the second
    again = prepare(_mixture(tmp_path, [RECORDS[1]], second, "exact"))
    assert again.summary.cleaning_dropped == {} and len(again.train) == 5
    with pytest.raises(DataError, match=r"two.jsonl: no usable training documents remain .* 2 dropped by cleaning"):
        prepare(_mixture(tmp_path, first, first, "exact"))  # a source that only repeats an earlier one


def test_held_out_records_that_repeat_training_records_are_counted(data_cfg, tmp_path, write_jsonl):
    recs = [_rec(f"Question {i % 10}?", f"Answer {i % 10}.", id=i) for i in range(40)]  # each text 4 times
    path = str(write_jsonl(tmp_path / "a.jsonl", recs))
    off = prepare(data_cfg(path=path, eval_fraction=0.3))
    train = set(_texts(off.train))
    leaked = sum(t in train for t in _texts(off.eval))
    assert leaked > 0 and off.summary.eval_repeats_train == leaked
    assert f"duplicate training records: {leaked} (warning" in str(off.summary)
    on = prepare(data_cfg(path=path, eval_fraction=0.3, clean=CleanConfig(dedupe="exact")))
    assert on.summary.eval_repeats_train == 0 and "duplicate training records: 0" in str(on.summary)
    assert not set(_texts(on.eval)) & set(_texts(on.train))
    evals = str(write_jsonl(tmp_path / "e.jsonl", recs[:2]))  # data.eval_path (the in-memory path)
    sep = prepare(data_cfg(path=path, eval_path=evals))
    assert sep.summary.eval_repeats_train == 2 and len(sep.train) == 40


def test_the_leakage_count_spans_a_mixtures_sources(tmp_path):
    """A held-out record of one source that another source trains on is counted (dedupe off), both ways
    round: a later source's training record repeating an earlier one's eval, a later eval an earlier train."""
    files = {"one": [RECORDS[0], RECORDS[1]], "one-eval": [RECORDS[5]], "two": [RECORDS[5], RECORDS[7]], "two-eval": [RECORDS[1]]}
    for name, recs in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    sources = [
        SourceConfig(path=str(tmp_path / f"{n}.jsonl"), eval_path=str(tmp_path / f"{n}-eval.jsonl")) for n in ("one", "two")
    ]

    def mixture(dedupe):
        return prepare(DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), clean=CleanConfig(dedupe=dedupe)))

    off = mixture(False)
    assert [x["eval_documents"] for x in off.summary.sources] == [1, 1] and len(off.train) == 4
    assert off.summary.eval_repeats_train == 2 and "duplicate training records: 2 (warning" in str(off.summary)
    on = mixture("exact")
    assert on.summary.eval_repeats_train == 0 and not set(_texts(on.eval)) & set(_texts(on.train))


def test_near_without_datasketch_is_one_line(data_cfg, tmp_path, write_jsonl, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasketch", None)  # import fails as when it is not installed
    path = str(write_jsonl(tmp_path / "a.jsonl", RECORDS))
    with pytest.raises(ConfigError, match=r"pip install 'densebatch\[dedupe\]'") as e:
        prepare(data_cfg(path=path, clean=CleanConfig(dedupe="near")))
    assert "\n" not in str(e.value)


def test_the_config_takes_modes_and_checks_the_threshold():
    from densebatch.config import load_config

    assert load_config(overrides=["--data.clean.dedupe=near"]).data.clean.dedupe == "near"
    assert load_config(overrides=["--data.clean.dedupe=off"]).data.clean.dedupe is False  # YAML reads off as false
    with pytest.raises(ConfigError, match="data.clean.dedupe: expected"):
        load_config(overrides=["--data.clean.dedupe=fuzzy"])
    with pytest.raises(ConfigError, match="near_threshold"):
        load_config(overrides=["--data.clean.near_threshold=0.2"])


def test_inspect_shows_records_before_and_after_cleaning(tmp_path, capsys):
    pytest.importorskip("ftfy")
    from densebatch.cli import main

    terms = tmp_path / "terms.txt"
    terms.write_text("JS -> JavaScript\n", encoding="utf-8")
    path = tmp_path / "a.jsonl"
    recs = [_rec("plain", "nothing to do"), _rec("Don\u00e2\u20ac\u2122t ship JS", "ok")]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    args = [f"--data.path={path}", f"--data.cache_dir={tmp_path / 'c'}", "--data.eval_fraction=0"]
    clean = ["--data.clean.fix_encoding=true", f"--data.clean.terms={terms}"]
    assert main(["inspect", "--num", "1", *args, *clean]) == 0
    out = capsys.readouterr().out
    assert f"--- {path}:2: changed by fix_encoding, terms ---" in out
    assert "instruction before: 'Don\u00e2\u20ac\u2122t ship JS'" in out
    assert "instruction after:  'Don\u2019t ship JavaScript'  (fix_encoding, terms)" in out
    assert ":1: changed" not in out and "output before" not in out  # unchanged values are not shown
    assert main(["inspect", "--num", "1", *args]) == 0
    assert "before:" not in capsys.readouterr().out  # no cleaning step: nothing to compare
    # a record that cleaning makes a copy of an earlier one says that dedupe then drops it
    recs.append(_rec("Don\u2019t ship JavaScript", "ok"))  # line 3: line 2's text once line 2 is repaired
    recs[1], recs[2] = recs[2], recs[1]  # the clean twin first
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    assert main(["inspect", "--num", "1", *args, *clean, "--data.clean.dedupe=exact"]) == 0
    assert f"--- {path}:3: changed by fix_encoding, terms; then dropped by dedupe: the same text as {path}:2 ---" in (
        capsys.readouterr().out
    )
    assert main(["inspect", "--num", "1", *args, *clean, "--data.clean.dedupe=off"]) == 0
    assert "then dropped" not in capsys.readouterr().out


def test_near_dedupe_is_the_greedy_rule_on_any_signatures():
    """Against the rule written plainly (every pair): a record is dropped when it shares a band with a kept
    earlier record (or an earlier source's) whose signature agrees on at least the threshold's share."""
    from densebatch.data.prepare.dedupe import NUM_PERM, Keys, band_hashes, dedupe

    rng = np.random.default_rng(0)
    b, r = lsh_shape(0.8)
    base = rng.integers(0, 2**32, (40, NUM_PERM), dtype=np.uint32)
    full = base[rng.integers(0, 40, 400)].copy()  # 400 records from 40 originals, each changed in 0-50 places
    for row in full:
        at = rng.choice(NUM_PERM, rng.integers(0, 50), replace=False)
        row[at] = rng.integers(0, 2**32, len(at), dtype=np.uint32)
    bands = np.stack([band_hashes(row, b, r) for row in full])
    sig = (full & 0xFFFF).astype(np.uint16)
    text = np.array([i.to_bytes(16, "little") for i in range(400)], "V16")  # no exact copies
    ones = np.ones(400, bool)

    def keys(lo, hi):
        return Keys(text[lo:hi], ones[lo:hi], ones[lo:hi], bands[lo:hi], lambda idx: sig[lo:hi][idx])

    keep, counts = dedupe(keys(100, 400), "near", 0.8, prior=keys(0, 100))
    need = int(np.ceil(0.8 * NUM_PERM))
    kept = list(range(100))  # the earlier source's records: all kept (they are its index)
    want, cross = [], 0
    for j in range(100, 400):
        copy = [i for i in kept if (bands[i] == bands[j]).any() and (sig[i] == sig[j]).sum() >= need]
        want.append(not copy)
        kept += [j] if not copy else []
        cross += bool(copy) and min(copy) < 100
    assert keep.tolist() == want and 50 < want.count(False) < 290
    assert counts == {"dedupe_near": want.count(False) - cross, "dedupe_cross_source": cross} and cross > 0


def test_ranks_share_out_a_near_deduped_mixture_and_rank_0_only_assembles(tmp_path, monkeypatch):
    """Under torchrun (``prepare_share``, 2 ranks in turn here) each source's chunks are made once, in the
    entry that rank 0 then assembles: the later source's key, which names the earlier one's, is the same."""
    import dataclasses

    import densebatch.data.prepare.stream as stream
    from densebatch.data.prepare.parts import prepare_share

    recs = [dict(r, id=i) for i in range(2) for r in RECORDS]
    second = [*recs[9:], _rec("Something new.", C[:200])]  # every record a copy of the first source's but one
    cfg = dataclasses.replace(_mixture(tmp_path, recs[:9], second, "near"), chunk_records=4, num_proc=1)
    one = prepare(dataclasses.replace(cfg, cache_dir=str(tmp_path / "one")))
    made, real = [], stream._prepare_chunk
    monkeypatch.setattr(stream, "_prepare_chunk", lambda c, **kw: made.append(kw["index"]) or real(c, **kw))
    assert sum(prepare_share(cfg, rank, 2) for rank in (1, 0)) == len(made) == 6  # 3 chunks a source
    made.clear()
    got = prepare(cfg)
    assert made == [] and _files(got.cache_dir) == _files(one.cache_dir)
    assert got.summary.cleaning_dropped == {"dedupe": 1, "dedupe_near": 3, "dedupe_cross_source": 9}
