"""data.format datatrove: shards written by datatrove's DocumentTokenizer, read in place, token for token; the docs' path runs."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import fault_driver as fd
import numpy as np
import pytest

from densebatch.cli import main
from densebatch.config import DataConfig
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.tokenizers import load_tokenizer
from densebatch.data.store.store_io import read_ranges

pytest.importorskip("datatrove", reason="datatrove (the datatrove extra) absent")
pytest.importorskip("orjson", reason="orjson (datatrove's JSONL reader) absent")

DOCS = Path(__file__).resolve().parents[3] / "docs" / "data.md"


def _section() -> str:
    text = DOCS.read_text(encoding="utf-8")
    return text[text.index("### datatrove tokenised shards") :]


def docs_blocks() -> tuple[str, str]:
    """The python block of data.md's datatrove section, and its bash block that trains."""
    sec = _section()
    train = next(b for b in re.findall(r"```bash\n(.*?)```", sec, re.S) if b.startswith("densebatch train"))
    return re.search(r"```python\n(.*?)```", sec, re.S).group(1), train


@pytest.fixture(scope="module")
def written(tmp_path_factory, gpt2_dir):
    """A folder as the docs' user has it (corpus.jsonl, with records whose prompt carries no loss, and
    gpt2/tokenizer.json), after the docs' datatrove code ran in it: once, since fsspec keeps the folders
    datatrove opened by their relative names for the whole process."""
    d = tmp_path_factory.mktemp("datatrove-user")
    load_tokenizer(str(gpt2_dir)).save(d / "gpt2")
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog and runs far away".split()
    records = []
    for i in range(240):
        text = f"Record {i}: " + " ".join(rng.choice(words, int(rng.integers(3, 40))))
        rec = {"text": text, "id": str(i)}
        if i % 10 == 0:
            rec["metadata"] = {"no_loss_ranges": [[0, len(f"Record {i}:")]]}
        records.append(rec)
    (d / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    code, _ = docs_blocks()
    with pytest.MonkeyPatch.context() as m:
        m.chdir(d)
        exec(compile(code, str(DOCS), "exec"), {"__name__": "__main__"})  # as a script: its guarded work runs
    return d


@pytest.fixture
def workdir(written, monkeypatch):
    monkeypatch.chdir(written)
    return written


def test_the_writers_documents_and_loss_mask_token_for_token(workdir):
    out = workdir / "tokenized"
    shards = sorted(out.rglob("*.ds"))
    assert len(shards) == 2  # tasks=2: one shard each
    tok = load_tokenizer(str(workdir / "gpt2"))
    records = [json.loads(line) for line in (workdir / "corpus.jsonl").read_text().splitlines()]
    want = sorted(tuple(tok.encode(r["text"]) + [tok.eos_id]) for r in records)  # datatrove shuffles within a shard
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in out.iterdir())
    p = prepare(DataConfig(path="tokenized", format="datatrove", tokenizer="gpt2/tokenizer.json", eval_fraction=0.1))
    got = []
    for store in (p.train, p.eval):
        starts, lengths = store.doc_spans(np.arange(len(store)))
        for a, n in zip(starts, lengths):
            got.append(tuple(read_ranges(store.tokens, np.array([a]), np.array([a + n])).tolist()))
            mask = read_ranges(store.loss_mask, np.array([a]), np.array([a + n]))
            text = tok.decode(list(got[-1]))
            prompt = len(tok.encode(text.split(":")[0] + ":")) if text.startswith("Record ") else 0
            i = int(text.split()[1].rstrip(":"))
            expect_zero = prompt if i % 10 == 0 else 1  # no_loss_ranges covers "Record i:"; the first is never a target
            assert mask[:expect_zero].sum() == 0 and mask[expect_zero:].all(), (i, mask)
    assert sorted(got) == want  # every document, token for token, once
    assert len(p.eval) and sorted((q.name, q.stat().st_size, q.stat().st_mtime_ns) for q in out.iterdir()) == before


def test_the_docs_path_trains_20_steps_on_packed_rows(workdir, capsys):
    _, bash = docs_blocks()
    args = shlex.split(bash.strip())
    assert args[0] == "densebatch"
    assert main(args[1:]) == 0
    losses = fd.train_losses(workdir / "runs" / "datatrove")
    assert len(losses) == 20 and all(np.isfinite(v) for _, v in losses)
    assert not [f for f in os.listdir(workdir / "tokenized") if not re.search(r"\.ds(\.index|\.loss|\.metadata)?$", f)]


def _shard(tmp_path, docs, loss=None, width=2):
    folder = tmp_path / f"case{len(list(tmp_path.glob('case*')))}"
    folder.mkdir()
    ds = folder / "s.ds"
    np.concatenate([np.asarray(d, f"<u{width}") for d in docs]).tofile(ds)
    np.cumsum([len(d) for d in docs]).astype("<u8").tofile(f"{ds}.index")
    if loss is not None:
        np.concatenate(loss).astype(np.uint8).tofile(f"{ds}.loss")
    return ds


def _one_line(capsys, path, tmp_path, *extra):
    args = ["prepare", f"--data.path={path}", "--data.format=datatrove", "--data.tokenizer=default"]
    assert main([*args, f"--data.cache_dir={tmp_path / 'cache'}", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_shards_are_one_line_naming_the_file(tmp_path, capsys):
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ds = _shard(tmp_path, docs)
    with open(ds, "r+b") as f:
        f.truncate(ds.stat().st_size - 2)
    assert f"{ds}:" in (line := _one_line(capsys, ds, tmp_path)) and "cut short" in line
    ds = _shard(tmp_path, docs, loss=[[1] * 3, [1] * 2, [1] * 3])
    assert f"{ds}.loss" in (line := _one_line(capsys, ds, tmp_path)) and "one a token" in line
    ds = _shard(tmp_path, docs)
    os.remove(f"{ds}.index")
    assert f"{ds}.index: missing" in _one_line(capsys, ds, tmp_path)
    ds = _shard(tmp_path, [[1, 2, 400]])
    assert f"{ds}: token id 400 at token 2" in _one_line(capsys, ds, tmp_path)
    assert "matches no datatrove shard" in _one_line(capsys, tmp_path / "none*.ds", tmp_path)


def test_a_corpus_of_one_token_documents_is_refused_in_one_line(tmp_path, capsys):
    """What datatrove writes with a tokenizer that encodes no text: each document its end-of-text alone."""
    ds = _shard(tmp_path, [[0]] * 40)
    line = _one_line(capsys, ds, tmp_path)
    assert "each of its 40 documents is one token or none" in line and "encoded no text" in line, line
