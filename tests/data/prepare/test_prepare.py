"""prepare: formats, loss masks by position, bad records, overlong policy, eval split, cache."""

from __future__ import annotations

import csv
import json
import random
import shutil

import numpy as np
import pytest
from support import served_loss_tokens

from densebatch.config import CleanConfig
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.templates import alpaca_prompt
from densebatch.data.store.store import MARKER
from densebatch.errors import ConfigError, DataError


def _texts(prepared, store=None):
    store = store or prepared.train
    tok = prepared.tokenizer
    out = []
    for i in range(len(store)):
        t, m = store.document(i)
        out.append((tok.decode(t.tolist()), tok.decode(t[m.astype(bool)].tolist())))
    return out


def test_book_token_counts_with_gpt2(book_records, book_ids, gpt2_dir, data_cfg, tmp_path):
    """Every record (../shared/data), or the few tests/fixtures keeps, prepared with the GPT-2 BPE:
    the token count of each is the book's (the fixture's counts come from the full data and BPE)."""
    _, _, counts = book_ids
    assert len(counts) == 1100 and np.median(counts) == 55 and counts.max() == 91  # ../shared/data/README.md
    index = sorted(book_records)
    path = tmp_path / "book.json"
    path.write_text(json.dumps([book_records[i] for i in index]), encoding="utf-8")
    p = prepare(data_cfg(path=str(path), tokenizer=str(gpt2_dir)))
    lengths = np.asarray(p.train.lengths) - 1  # without the appended end-of-text
    assert lengths.tolist() == counts[index].tolist()
    assert int(np.argmax(counts)) in index  # the longest record is among them
    tokens, _ = p.train.document(0)
    assert tokens[-1] == 50256 and p.train.pad_id == 50256


def test_loss_mask_is_the_response_by_position(data_cfg, tmp_path, records, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", records)
    p = prepare(data_cfg(path=str(path)))
    for rec, (full, loss) in zip(records, _texts(p)):
        prompt = alpaca_prompt(rec["instruction"], rec["input"])
        assert full == prompt + rec["output"] + "<|endoftext|>"
        assert loss == rec["output"] + "<|endoftext|>"
    for i in range(len(p.train)):
        t, m = p.train.document(i)
        n_prompt = len(alpaca_prompt(records[i]["instruction"], records[i]["input"]).encode())
        assert m[:n_prompt].sum() == 0 and m[n_prompt:].all() and t[-1] == p.tokenizer.eos_id
    assert np.asarray(p.train.doc_loss_tokens).tolist() == served_loss_tokens(p.train).tolist()  # counts: what is served
    # loss_on=all: identical tokens, every token but the first carries loss.
    q = prepare(data_cfg(path=str(path), loss_on="all"))
    assert np.array_equal(np.asarray(q.train.tokens), np.asarray(p.train.tokens))
    for i in range(len(q.train)):
        _, m = q.train.document(i)
        assert m[0] == 0 and m[1:].all()


def test_text_holding_the_eos_string_is_masked_by_position(data_cfg, tmp_path, write_jsonl, gpt2_dir):
    rec = {"instruction": "Echo <|endoftext|> please", "input": "", "output": "ok<|endoftext|>ok"}
    p = prepare(data_cfg(path=str(write_jsonl(tmp_path / "a.jsonl", [rec])), tokenizer=str(gpt2_dir)))
    t, m = p.train.document(0)
    eos_positions = np.flatnonzero(t == 50256)
    assert len(eos_positions) == 3 and m[eos_positions].tolist() == [0, 1, 1]


def _malformed_jsonl(path, n_good=950):
    lines = [json.dumps({"instruction": f"task {i}", "input": "", "output": f"answer {i}"}) for i in range(n_good)]
    bad = (
        [b'{"instruction": "x", "output": '] * 10
        + [b'{"instruction": "x", "output": "\xff\xfe"}'] * 8
        + [json.dumps({"input": "", "output": "y"}).encode()] * 8
        + [json.dumps({"instruction": None, "output": "y"}).encode()] * 8
        + [json.dumps({"instruction": "", "output": "y"}).encode()] * 8
        + [json.dumps({"instruction": ["x"], "output": "y"}).encode()] * 4
        + [b"[1, 2, 3]"] * 4
    )
    rng = random.Random(0)
    all_lines = [x.encode() for x in lines]
    slots = sorted(rng.sample(range(1, len(all_lines) + len(bad)), len(bad)))
    for slot, b in zip(slots, bad):
        all_lines.insert(slot, b)
    path.write_bytes(b"\n".join(all_lines) + b"\n")
    first_bad = min(slots) + 1
    return path, first_bad


def test_malformed_records_error_mode_names_the_first_bad_line(data_cfg, tmp_path):
    path, first_bad = _malformed_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=rf"bad\.jsonl:{first_bad}: ") as e:
        prepare(data_cfg(path=str(path)))
    assert "on_bad_record" in str(e.value)
    assert not list((tmp_path / "cache").glob("*/" + MARKER)), "no cache is left behind"


def test_malformed_records_skip_mode_counts_by_reason(data_cfg, tmp_path):
    path, first_bad = _malformed_jsonl(tmp_path / "bad.jsonl")
    p = prepare(data_cfg(path=str(path), on_bad_record="skip", eval_fraction=0.1))
    s = p.summary
    assert s.records_read == 1000 and s.records_skipped == 50 and s.records_kept == 950
    assert s.skipped == {
        "invalid_json": 10,
        "undecodable_bytes": 8,
        "missing_field": 8,
        "null_field": 8,
        "empty_field": 8,
        "wrong_type": 8,
    }
    assert s.skip_examples["invalid_json"].startswith(str(path) + ":")
    assert "skipped" in str(s) and json.dumps(s.as_dict())


def _write_formats(tmp_path, records):
    (tmp_path / "a.json").write_text(json.dumps(records))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(records[0]))
        w.writeheader()
        w.writerows(records)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    import datasets

    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "hf"))
    return ["a.json", "a.jsonl", "a.csv", "a.parquet", "hf"]


def test_every_format_gives_the_same_documents(data_cfg, tmp_path, records):
    pytest.importorskip("datasets")
    names = _write_formats(tmp_path, records)
    results = [np.asarray(prepare(data_cfg(path=str(tmp_path / n))).train.tokens).tolist() for n in names]
    assert all(r == results[0] for r in results)


def test_text_formats(data_cfg, tmp_path):
    (tmp_path / "a.txt").write_text("para one\nstill one\n\n\npara two\n")
    p = prepare(data_cfg(path=str(tmp_path / "a.txt"), loss_on="all"))
    assert [full for full, _ in _texts(p)] == ["para one\nstill one<|endoftext|>", "para two<|endoftext|>"]
    text = "abcdefghij" * 5
    (tmp_path / "b.txt").write_text(text)
    p = prepare(data_cfg(path=str(tmp_path / "b.txt"), text_split="chunks", chunk_tokens=16, loss_on="all"))
    assert p.train.lengths.tolist() == [16, 16, 16, 3]
    assert "".join(full for full, _ in _texts(p)) == text + "<|endoftext|>"
    (tmp_path / "c.txt").write_bytes(b"fine\nstill fine\nbad \xff here\n")
    with pytest.raises(DataError, match=r"c\.txt:3: undecodable"):
        prepare(data_cfg(path=str(tmp_path / "c.txt"), text_split="chunks"))


def test_pretokenized_records(data_cfg, tmp_path, write_jsonl):
    recs = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8, 9, 256]},
        {"input_ids": [1, 2], "labels": [-100, 3]},
        {"input_ids": "nope"},
    ]
    p = prepare(data_cfg(path=str(write_jsonl(tmp_path / "a.jsonl", recs)), on_bad_record="skip"))
    assert [p.train.document(i)[0].tolist() for i in range(2)] == [[5, 6, 7, 256], [8, 9, 256]]
    assert [p.train.document(i)[1].tolist() for i in range(2)] == [[0, 1, 1, 1], [0, 1, 1]]
    assert p.summary.skipped == {"bad_labels": 1, "wrong_type": 1}


def test_overlong_truncate_and_drop_are_counted(data_cfg, tmp_path, write_jsonl):
    recs = [
        {"instruction": "a", "input": "", "output": "b"},
        {"instruction": "a", "input": "x" * 300, "output": "b"},
        {"instruction": "a" * 50, "input": "", "output": "b" * 300},
    ]
    path = write_jsonl(tmp_path / "a.jsonl", recs)
    p = prepare(data_cfg(path=str(path), max_seq_len=200))
    # record 1: its response is cut away -> dropped (no target); record 2: truncated inside the response.
    assert (p.summary.truncated, p.summary.dropped_no_target, len(p.train)) == (1, 1, 2)
    assert p.train.lengths.max() == 200
    q = prepare(data_cfg(path=str(path), max_seq_len=200, overlong="drop"))
    assert (q.summary.dropped_overlong, len(q.train)) == (2, 1)


def test_cleaning_through_prepare(data_cfg, tmp_path, write_jsonl):
    recs = [
        {"instruction": "<b>Say</b>  hi", "input": "", "output": "hi"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "x", "input": "", "output": "<br>"},
    ]
    clean = CleanConfig(strip_html=True, collapse_whitespace=True, dedupe=True)
    p = prepare(data_cfg(path=str(write_jsonl(tmp_path / "a.jsonl", recs)), clean=clean))
    assert len(p.train) == 1
    assert p.summary.cleaning_changed == {"strip_html": 2, "collapse_whitespace": 2}  # "<br>" -> "\n\n" -> ""
    assert p.summary.cleaning_dropped == {"dedupe": 1, "emptied": 1}


def test_encoding_repair_and_term_dictionary_through_prepare(data_cfg, tmp_path, write_jsonl):
    """The issue's check, on crafted records: mojibake repaired (fix_encoding, ftfy), dictionary terms
    standardised as whole words only, each counted per record; the repaired copy of a record then dedupes
    against its clean twin; a changed dictionary is another cache entry; a bad line is one line."""
    pytest.importorskip("ftfy")
    from densebatch.data.prepare.tokenizers import load_tokenizer

    terms = tmp_path / "terms.txt"
    terms.write_text("# standard names\nJS -> JavaScript\nk8s → Kubernetes\n", encoding="utf-8")
    recs = [
        {"instruction": "Donâ€™t deploy JS to k8s", "input": "", "output": "cafÃ© JSON"},
        {"instruction": "Don’t deploy JavaScript to Kubernetes", "input": "", "output": "café JSON"},
        {"instruction": "plain", "input": "", "output": "MJS stays"},
    ]
    clean = CleanConfig(fix_encoding=True, terms=str(terms), dedupe=True)
    p = prepare(data_cfg(path=str(write_jsonl(tmp_path / "a.jsonl", recs)), clean=clean))
    assert p.summary.cleaning_changed == {"fix_encoding": 1, "terms": 1}
    assert p.summary.cleaning_dropped == {"dedupe": 1} and len(p.train) == 2
    tok = load_tokenizer("default")
    texts = [tok.decode([int(t) for t in p.train.document(i)[0]]) for i in range(len(p.train))]
    assert "Don’t deploy JavaScript to Kubernetes" in texts[0] and "café JSON" in texts[0] and "MJS stays" in texts[1]
    terms.write_text("JS -> ECMAScript\n", encoding="utf-8")
    again = prepare(data_cfg(path=str(tmp_path / "a.jsonl"), clean=clean))
    assert not again.summary.cache_hit
    terms.write_text("JS ECMAScript\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"terms.txt:1: expected 'from -> to'") as e:
        prepare(data_cfg(path=str(tmp_path / "a.jsonl"), clean=clean))
    assert "\n" not in str(e.value)


def test_eval_split_is_deterministic_disjoint_and_order_free(data_cfg, tmp_path, write_jsonl):
    recs = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(200)]
    p = prepare(data_cfg(path=str(write_jsonl(tmp_path / "a.jsonl", recs)), eval_fraction=0.1))
    assert (len(p.train), len(p.eval)) == (180, 20) and p.eval_records == []  # records: the embedded dataset's only
    train_texts = {full for full, _ in _texts(p)}
    eval_texts = {full for full, _ in _texts(p, p.eval)}
    assert not train_texts & eval_texts
    shuffled = recs[::-1]
    q = prepare(data_cfg(path=str(write_jsonl(tmp_path / "b.jsonl", shuffled)), eval_fraction=0.1))
    assert {full for full, _ in _texts(q, q.eval)} == eval_texts
    write_jsonl(tmp_path / "c.jsonl", recs[:20])
    e = prepare(data_cfg(path=str(tmp_path / "a.jsonl"), eval_path=str(tmp_path / "c.jsonl"), clean=CleanConfig(dedupe=True)))
    assert (len(e.train), len(e.eval)) == (180, 20) and "eval_path" in e.summary.eval_source
    assert e.summary.cleaning_dropped == {"dedupe": 20}  # train records repeating eval ones are dropped


def test_cache_hit_rebuild_and_untrusted_half_written_dir(data_cfg, tmp_path, records, write_jsonl, monkeypatch):
    import os

    import densebatch.data.prepare.cache as cache
    import densebatch.data.prepare.pipeline as pipeline
    from densebatch.data.prepare.documents import Builder

    path = write_jsonl(tmp_path / "a.jsonl", records)

    def cfg(**kw):
        return data_cfg(path=str(path), eval_fraction=0.1, **kw)

    first = prepare(cfg())
    assert not first.summary.cache_hit
    with monkeypatch.context() as m:  # a hit reads no input byte (no hash, no parse) and no held-out record
        m.setattr(cache, "_file_digest", lambda p: pytest.fail("a cache hit hashed the input"))
        m.setattr(Builder, "read", lambda *a: pytest.fail("a cache hit read the input"))
        m.setattr(pipeline, "read_eval_records", lambda p: pytest.fail("a cache hit read the held-out records"))
        again = prepare(cfg())
    assert again.summary.cache_hit and again.cache_dir == first.cache_dir and "cache hit" in str(again.summary)
    assert again.eval_records == first.eval_records  # read when asked for
    changed = prepare(cfg(max_seq_len=512))
    assert not changed.summary.cache_hit and changed.cache_dir != first.cache_dir
    # The same bytes, a new modification time: identity says new (prepared again), the content hash says the same.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert prepare(cfg()).cache_dir != first.cache_dir
    hashed = prepare(cfg(verify_inputs="hash"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prepare(cfg()).cache_dir == first.cache_dir  # the identity it was prepared with
    assert prepare(cfg(verify_inputs="hash")).cache_dir == hashed.cache_dir != first.cache_dir
    # The same size and modification time but other bytes: only the content hash notices.
    path.write_text(path.read_text().replace("hi", "yo"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prepare(cfg()).cache_dir == first.cache_dir
    assert prepare(cfg(verify_inputs="hash")).cache_dir != hashed.cache_dir
    # A directory left without its marker (a crash) is rebuilt, not trusted.
    path.write_text(path.read_text().replace("yo", "hi"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    (first.cache_dir / MARKER).unlink()
    shutil.rmtree(first.cache_dir / "eval", ignore_errors=True)
    rebuilt = prepare(cfg())
    assert not rebuilt.summary.cache_hit and (first.cache_dir / MARKER).is_file()


def test_missing_and_empty_inputs(data_cfg, tmp_path):
    with pytest.raises(DataError, match="not found"):
        prepare(data_cfg(path=str(tmp_path / "missing.jsonl")))
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        prepare(data_cfg(path=str(tmp_path / "e.jsonl"), on_bad_record="skip"))
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(DataError, match="no usable"):
        prepare(data_cfg(path=str(tmp_path / "bad.jsonl"), on_bad_record="skip"))


def test_pretokenized_ids_outside_the_tokenizer_name_data_tokenizer(data_cfg, tmp_path, write_jsonl):
    """GPT-2 ids read with the byte-level default (259 ids): say which tokenizer, and what to set."""
    path = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [464, 3290, 50256]}, {"input_ids": [5, 6]}])
    with pytest.raises(DataError, match=r"a\.jsonl:1: .*id 464, outside the 259 ids of data\.tokenizer 'default'") as e:
        prepare(data_cfg(path=str(path)))
    assert "set data.tokenizer" in str(e.value) and "on_bad_record" not in str(e.value)
    skipped = prepare(data_cfg(path=str(path), on_bad_record="skip"))  # skipping stays possible, and counted
    assert skipped.summary.skipped == {"bad_token_ids": 1} and len(skipped.train) == 1


@pytest.mark.parametrize("mixed", [False, True])
def test_learned_bpe_with_pretokenized_records_says_what_to_set(data_cfg, tmp_path, write_jsonl, mixed):
    """bpe:N learns a tokenizer from text; ids already made by another tokenizer cannot use it."""
    recs = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}] + ([{"text": "plain words " * 20}] if mixed else [])
    path = write_jsonl(tmp_path / "a.jsonl", recs)
    expected = "2 of 3 records are" if mixed else "every record is"
    with pytest.raises(DataError, match=rf"data\.tokenizer bpe:400 .*{expected} pre-tokenised.*a\.jsonl:1.*set data\.tokenizer"):
        prepare(data_cfg(path=str(path), tokenizer="bpe:400", template="raw"))


@pytest.mark.parametrize("damage", ["meta_keys", "summary", "array", "cut", "junk_meta", "gone", "eval_cut"])
def test_damaged_cache_entry_is_a_one_line_error_naming_the_directory(data_cfg, tmp_path, records, write_jsonl, damage):
    """A complete entry that does not read back (its marker's sizes still match), or whose store's files no longer
    match their recorded sizes (cut, rewritten, deleted): say which directory to delete. Before, the second kind
    was taken for an absent entry, rebuilt beside the one that stayed, and failed an assertion every time."""
    path = write_jsonl(tmp_path / "a.jsonl", records)
    cfg = lambda: data_cfg(path=str(path), eval_fraction=0.3)  # noqa: E731  (an eval split to damage too)
    entry = prepare(cfg()).cache_dir
    if damage == "meta_keys":  # same size: the marker still trusts it; eos/pad/vocab are gone
        meta = entry / "train" / "meta.json"
        text = meta.read_text()
        meta.write_text(text.replace('"eos_id"', '"eos_ix"').replace('"vocab_size"', '"vocab_sizz"'))
    elif damage == "summary":
        f = entry / "summary.json"
        f.write_text("x" * len(f.read_text()))
    elif damage == "array":
        f = entry / "train" / "shard-000000" / "tokens.npy"
        f.write_bytes(b"\0" * f.stat().st_size)
    elif damage in ("cut", "eval_cut"):
        f = entry / ("train" if damage == "cut" else "eval") / "shard-000000" / "tokens.npy"
        f.write_bytes(f.read_bytes()[:10])
    elif damage == "junk_meta":
        (entry / "train" / "meta.json").write_text("junk")
    else:
        (entry / "train" / "shard-000000" / "lengths.npy").unlink()
    with pytest.raises(DataError, match="delete that directory") as e:
        prepare(cfg())
    assert str(entry) in str(e.value) and "\n" not in str(e.value)
    shutil.rmtree(entry)  # what the message says to do
    again = prepare(cfg())
    assert len(again.train) + len(again.eval) == len(records)


def test_densebatch_prepare_never_imports_torch(data_cfg, tmp_path, records, write_jsonl):
    """``densebatch prepare`` needs the data layer only: a cache hit of any input size costs what reading
    the entry costs (half a second on a 1 GB input, docs/data.md), not torch's seconds of import."""
    import subprocess
    import sys

    from support import subprocess_env

    path = write_jsonl(tmp_path / "a.jsonl", records)
    code = (
        "import sys; from densebatch.cli import main\n"
        f"args = ['prepare', '--data.path={path}', '--data.cache_dir={tmp_path / 'cache'}']\n"
        "assert main(args) == 0 and main(args) == 0\n"
        "assert 'torch' not in sys.modules, 'prepare imported torch'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "built:" in r.stdout and "cache hit:" in r.stdout


@pytest.mark.parametrize("tokenizer", ["default", "bpe:300"])
def test_a_lone_surrogate_in_a_json_string_prepares_as_u_fffd(data_cfg, tmp_path, tokenizer):
    """A JSON string may spell a lone surrogate (``\\ud800``), which UTF-8 cannot hold: the document gets
    U+FFFD in its place, no traceback (an undecodable byte read as \\udc80-\\udcff still maps back to it)."""
    path = tmp_path / "s.jsonl"
    rows = [{"instruction": f"say {i}", "input": "", "output": f"fine {i}"} for i in range(30)]
    rows[3]["output"] = "bad \ud800 char"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")  # json escapes it: \\ud800
    p = prepare(data_cfg(path=str(path), tokenizer=tokenizer))
    texts = [p.tokenizer.decode(p.train.tokens[a:b].tolist()) for a, b in zip(p.train.offsets[:-1], p.train.offsets[1:])]
    assert any("bad \ufffd char" in t for t in texts)
