"""Mixtures end to end in the data layer: prepare lays sources end to end (cached per source), every
strategy's epoch gives each source its weight's share of tokens, collation tags every token with its source."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from densebatch.batch import IGNORE_INDEX
from densebatch.config import DataConfig, SourceConfig
from densebatch.data.load.collate import CausalCollator
from densebatch.data.plan.mixture import plan_source_stats
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.steps import rows_of
from densebatch.data.plan.store_epochs import epoch_selection, plan_store_epoch
from densebatch.data.plan.strategies import STRATEGIES
from densebatch.data.prepare import documents
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.source_configs import mixture_weights, source_configs
from densebatch.errors import DataError
from densebatch.run.data_commands import prepare_data

SETTINGS = PlanSettings(seq_len=256, max_tokens_per_batch=1024, rows_per_batch=4)


def _write_source(path, letter: str, lengths) -> str:
    """Raw-text records of the given character lengths (byte tokenizer: tokens = chars + end-of-text)."""
    path.write_text("".join(json.dumps({"text": letter * int(n)}) + "\n" for n in lengths), encoding="utf-8")
    return str(path)


@pytest.fixture
def two_equal_sources(tmp_path):
    lengths = np.random.default_rng(0).integers(8, 200, 300)
    return _write_source(tmp_path / "alpha.jsonl", "a", lengths), _write_source(tmp_path / "beta.jsonl", "b", lengths)


def _cfg(tmp_path, paths, weights=None, **kw) -> DataConfig:
    sources = [SourceConfig(path=p, weight=w) for p, w in zip(paths, weights or [None] * len(paths))]
    kw.setdefault("eval_fraction", 0.05)
    return DataConfig(sources=sources, template="raw", cache_dir=str(tmp_path / "cache"), **kw)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weights_3_and_1_give_75_and_25_percent_of_each_epochs_tokens(tmp_path, two_equal_sources, strategy):
    """The issue's check: two sources of equal size, weights 3 and 1, prepared and planned."""
    prepared = prepare(_cfg(tmp_path, two_equal_sources, (3, 1), eval_fraction=0.0))
    store = prepared.train
    assert prepared.weights == (3.0, 1.0) and store.source_names == ["alpha", "beta"]
    assert np.array_equal(store.lengths[store.source == 0], store.lengths[store.source == 1])  # equal sizes
    s = PlanSettings(**{**SETTINGS.__dict__, "strategy": strategy})
    natural = plan_epoch(np.asarray(store.lengths), settings=s, seed=0, epoch=0).stats()["fill_rate"]
    for epoch in (0, 1):
        plan = plan_store_epoch(store, settings=s, seed=0, epoch=epoch, weights=prepared.weights)
        shares = plan_source_stats(plan, epoch_selection(store, weights=prepared.weights, seed=0, epoch=epoch))
        assert abs(shares["alpha"]["share"] - 0.75) <= 0.02 and abs(shares["beta"]["share"] - 0.25) <= 0.02
        real, slots = plan.batch_stats()
        assert real.sum() == sum(x["tokens"] for x in shares.values())  # the shares count every planned token
        assert plan.stats()["fill_rate"] >= natural - 0.03  # the mixture keeps the strategy's fill rate
        assert slots.max() <= s.max_tokens_per_batch or strategy in ("random", "length_grouped")


def test_without_weights_an_epoch_is_plan_epoch_itself(tmp_path, two_equal_sources):
    prepared = prepare_data(_cfg(tmp_path, two_equal_sources))
    assert prepared.weights is None and epoch_selection(prepared.train, weights=None, seed=3, epoch=1) is None
    a = plan_store_epoch(prepared.train, settings=SETTINGS, seed=3, epoch=1)
    b = plan_epoch(np.asarray(prepared.train.lengths), settings=SETTINGS, seed=3, epoch=1)
    assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("doc", "start", "stop", "row_ptr", "batch_ptr"))
    shares = {x["name"]: x["share"] for x in prepared.summary.sources}
    tokens = np.bincount(prepared.train.source, weights=prepared.train.lengths)
    assert shares == pytest.approx({"alpha": tokens[0] / tokens.sum(), "beta": tokens[1] / tokens.sum()}, abs=1e-12)


def test_store_layout_eval_per_source_and_summary(tmp_path, two_equal_sources):
    prepared = prepare_data(_cfg(tmp_path, two_equal_sources, (3, 1)))
    for store in (prepared.train, prepared.eval):
        assert store.meta["sources"] == ["alpha", "beta"] and np.all(np.diff(store.source) >= 0)
        o = store.source_offsets()
        for s, letter in enumerate("ab"):  # each source's documents are its own text
            tokens, _ = store.document(int(o[s]))
            assert chr(int(tokens[0])) == letter and int(o[s + 1]) - int(o[s]) == int(np.sum(store.source == s))
    assert prepared.eval.source_offsets().tolist() == [0, 15, 30]  # 5% of each source's 300 records
    facts = {x["name"]: x for x in prepared.summary.sources}
    assert [facts[n]["records_read"] for n in ("alpha", "beta")] == [300, 300]
    assert sum(x["documents"] for x in facts.values()) == len(prepared.train) == prepared.summary.train_documents
    assert sum(x["tokens"] for x in facts.values()) == prepared.train.num_tokens
    assert facts["alpha"]["share"] == pytest.approx(0.75, abs=0.01)
    text = str(prepared.summary)
    assert "epoch share" in text and "alpha" in text and "beta" in text


def test_adding_a_source_tokenises_only_that_one_and_names_are_not_keys(tmp_path, two_equal_sources, monkeypatch):
    a, b = two_equal_sources
    c = _write_source(tmp_path / "gamma.jsonl", "c", [5, 6, 7, 8])
    built = []
    real = documents.Builder.documents
    monkeypatch.setattr(
        documents.Builder, "documents", lambda self, items, *x: built.append(self.cfg.path) or real(self, items, *x)
    )
    prepare(_cfg(tmp_path, [a, b]))
    assert built == [a, b]
    built.clear()
    prepared = prepare(_cfg(tmp_path, [a, b, c]))
    assert built == [c] and prepared.train.source_names == ["alpha", "beta", "gamma"]
    renamed = _cfg(tmp_path, [a, b, c])
    renamed.sources[2].name = "third"
    again = prepare(renamed)
    assert built == [c] and again.summary.cache_hit and again.train.source_names == ["alpha", "beta", "third"]
    assert [x["name"] for x in again.summary.sources] == ["alpha", "beta", "third"]
    assert again.summary.source == "alpha, beta, third"  # the summary's source line too, not the names it was built under


def test_a_source_inherits_unset_keys_and_overrides_the_rest(tmp_path, records, write_jsonl):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"conv": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    cfg = DataConfig(
        sources=[
            SourceConfig(path=str(write_jsonl(tmp_path / "inst.jsonl", records))),
            SourceConfig(path=str(chat), template="chatml"),
        ],
        eval_fraction=0.0,
        cache_dir=str(tmp_path / "cache"),
    )
    cfg.sources[1].fields = type(cfg.fields)(messages="conv")
    (name0, c0), (name1, c1) = source_configs(cfg)
    assert (name0, c0.template, c0.fields.messages) == ("inst", "alpaca", "messages")
    assert (name1, c1.template, c1.fields.messages) == ("chat", "chatml", "conv")
    prepared = prepare(cfg)
    assert prepared.train.source.tolist() == [0, 0, 0, 1] and mixture_weights(cfg) is None
    assert prepared.tokenizer.vocab_size == 261  # chatml in one source: its markers are single ids for all


def test_bpe_mixture_learns_one_vocabulary_from_every_source(tmp_path, two_equal_sources):
    prepared = prepare(_cfg(tmp_path, two_equal_sources, tokenizer="bpe:300"))
    tok = prepared.tokenizer
    assert tok.vocab_size == 300 and len(tok.encode("a" * 64)) < 64 and len(tok.encode("b" * 64)) < 64
    again = prepare(_cfg(tmp_path, two_equal_sources, tokenizer="bpe:300"))
    assert again.summary.cache_hit and again.tokenizer.fingerprint() == tok.fingerprint()


def test_collated_source_ids_give_exact_per_source_token_counts(tmp_path, two_equal_sources):
    prepared = prepare(_cfg(tmp_path, two_equal_sources, (3, 1)))
    store = prepared.train
    plan = plan_store_epoch(store, settings=SETTINGS, seed=0, epoch=0, weights=prepared.weights)
    collate = CausalCollator(store.pad_id)
    counts = np.zeros(2, np.int64)
    for b in range(plan.num_batches):
        rows = rows_of(plan, np.arange(plan.batch_ptr[b], plan.batch_ptr[b + 1]))
        batch = collate(store, rows)
        src = batch.source_ids  # (rows, T)
        assert src.shape == batch.labels.shape and src.dtype == torch.int64
        real = torch.arange(batch.seq_len)[None, :] < torch.tensor([[sum(c - a for _, a, c in r)] for r in rows])
        assert torch.equal(src >= 0, real)  # -1 exactly at padding
        letter = torch.where(src == 0, ord("a"), ord("b"))
        body = real & (batch.input_ids != store.eos_id)
        assert torch.equal(batch.input_ids[body], letter[body])  # every token carries its own document's source
        loss = batch.labels != IGNORE_INDEX
        counts += np.bincount(src[loss].numpy(), minlength=2)
    per_doc = np.add.reduceat(np.asarray(store.loss_mask, np.int64), store.offsets[:-1])
    expected = np.bincount(store.source[plan.doc].astype(np.int64), weights=per_doc[plan.doc], minlength=2)
    assert len(plan.split) == 0  # whole documents: every target of every planned document is in some batch
    assert counts.tolist() == expected.astype(np.int64).tolist()


def test_weights_must_match_the_stores_sources(tmp_path, two_equal_sources):
    prepared = prepare(_cfg(tmp_path, two_equal_sources))
    with pytest.raises(DataError, match="3 weights for prepared documents of 2 sources"):
        epoch_selection(prepared.train, weights=(1, 1, 1), seed=0, epoch=0)


def test_a_mixture_stores_each_source_once_and_reads_as_one_store(tmp_path, two_equal_sources):
    """The mixture's splits index their sources' shards (index.json) instead of copying them; read as one
    store they give every document, every batch and every token range (across a source boundary too) of
    a store holding the copies; a source entry removed is made again with the mixture, never misread."""
    import shutil

    from densebatch.data.load.collate import CausalCollator
    from densebatch.data.plan.planner import plan_epoch
    from densebatch.data.plan.steps import rows_of
    from densebatch.data.store.joined import read_index
    from densebatch.data.store.store import DocumentStore, read_ranges

    cfg = _cfg(tmp_path, two_equal_sources)
    prepared = prepare(cfg)
    mix = prepared.train
    assert sorted(p.name for p in mix.path.iterdir()) == ["COMPLETE", "index.json", "meta.json"]  # no tokens of its own
    shards = read_index(mix.path)
    assert [e["source"] for e in shards] == [0, 1]
    parts = [DocumentStore.open(e["dir"].parent) for e in shards]  # each source's own store
    docs = [st.document(i) for st in parts for i in range(len(st))]
    copy = DocumentStore.from_documents(docs, dict(mix.meta), source=np.repeat([0, 1], [len(st) for st in parts]))
    assert len(mix) == len(copy) and np.array_equal(mix.offsets, copy.offsets) and np.array_equal(mix.source, copy.source)
    assert all(np.array_equal(mix.document(i)[0], copy.document(i)[0]) for i in range(0, len(mix), 7))
    assert np.array_equal(mix.doc_loss_tokens, copy.doc_loss_tokens)
    edge = int(mix.offsets[len(parts[0])])  # the first token of the second source
    assert np.array_equal(
        read_ranges(mix.tokens, [edge - 5, 3], [edge + 5, 9]),
        np.concatenate([copy.tokens[edge - 5 : edge + 5], copy.tokens[3:9]]),
    )
    plan = plan_epoch(np.asarray(mix.lengths), settings=SETTINGS, seed=0, epoch=0)
    collate = CausalCollator(pad_id=0)
    for b in range(plan.num_batches):
        rows = rows_of(plan, np.arange(plan.batch_ptr[b], plan.batch_ptr[b + 1]))
        x, y = collate(mix, rows), collate(copy, rows)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
    assert not any(sources.is_file() for sources in mix.path.parent.parent.glob(f"{mix.path.parent.name}/*/shard-*/*"))
    shutil.rmtree(parts[0].path.parent)  # the first source's entry
    again = prepare(cfg)
    assert not again.summary.cache_hit and len(again.train) == len(mix)
    assert all(np.array_equal(again.train.document(i)[0], copy.document(i)[0]) for i in range(0, len(mix), 7))


def test_a_mixture_in_a_cache_dir_reached_through_a_link_reads_back(tmp_path, two_equal_sources):
    """The mixture's index points at its sources' shards by paths relative to it, computed on resolved paths
    on both sides: a cache_dir given through a symbolic link (macOS /tmp, scratch links) reads back."""
    real = tmp_path / "real" / "a" / "b"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    cfg = _cfg(tmp_path, two_equal_sources)
    cfg.cache_dir = str(tmp_path / "link" / "cache")
    first = prepare(cfg)
    again = prepare(cfg)
    assert again.summary.cache_hit and len(again.train) == len(first.train) > 0
