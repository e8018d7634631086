"""data.format megatron: corpora written by megatron-core's IndexedDatasetBuilder, read in place, token for token."""

from __future__ import annotations

import os
import signal

import fault_driver as fd
import numpy as np
import pytest
from support import documents_of, served_loss_tokens, split_of

from densebatch.cli import main
from densebatch.config import DataConfig
from densebatch.data.prepare.foreign import held_out
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.store.store_io import read_ranges
from densebatch.errors import DataError

indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason="megatron-core (the megatron extra) absent")
torch = pytest.importorskip("torch")

VOCAB = 256  # ids below the byte-level default tokenizer's vocabulary


def write_megatron(prefix, docs, dtype=np.uint16, sentences=False):
    """``docs`` (lists of ids) written by megatron-core's builder, one sequence a document or (``sentences``)
    each document cut into sequences of up to 5 tokens, as preprocess_data's sentence split writes them."""
    b = indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        if sentences:
            lens = [min(5, len(d) - i) for i in range(0, len(d), 5)] or [0]
            b.add_document(torch.tensor(d, dtype=torch.int64), lens)
        else:
            b.add_item(torch.tensor(d, dtype=torch.int64))
            b.end_document()
    b.finalize(f"{prefix}.idx")
    return prefix


def random_docs(n, seed=0, lo=2, hi=60, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(lo, hi)).tolist() for _ in range(n)]


def cfg_for(path, tmp_path, **kw) -> DataConfig:
    base = {"path": str(path), "format": "megatron", "tokenizer": "default", "cache_dir": str(tmp_path / "cache")}
    return DataConfig(**{**base, **kw})


def snapshot(folder):
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16])
def test_every_dtype_reads_the_writers_documents_token_for_token(tmp_path, dtype):
    vocab = 128 if dtype in (np.int8,) else VOCAB
    docs = random_docs(80, seed=int(np.dtype(dtype).itemsize), vocab=vocab)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_megatron(corpus / "part", docs, dtype=dtype)
    before = snapshot(corpus)
    p = prepare(cfg_for(corpus / "part", tmp_path, eval_fraction=0.1))
    train, held = split_of(docs, 0.1)
    assert documents_of(p.train) == train
    assert documents_of(p.eval) == held and held
    assert snapshot(corpus) == before  # nothing written beside the corpus
    assert p.train.tokens.dtype == dtype  # memory-mapped as written, not copied into another dtype


def test_sentence_split_documents_a_pattern_of_prefixes_and_the_loss_mask(tmp_path):
    a, b = random_docs(30, seed=1), random_docs(25, seed=2)
    write_megatron(tmp_path / "a", a, sentences=True)
    write_megatron(tmp_path / "b", b, dtype=np.int32)
    p = prepare(cfg_for(tmp_path / "*.idx", tmp_path, eval_fraction=0.0))
    assert documents_of(p.train) == a + b and p.eval is None
    assert p.summary.train_documents == 55 and p.summary.train_tokens == sum(map(len, a + b))
    starts, lengths = p.train.doc_spans(np.arange(len(p.train)))
    mask = read_ranges(p.train.loss_mask, starts, starts + lengths)
    want = np.concatenate([np.r_[0, np.ones(n - 1)] for n in lengths])
    assert (mask == want).all()  # every token a target but each document's first
    assert (np.asarray(p.train.doc_loss_tokens) == lengths - 1).all()
    again = prepare(cfg_for(tmp_path / "*.idx", tmp_path, eval_fraction=0.0))
    assert again.summary.cache_hit and documents_of(again.train) == a + b


def test_overlong_short_and_eval_path(tmp_path):
    docs = [[1], [2, 3], list(range(40)), list(range(10))]
    write_megatron(tmp_path / "train", docs)
    write_megatron(tmp_path / "held", [[5, 6, 7]])
    p = prepare(cfg_for(tmp_path / "train", tmp_path, eval_path=str(tmp_path / "held"), max_seq_len=16))
    assert documents_of(p.train) == [[2, 3], list(range(16)), list(range(10))]
    assert documents_of(p.eval) == [[5, 6, 7]]
    assert p.summary.truncated == 1 and p.summary.dropped_no_target == 1
    for store in (p.train, p.eval):  # each document's loss tokens are the targets the collator serves
        assert np.asarray(store.doc_loss_tokens).tolist() == served_loss_tokens(store).tolist()
    q = prepare(cfg_for(tmp_path / "train", tmp_path, eval_fraction=0, max_seq_len=16, overlong="drop"))
    assert documents_of(q.train) == [[2, 3], list(range(10))] and q.summary.dropped_overlong == 1


def test_eval_split_is_stable_when_documents_are_appended(tmp_path):
    docs = random_docs(200, seed=3)
    write_megatron(tmp_path / "c", docs[:150])
    first = documents_of(prepare(cfg_for(tmp_path / "c", tmp_path)).eval)
    write_megatron(tmp_path / "c", docs)
    later = documents_of(prepare(cfg_for(tmp_path / "c", tmp_path)).eval)
    assert later[: len(first)] == first and len(later) >= len(first)


def _message(tmp_path, capsys, cfg_path_args):
    assert main(["prepare", *cfg_path_args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _args(prefix, tmp_path, *extra):
    return [
        f"--data.path={prefix}",
        "--data.format=megatron",
        "--data.tokenizer=default",
        f"--data.cache_dir={tmp_path / 'cache'}",
        *extra,
    ]


def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys):
    docs = random_docs(20, seed=4)
    p = write_megatron(tmp_path / "cut", docs)
    with open(f"{p}.bin", "r+b") as f:
        f.truncate(os.path.getsize(f"{p}.bin") - 6)
    line = _message(tmp_path, capsys, _args(p, tmp_path))
    assert f"{p}.bin" in line and "cut short" in line

    p = write_megatron(tmp_path / "idx", docs)
    with open(f"{p}.idx", "r+b") as f:
        f.truncate(os.path.getsize(f"{p}.idx") - 8)
    line = _message(tmp_path, capsys, _args(p, tmp_path))
    assert f"{p}.idx" in line and "cut short" in line

    p = write_megatron(tmp_path / "ptr", docs)
    raw = bytearray(open(f"{p}.idx", "rb").read())
    raw[34 + 4 * 20 + 8 : 34 + 4 * 20 + 16] = (999).to_bytes(8, "little")  # the second sequence's pointer
    open(f"{p}.idx", "wb").write(bytes(raw))
    line = _message(tmp_path, capsys, _args(p, tmp_path))
    assert f"{p}.idx" in line and "pointers disagree" in line

    p = write_megatron(tmp_path / "float", [[0.5, 1.5]], dtype=np.float32)
    line = _message(tmp_path, capsys, _args(p, tmp_path))
    assert f"{p}.idx" in line and "float32" in line

    p = write_megatron(tmp_path / "big", [[1, 2, 300, 4]])
    line = _message(tmp_path, capsys, _args(p, tmp_path))
    assert f"{p}.bin" in line and "token id 300 at token 2" in line

    line = _message(tmp_path, capsys, _args(tmp_path / "absent", tmp_path))
    assert "absent.idx: missing" in line


def test_the_corpus_changed_after_the_entry_was_made_is_named(tmp_path):
    p = write_megatron(tmp_path / "x", random_docs(10, seed=5))
    cfg = cfg_for(p, tmp_path)
    prepare(cfg)
    os.remove(f"{p}.bin")
    with pytest.raises(DataError, match=r"x\.bin: missing"):
        prepare(cfg)


def _run_config(tmp_path, prefix, steps):
    cfg = fd.write_config(
        tmp_path / "run.yaml",
        tmp_path / "out",
        tmp_path / "cache",
        data={"path": str(prefix), "format": "megatron", "tokenizer": "default", "max_seq_len": 64},
        batching={"strategy": "packed", "max_tokens_per_batch": 256, "seq_len": 64, "rows_per_batch": 4},
        model={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 64},
        train={"max_steps": steps},
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    return cfg


def test_trains_20_steps_on_packed_rows_inspects_and_resumes_bit_identically_after_sigkill(tmp_path, capsys):
    rng = np.random.default_rng(6)  # readable documents (the default tokenizer's ids are bytes), each ending in its eos
    docs = [list(f"document {i}: {'ab ' * int(rng.integers(1, 28))}".encode()) + [256] for i in range(300)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    prefix = write_megatron(corpus / "web", docs)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref_cfg = _run_config(ref_dir, prefix, 20)
    assert fd.run_in_process(["train", str(ref_cfg)]) == 0
    ref = fd.train_losses(ref_dir / "out")
    assert len(ref) == 20 and all(np.isfinite(loss) for _, loss in ref)
    fills = [r["fill_rate"] for r in fd.metrics(ref_dir / "out") if r.get("kind") == "train" and "fill_rate" in r]
    assert fills and np.mean(fills) > 0.8  # packed rows, not one padded document a row

    capsys.readouterr()
    assert main(["inspect", str(ref_cfg), "--num", "2"]) == 0
    shown = capsys.readouterr().out
    train, _ = split_of(docs, 0.05)
    for i in (0, 1):
        assert f"--- document {i}: {len(train[i])} tokens, {len(train[i]) - 1} carry loss ---" in shown
        assert bytes(train[i][1:-1]).decode() in shown  # the writer's tokens, decoded (the first carries no loss)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = _run_config(run_dir, prefix, 20)
    r = fd.signal_at_step(["train", str(cfg)], run_dir / "out", 7, sig=signal.SIGKILL)
    assert r.returncode == -signal.SIGKILL
    capsys.readouterr()
    assert fd.run_in_process(["train", str(cfg), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out  # from the killed run's checkpoint, not from the start
    assert fd.train_losses(run_dir / "out") == ref  # bit-identical: every step's loss equal
    assert snapshot(corpus) == sorted(snapshot(corpus))  # still only the writer's files
    assert {n for n, _, _ in snapshot(corpus)} == {"web.bin", "web.idx"}


def test_two_ranks_under_torchrun_equal_one_process_with_doubled_accumulation(tmp_path):
    """Each rank reads only its rows of the megatron corpus; together they take the steps one process takes."""
    import subprocess

    from support import subprocess_env, torchrun

    prefix = write_megatron(tmp_path / "web", random_docs(200, seed=7, lo=3, hi=90))
    cfg = _run_config(tmp_path, prefix, 4)
    r = subprocess.run(
        torchrun(["train", str(cfg), f"--output_dir={tmp_path / 'ddp'}"]),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert fd.run_in_process(["train", str(cfg), f"--output_dir={tmp_path / 'one'}", "--train.grad_accum_batches=2"]) == 0
    two, one = fd.train_losses(tmp_path / "ddp"), fd.train_losses(tmp_path / "one")
    assert len(two) == 4 and [s for s, _ in two] == [s for s, _ in one]
    assert all(abs(a - b) <= 1e-5 * abs(b) for (_, a), (_, b) in zip(two, one))


def test_the_entry_is_the_same_built_block_by_block(tmp_path, monkeypatch):
    """Small blocks (documents and index sequences) give the entry one block gives, file after file."""
    from densebatch.data.prepare import foreign as entry
    from densebatch.data.store.formats import megatron

    docs = random_docs(90, seed=8, lo=1, hi=70) + [[7]] + random_docs(20, seed=9)
    write_megatron(tmp_path / "a", docs[:60], sentences=True)
    write_megatron(tmp_path / "b", docs[60:], dtype=np.int32)
    kw = {"eval_fraction": 0.2, "max_seq_len": 50}
    whole = prepare(cfg_for(tmp_path / "*.idx", tmp_path, **kw))
    monkeypatch.setattr(entry, "_BLOCK", 7)
    monkeypatch.setattr(megatron, "_BLOCK", 5)
    blocks = prepare(cfg_for(tmp_path / "*.idx", tmp_path / "again", **kw))
    assert not blocks.summary.cache_hit
    for split in ("train", "eval"):
        assert documents_of(getattr(blocks, split)) == documents_of(getattr(whole, split))
    assert (blocks.summary.truncated, blocks.summary.dropped_no_target) == (
        whole.summary.truncated,
        whole.summary.dropped_no_target,
    )
    assert blocks.summary.truncated and blocks.summary.dropped_no_target


def test_an_eval_split_left_empty_by_the_drops_is_no_eval_split(tmp_path):
    docs = [[1, 2, 3]] * 40 + [[5]] * 40  # the held-out documents of one token are dropped
    write_megatron(tmp_path / "c", docs)
    ev = held_out(len(docs), 0.02)
    assert ev.any() and not ev[:40].any()
    p = prepare(cfg_for(tmp_path / "c", tmp_path, eval_fraction=0.02))
    assert p.eval is None and len(p.train) == 40 and p.summary.dropped_no_target == 40
