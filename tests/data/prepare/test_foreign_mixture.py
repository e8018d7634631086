"""Mixtures whose sources are corpora other engines wrote (megatron-core's builder, datatrove's writer), alone or
beside a source densebatch tokenises: the writers' documents token for token, weights, ranks, training, resume."""

from __future__ import annotations

import itertools
import json
import os

import fault_driver as fd
import numpy as np
import pytest
from support import documents_of, served_loss_tokens, split_of

from densebatch.cli import main
from densebatch.config import DataConfig, SourceConfig
from densebatch.data.load.collate import CausalCollator
from densebatch.data.load.loader import StepLoader
from densebatch.data.plan.mixture import plan_source_stats
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.steps import StepSettings
from densebatch.data.plan.store_epochs import epoch_selection, plan_store_epoch
from densebatch.data.plan.strategies import STRATEGIES
from densebatch.data.prepare.foreign_mixture import length_percentiles
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.summary import percentiles
from densebatch.data.store.store_io import read_ranges

indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason="megatron-core (the megatron extra) absent")
tokenized = pytest.importorskip("datatrove.pipeline.tokens.tokenizer", reason="datatrove (the datatrove extra) absent")
torch = pytest.importorskip("torch")

SETTINGS = PlanSettings(seq_len=64, max_tokens_per_batch=256, rows_per_batch=4)


def _docs(n: int, seed: int, lengths=None) -> list[list[int]]:
    """Documents of ids below the default tokenizer's 257 (``lengths``: each one's, else 2 to 59), each ending in its end-of-text."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 60, n) if lengths is None else lengths
    return [rng.integers(0, 256, int(k) - 1).tolist() + [256] for k in lengths]


def write_megatron(prefix, docs) -> str:
    b = indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for d in docs:
        b.add_item(torch.tensor(d, dtype=torch.int64))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def write_datatrove(folder, docs) -> str:
    """``docs`` in one shard written by datatrove's own ``TokenizedFile`` (what its DocumentTokenizer writes with)."""
    folder.mkdir()
    f = tokenized.TokenizedFile(str(folder), "00000_unshuffled.ds")
    for d in docs:
        f.write(d, None)
    f.close()
    return str(folder)


@pytest.fixture
def corpora(tmp_path):
    """A megatron corpus and a datatrove one of the same document lengths (150 each), and their documents."""
    lengths = np.random.default_rng(0).integers(2, 60, 150)
    web, code = _docs(150, 1, lengths), _docs(150, 2, lengths)
    return {"web": (write_megatron(tmp_path / "web", web), web), "code": (write_datatrove(tmp_path / "code", code), code)}


def _cfg(tmp_path, corpora, weights=(None, None), **kw) -> DataConfig:
    sources = [
        SourceConfig(path=corpora["web"][0], format="megatron", weight=weights[0]),
        SourceConfig(path=corpora["code"][0], format="datatrove", weight=weights[1]),
    ]
    kw = {"tokenizer": "default", "cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.1, **kw}
    return DataConfig(sources=sources, **kw)


def test_each_writers_documents_token_for_token_source_after_source_eval_per_source(tmp_path, corpora):
    p = prepare(_cfg(tmp_path, corpora))
    (web_train, web_eval), (code_train, code_eval) = split_of(corpora["web"][1], 0.1), split_of(corpora["code"][1], 0.1)
    assert web_eval and code_eval
    assert p.train.source_names == p.eval.source_names == p.source_names == ["web", "code"]
    assert documents_of(p.train) == web_train + code_train and documents_of(p.eval) == web_eval + code_eval
    for store, a, b in ((p.train, web_train, code_train), (p.eval, web_eval, code_eval)):
        assert store.source_offsets().tolist() == [0, len(a), len(a) + len(b)]
        assert store.sources_of(np.arange(len(store))).tolist() == [0] * len(a) + [1] * len(b)
        starts, lengths = store.doc_spans(np.arange(len(store)))
        mask = read_ranges(store.loss_mask, starts, starts + lengths)
        assert (mask == np.concatenate([np.r_[0, np.ones(n - 1)] for n in lengths])).all()  # the first is never a target
        assert (np.asarray(store.doc_loss_tokens) == lengths - 1).all()
        assert (np.asarray(store.doc_loss_tokens) == served_loss_tokens(store)).all()
        assert store.num_tokens == int(lengths.sum()) and store.max_length == int(lengths.max())
    facts = {x["name"]: x for x in p.summary.sources}
    assert [facts[n]["documents"] for n in ("web", "code")] == [len(web_train), len(code_train)]
    assert p.summary.train_documents == len(p.train) and p.summary.eval_documents == len(p.eval)
    assert p.summary.lengths == percentiles(np.asarray([len(d) for d in web_train + code_train]))
    assert "web" in str(p.summary) and "not checked" in str(p.summary)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weights_3_and_1_give_75_and_25_percent_of_each_epochs_tokens(tmp_path, corpora, strategy):
    prepared = prepare(_cfg(tmp_path, corpora, (3, 1), eval_fraction=0.0))
    store = prepared.train
    assert prepared.weights == (3.0, 1.0)
    s = PlanSettings(**{**SETTINGS.__dict__, "strategy": strategy})
    for epoch in (0, 1):
        plan = plan_store_epoch(store, settings=s, seed=0, epoch=epoch, weights=prepared.weights)
        shares = plan_source_stats(plan, epoch_selection(store, weights=prepared.weights, seed=0, epoch=epoch))
        assert abs(shares["web"]["share"] - 0.75) <= 0.02 and abs(shares["code"]["share"] - 0.25) <= 0.02
        assert plan.batch_stats()[0].sum() == sum(x["tokens"] for x in shares.values())


def test_renaming_or_reweighting_a_source_prepares_nothing_again(tmp_path, corpora):
    first = prepare(_cfg(tmp_path, corpora, (3, 1)))
    assert not first.summary.cache_hit and first.summary.parts == [2, 2]
    entries = sorted(os.listdir(tmp_path / "cache"))
    again = _cfg(tmp_path, corpora, (1, 5))
    again.sources[1].name = "code-v2"
    p = prepare(again)
    assert p.summary.cache_hit and p.summary.parts == [0, 2] and sorted(os.listdir(tmp_path / "cache")) == entries
    assert p.train.source_names == ["web", "code-v2"] and [x["name"] for x in p.summary.sources] == ["web", "code-v2"]
    assert p.weights == (1.0, 5.0) and documents_of(p.train) == documents_of(first.train)
    assert "web" not in p.summary.eval_source and "code" not in p.summary.eval_source  # nothing says the old names


def test_data_format_names_every_sources_format(tmp_path, corpora):
    other = write_megatron(tmp_path / "more", _docs(40, 3))
    cfg = DataConfig(
        sources=[SourceConfig(path=corpora["web"][0]), SourceConfig(path=other)],
        format="megatron",
        tokenizer="default",
        cache_dir=str(tmp_path / "cache"),
        eval_fraction=0.0,
    )
    p = prepare(cfg)
    assert documents_of(p.train) == corpora["web"][1] + _docs(40, 3) and p.train.source_names == ["web", "more"]


def test_a_source_densebatch_tokenises_mixes_with_a_foreign_one(tmp_path, corpora):
    """A JSONL source beside the megatron corpus: its documents are the ones it has alone, from the entry it has
    alone (adding the foreign source tokenises nothing again); the JSONL's held-out records are kept."""
    jsonl = tmp_path / "notes.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"note {i}: " + "ab" * (i % 17)}) + "\n" for i in range(60)))
    alone = prepare(DataConfig(path=str(jsonl), template="raw", tokenizer="default", cache_dir=str(tmp_path / "cache")))
    cfg = DataConfig(
        sources=[SourceConfig(path=str(jsonl), weight=1), SourceConfig(path=corpora["web"][0], format="megatron", weight=1)],
        template="raw",
        tokenizer="default",
        cache_dir=str(tmp_path / "cache"),
    )
    p = prepare(cfg)
    assert p.summary.parts == [1, 2]  # the megatron corpus scanned; the JSONL's entry from the cache
    web_train, web_eval = split_of(corpora["web"][1], 0.05)
    assert documents_of(p.train) == documents_of(alone.train) + web_train
    assert documents_of(p.eval) == documents_of(alone.eval) + web_eval
    assert p.train.sources_of(np.arange(len(p.train))).tolist() == [0] * len(alone.train) + [1] * len(web_train)
    assert p.eval_records == alone.eval_records  # read back from the mixture's entry (kept for the embedded dataset only)
    assert p.summary.eval_repeats_train == 0 and [x["name"] for x in p.summary.sources] == ["notes", "web"]
    assert "among the sources densebatch tokenised (the corpora of token ids as written: not checked)" in str(p.summary)


def test_ranks_share_the_steps_one_process_takes(tmp_path, corpora):
    """Two ranks' rows of each step (a weighted mixture, packed) are the rows one process with doubled accumulation takes."""
    p = prepare(_cfg(tmp_path, corpora, (3, 1), eval_fraction=0.0))

    def rows(rank, world, accum):
        steps = StepSettings(grad_accum_batches=accum, world_size=world, rank=rank)
        ld = StepLoader(
            p.train, settings=SETTINGS, collator=CausalCollator(pad_id=0), seed=1, steps=steps, prefetch=0, weights=p.weights
        )
        out = []
        for step in itertools.islice(ld, 4):
            out.append([])
            for b in step.batches:
                for r in range(b.input_ids.shape[0]):
                    real = b.source_ids[r] >= 0
                    ids, src, pos = (x[r][real].tolist() for x in (b.input_ids, b.source_ids, b.positions))
                    out[-1].append((tuple(ids), tuple(src), tuple(pos)))
        return out

    one = rows(0, 1, 2)
    two = [a + b for a, b in zip(rows(0, 2, 1), rows(1, 2, 1), strict=True)]
    assert len(one) == 4 and [sorted(x) for x in one] == [sorted(x) for x in two]
    written = [{tuple(d) for d in split_of(corpora[n][1], 0.0)[0]} for n in ("web", "code")]
    shared = 0
    for ids, src, pos in (row for step in one for row in step):  # packed rows: whole documents, each apart
        starts = [i for i, x in enumerate(pos) if x == 0] + [len(ids)]
        shared += len(starts) > 2
        for a, b in itertools.pairwise(starts):
            assert ids[a:b] in written[src[a]] and set(src[a:b]) == {src[a]} and pos[a:b] == tuple(range(b - a))
    assert shared > len(one)  # most rows hold several documents


def _args(tmp_path, sources, *extra):
    return [
        "prepare",
        f"--data.sources={json.dumps(sources)}",
        "--data.tokenizer=default",
        f"--data.cache_dir={tmp_path / 'c'}",
        *extra,
    ]


def _one_line(capsys, args) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_bad_input_in_one_source_is_one_line_naming_that_sources_file(tmp_path, corpora, capsys):
    web, code = corpora["web"][0], corpora["code"][0]
    sources = [{"path": web, "format": "megatron"}, {"path": code, "format": "datatrove"}]
    bad = write_datatrove(tmp_path / "bad", [[1, 2, 3], [4, 400, 5]])
    line = _one_line(capsys, _args(tmp_path, [sources[0], {"path": bad, "format": "datatrove"}]))
    assert f"{bad}/00000_unshuffled.ds: token id 400 at token 1 of document 1" in line
    with open(f"{web}.bin", "r+b") as f:
        f.truncate(os.path.getsize(f"{web}.bin") - 6)
    line = _one_line(capsys, _args(tmp_path, sources))
    assert f"{web}.bin" in line and "cut short" in line
    line = _one_line(capsys, _args(tmp_path, [sources[1], {"path": str(tmp_path / "absent"), "format": "megatron"}]))
    assert "absent.idx: missing" in line
    line = _one_line(capsys, _args(tmp_path, sources[1:], "--data.tokenizer=bpe:300"))
    assert "format datatrove holds token ids" in line and "bpe:300" in line


def test_length_percentiles_from_the_histogram_are_numpys(tmp_path, corpora):
    p = prepare(_cfg(tmp_path, corpora, eval_fraction=0.3))
    for store in (p.train, p.eval):
        want = percentiles(np.asarray(store.lengths))
        assert length_percentiles(store) == pytest.approx(want, abs=1e-9)


def _run_config(directory, corpora, steps):
    sources = [
        {"path": corpora["web"][0], "format": "megatron", "weight": 3},
        {"path": corpora["code"][0], "format": "datatrove", "weight": 1},
    ]
    return fd.write_config(
        directory / "run.yaml",
        directory / "out",
        directory / "cache",
        data={"sources": sources, "tokenizer": "default", "max_seq_len": 64, "eval_fraction": 0.1},
        batching={"strategy": "packed", "max_tokens_per_batch": 256, "seq_len": 64, "rows_per_batch": 4},
        model={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 64},
        train={"max_steps": steps},
        checkpoint={"every_steps": 2, "keep_last": 3},
    )


def test_trains_with_the_loss_of_each_source_and_resumes_bit_identically(tmp_path, corpora, capsys):
    """Six packed steps: every train record has each source's loss (their token-weighted mean is the loss), eval
    reports each source; resumed from the checkpoint of step 2 (mid-epoch), the steps after it are the same, bit for bit."""
    import shutil

    cfg = _run_config(tmp_path, corpora, 6)
    out = tmp_path / "out"
    assert fd.run_in_process(["train", str(cfg)]) == 0
    records = fd.metrics(out)
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 6
    for r in train:
        losses, shares = r["loss_by_source"], r["loss_tokens_share_by_source"]
        assert set(losses) == set(shares) == {"web", "code"}
        assert sum(losses[n] * shares[n] for n in losses if losses[n] is not None) == pytest.approx(r["loss"], rel=1e-6)
    ev = [r for r in records if r["kind"] == "eval"][-1]
    assert set(ev["loss_by_source"]) == {"web", "code"}
    ref = fd.train_losses(out)
    epoch = [r.get("epoch") for r in train]
    for step in (4, 6):
        shutil.rmtree(out / "checkpoints" / f"step-{step:06d}")
    capsys.readouterr()
    assert fd.run_in_process(["train", str(cfg), "--resume"]) == 0
    assert "(step 2)" in capsys.readouterr().out  # resumed from the checkpoint of step 2
    assert fd.train_losses(out) == ref
    assert 0 < epoch[1] < epoch[-1] < 1  # step 2 ends inside the first epoch: the resume starts mid-epoch


def _with_notes(tmp_path, corpora, **kw) -> DataConfig:
    jsonl = tmp_path / "notes.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"note {i}: " + "ab" * (i % 17)}) + "\n" for i in range(60)))
    sources = [SourceConfig(path=str(jsonl)), SourceConfig(path=corpora["web"][0], format="megatron")]
    return DataConfig(sources=sources, template="raw", tokenizer="default", cache_dir=str(tmp_path / "cache"), **kw)


def test_under_torchrun_ranks_tokenise_the_text_sources_chunks_and_leave_the_corpus_to_rank_0(tmp_path, corpora):
    from densebatch.data.prepare.parts import prepare_share

    cfg = _with_notes(tmp_path, corpora, chunk_records=16)
    assert sum(prepare_share(cfg, rank, 2) for rank in (1, 0)) == 4  # the 60 records' 16-record chunks, nothing else
    p = prepare(cfg)
    assert p.summary.parts == [2, 2] and len(p.train) == p.summary.train_documents


def test_inspect_with_cleaning_on_shows_the_text_sources_records(tmp_path, corpora, capsys):
    cfg = _with_notes(tmp_path, corpora)
    args = [f"--data.sources={json.dumps([{'path': s.path, 'format': s.format} for s in cfg.sources])}"]
    args += ["--data.template=raw", "--data.tokenizer=default", f"--data.cache_dir={cfg.cache_dir}", "--data.format=jsonl"]
    assert main(["inspect", *args, "--data.clean.collapse_whitespace=true", "--num", "1"]) == 0
    out = capsys.readouterr().out
    assert "--- document 0:" in out and "cleaning (collapse_whitespace)" in out
