"""data.format litdata: litdata.optimize's chunks (one tensor of ids an item), read in place, token for token."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from support import documents_of, served_loss_tokens

from densebatch.cli import main
from densebatch.config import DataConfig
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.store.store_io import read_ranges

litdata = pytest.importorskip("litdata", reason="litdata (the litdata extra) absent")
torch = pytest.importorskip("torch")


def documents(n=60, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(2, 40))).tolist() for _ in range(n)]


def write(folder, docs, dtype=torch.int64, numpy=False, chunk_bytes=400):
    """``docs`` through litdata's own writer (what optimize runs in each worker): several chunks."""
    from litdata.streaming.writer import BinaryWriter

    folder.mkdir(parents=True)
    w = BinaryWriter(str(folder), chunk_bytes=chunk_bytes)
    for i, d in enumerate(docs):
        t = torch.tensor(d, dtype=dtype)
        w[i] = t.numpy() if numpy else t
    w.done()
    w.merge()
    return folder


def cfg(path, tmp_path, **kw):
    return DataConfig(path=str(path), format="litdata", tokenizer="default", cache_dir=str(tmp_path / "cache"), **kw)


@pytest.mark.parametrize(
    "dtype,numpy", [(torch.int64, False), (torch.int32, False), (torch.int16, False), (torch.uint8, False), (torch.int64, True)]
)
def test_every_integer_dtype_token_for_token_across_chunks(tmp_path, dtype, numpy):
    docs = documents(seed=int(numpy) + 1)
    folder = write(tmp_path / "ds", docs, dtype, numpy)
    assert len(list(folder.glob("chunk-*.bin"))) > 1
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())
    p = prepare(cfg(folder, tmp_path, eval_fraction=0))
    assert documents_of(p.train) == docs  # 8-byte ids 4 bytes off alignment included
    starts, lengths = p.train.doc_spans(np.arange(len(p.train)))  # and their loss masks (starts out of order)
    assert read_ranges(p.train.loss_mask, starts, starts + lengths).tolist() == [x for n in lengths for x in [0] + [1] * (n - 1)]
    assert np.asarray(p.train.doc_loss_tokens).tolist() == served_loss_tokens(p.train).tolist()  # the counts are what is served
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) == before


def test_optimize_output_trains_and_splits_eval(tmp_path):
    docs = documents(80, seed=3)

    out = tmp_path / "optimized"
    litdata.optimize(fn=_doc, inputs=[(d,) for d in docs], output_dir=str(out), chunk_bytes="1KB", num_workers=1)
    p = prepare(cfg(out, tmp_path, eval_fraction=0.1))
    assert sorted(documents_of(p.train) + documents_of(p.eval)) == sorted(docs) and len(p.eval)
    run = tmp_path / "run"
    args = [
        "train",
        f"--data.path={out}",
        "--data.format=litdata",
        "--data.tokenizer=default",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    small = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64", "--batching.seq_len=64"]
    small += ["--batching.max_tokens_per_batch=256", "--train.max_steps=3", "--train.progress=false", "--train.plots=false"]
    assert main([*args, *small, f"--output_dir={run}"]) == 0
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "train"' in x]
    assert len(losses) == 3


def _doc(item):
    return torch.tensor(item[0], dtype=torch.int32)


def _line(capsys, path, tmp_path):
    args = ["prepare", f"--data.path={path}", "--data.format=litdata", "--data.tokenizer=default"]
    assert main([*args, f"--data.cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_datasets_are_one_line_naming_the_file(tmp_path, capsys):
    docs = documents(30, seed=4)
    a = write(tmp_path / "a", docs)
    chunk = sorted(a.glob("chunk-*.bin"))[1]
    os.remove(chunk)
    assert f"{chunk}: missing" in _line(capsys, a, tmp_path)

    b = write(tmp_path / "b", docs)
    chunk = sorted(b.glob("chunk-*.bin"))[0]
    with open(chunk, "r+b") as f:
        f.truncate(chunk.stat().st_size - 3)
    assert f"{chunk}:" in (line := _line(capsys, b, tmp_path)) and "cut short" in line

    c = write(tmp_path / "c", [[1.5, 2.5]], dtype=torch.float32)
    assert f"{c / 'index.json'}:" in (line := _line(capsys, c, tmp_path)) and "not integer token ids" in line

    from litdata.streaming.writer import BinaryWriter

    d = tmp_path / "d"
    d.mkdir()
    w = BinaryWriter(str(d), chunk_bytes=400, item_loader=litdata.TokensLoader())  # ids end to end: no boundaries
    for i, x in enumerate(docs[:5]):
        w[i] = torch.tensor(x, dtype=torch.int32)
    w.done()
    w.merge()
    assert "TokensLoader" in _line(capsys, d, tmp_path)

    e = write(tmp_path / "e", [[1, 2, 300]])
    assert "token id 300 at token 2" in _line(capsys, e, tmp_path)
