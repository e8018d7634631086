"""train.source_balance: a mixture's sources weighted in the gradient as random padded batches weigh
them, exactly however a step is split into batches and ranks, measured on the data, never a change for
one source; reported losses stay plain means."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from densebatch.batch import IGNORE_INDEX
from densebatch.data.load.collate import CausalCollator
from densebatch.data.load.loader import StepLoader
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.source_balance import batch_balance
from densebatch.data.plan.store_epochs import select
from densebatch.data.store.store import DocumentStore

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import _FakeRanks  # noqa: E402


def _store(groups) -> DocumentStore:
    """Sources given as (documents, tokens each, loss tokens each): loss on each document's last tokens."""
    docs, source = [], []
    for s, (n, length, loss) in enumerate(groups):
        for i in range(n):
            mask = [0] * (length - loss) + [1] * loss
            docs.append(([1 + (i + j) % 50 for j in range(length)], mask))
            source.append(s)
    return DocumentStore.from_documents(docs, {"sources": [f"s{s}" for s in range(len(groups))]}, source)


def _random_plan_ratio(store, rows: int, epochs: int) -> np.ndarray:
    """What densebatch's own random batches of ``rows`` documents give each source: its mean share of a
    batch's loss tokens over its share of all loss tokens, over ``epochs`` planned epochs."""
    lengths = np.asarray(store.lengths, np.int64)
    loss = np.asarray(store.doc_loss_tokens, np.float64)
    src = store.sources_of(np.arange(len(store)))
    k = len(store.source_names)
    shares, per = [], np.zeros(k)
    settings = PlanSettings(strategy="random", rows_per_batch=rows)
    for epoch in range(epochs):
        for batch in plan_epoch(lengths, settings, seed=3, epoch=epoch).doc_lists():
            docs = np.array([d for row in batch for d in row])
            got = np.bincount(src[docs], weights=loss[docs], minlength=k)
            per += got
            if got.sum() > 0:
                shares.append(got / got.sum())
    return np.mean(shares, axis=0) / (per / per.sum())


def test_a_source_of_short_answers_weighs_as_in_random_batches():
    store = _store([(300, 12, 3), (100, 80, 60)])  # many short answers, a few long ones
    factors = batch_balance(store, weights=None, seed=0, rows=8)
    assert factors[0] > 1.5 and factors[1] < 1.0
    # what densebatch's random plan does, epoch after epoch (an independent measurement)
    assert factors == pytest.approx(_random_plan_ratio(store, 8, epochs=60), rel=0.03)
    natural = np.array([300 * 3, 100 * 60]) / (300 * 3 + 100 * 60)
    assert float(natural @ factors) == pytest.approx(1.0, abs=0.01)  # a loss token weighs 1 on average


def test_sources_alike_in_length_and_one_source_are_not_reweighted():
    alike = batch_balance(_store([(200, 30, 10), (200, 30, 10)]), weights=None, seed=0, rows=8)
    assert alike == pytest.approx([1.0, 1.0], abs=0.02)
    assert batch_balance(_store([(50, 30, 10)]), weights=None, seed=0, rows=8) is None


def test_the_factors_depend_on_the_seed_and_rows_only_and_follow_the_mixture_weights():
    store = _store([(300, 12, 3), (100, 80, 60)])
    assert (batch_balance(store, weights=None, seed=0, rows=8) == batch_balance(store, weights=None, seed=0, rows=8)).all()
    assert (
        batch_balance(store, weights=None, seed=0, rows=32)[0] < batch_balance(store, weights=None, seed=0, rows=8)[0]
    )  # larger batches vary less
    # up-weighting the short source makes it common in every batch: less to make up for
    weighted = batch_balance(store, weights=[10.0, 1.0], seed=0, rows=8)
    assert 1.0 < weighted[0] < batch_balance(store, weights=None, seed=0, rows=8)[0]


def test_the_loader_hands_over_the_selection_its_plan_drew():
    """A weighted mixture's epoch-0 documents are drawn once, by the loader's plan, and the factors read them."""
    store = _store([(300, 12, 3), (100, 80, 60)])
    settings = PlanSettings(strategy="packed", seq_len=128, max_tokens_per_batch=256)
    loader = StepLoader(store, settings=settings, collator=CausalCollator(pad_id=0), seed=5, weights=[3.0, 1.0], prefetch=0)
    drawn = select(store, weights=[3.0, 1.0], seed=5, epoch=0)
    handed = loader.selection(0)
    assert handed is not None and handed.num_docs == drawn.num_docs
    assert loader.plan(0).sharded.selection is handed and loader.selection(0) is handed  # drawn once, planned from
    assert np.array_equal(handed.docs(np.arange(handed.num_docs)), drawn.docs(np.arange(drawn.num_docs)))
    assert np.array_equal(
        batch_balance(store, weights=[3.0, 1.0], seed=5, rows=8, selection=handed),
        batch_balance(store, weights=[3.0, 1.0], seed=5, rows=8),
    )
    assert (
        StepLoader(store, settings=settings, collator=CausalCollator(pad_id=0), seed=5, prefetch=0).selection(0) is None
    )  # no weights


# --------------------------------------------------------------------------- the loss
def _with_sources(tiny, docs, sources):
    batch = tiny.collate(docs)
    ids = torch.tensor(sources).unsqueeze(1).expand_as(batch.labels).clone()
    ids[batch.labels == IGNORE_INDEX] = -1  # padding; a document's last position has no target either
    return dataclasses.replace(batch, source_ids=ids)


def test_weighted_steps_are_exact_across_batches_and_ranks(tiny, tmp_path):
    weights = [2.5, 0.5]
    docs = tiny.make_docs(9, seed=4, min_len=2, max_len=30)
    sources = [0, 1, 1, 0, 1, 0, 0, 1, 1]
    whole = [_with_sources(tiny, docs, sources)]
    split = [_with_sources(tiny, docs[:1], sources[:1]), _with_sources(tiny, docs[1:6], sources[1:6])]
    split.append(_with_sources(tiny, docs[6:], sources[6:]))

    one = tiny.trainer(tmp_path / "a", whole, source_weights=weights)
    s1 = one.forward_backward(whole)
    s1.read()
    g1 = tiny.flat_grad(one.model)
    # by hand: sum(w * CE) / sum(w) over the loss tokens
    model = tiny.TinyLM()
    losses = model.token_losses(whole[0])
    w = torch.tensor(weights)[whole[0].source_ids.clamp(min=0)] * (whole[0].labels != IGNORE_INDEX)
    ((losses * w).sum() / w.sum()).backward()
    assert ((g1 - tiny.flat_grad(model)).abs().max() / g1.abs().max()).item() <= 1e-6
    # the reported loss is the plain mean over loss tokens
    assert s1["loss"] == pytest.approx(float(losses.detach().sum() / whole[0].num_loss_tokens), rel=1e-6)

    many = tiny.trainer(tmp_path / "b", split, source_weights=weights)  # micro-batches of one step
    sk = many.forward_backward(split)
    sk.read()
    assert ((g1 - tiny.flat_grad(many.model)).abs().max() / g1.abs().max()).item() <= 1e-6
    assert sk["loss"] == pytest.approx(s1["loss"], rel=1e-6) and sk["loss_tokens"] == s1["loss_tokens"]

    a, b = split[:2], split[2:]  # two ranks, as DDP averages their gradients
    recorders = []
    for mine in (a, b):
        rec = _FakeRanks([])
        tiny.trainer(tmp_path / f"r{len(recorders)}", mine, dist=rec, source_weights=weights).forward_backward(mine)
        recorders.append(rec.seen)
    grads = []
    for mine, other in ((a, recorders[1]), (b, recorders[0])):
        t = tiny.trainer(tmp_path / "x", mine, dist=_FakeRanks(other), source_weights=weights)
        mine_stats = t.forward_backward(mine)
        mine_stats.read()
        assert mine_stats["loss"] == pytest.approx(s1["loss"], rel=1e-6)
        grads.append(tiny.flat_grad(t.model))
    assert (((grads[0] + grads[1]) / 2 - g1).abs().max() / g1.abs().max()).item() <= 1e-6


def test_equal_weights_are_the_plain_mean(tiny, tmp_path):
    docs = tiny.make_docs(6, seed=5, min_len=2, max_len=20)
    batch = [_with_sources(tiny, docs, [0, 1, 0, 1, 1, 0])]
    plain = tiny.trainer(tmp_path / "a", batch)
    plain.forward_backward(batch)
    same = tiny.trainer(tmp_path / "b", batch, source_weights=[0.7, 0.7])
    same.forward_backward(batch)
    assert torch.equal(tiny.flat_grad(plain.model), tiny.flat_grad(same.model))


@pytest.mark.parametrize("loss_head", ["fused", "plain"])
def test_a_model_that_weighs_its_own_losses_gives_the_trainers_weighted_step(tmp_path, loss_head):
    """The reference GPT weighs its losses itself (``weighs_losses``: its fused head weighs the gradient in
    the forward pass); the step equals the trainer weighing a model that does not, and the reported
    losses are the plain ones."""
    from densebatch.config import TrainConfig
    from densebatch.testing.batches import pack, random_docs
    from densebatch.testing.models import tiny_gpt
    from densebatch.train.loop import Trainer
    from densebatch.train.parts import Placement, Reporting, StepParts

    gen = torch.Generator().manual_seed(0)
    rows = [random_docs(gen, [5, 9, 3], 50), random_docs(gen, [12, 4], 50)]
    batch = pack(rows)
    src = torch.zeros_like(batch.labels)
    src[0, 5:14], src[1, :12] = 1, 1
    src[batch.positions.eq(0).cumsum(-1) > 3] = -1  # nothing is padding here; kept general
    batch = dataclasses.replace(batch, source_ids=src)
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, progress=False, device="cpu")
    out = {}
    for weighs in (True, False):
        model = tiny_gpt(50, loss_head=loss_head)
        model.weighs_losses = weighs
        t = Trainer(model, [batch], cfg, output_dir=tmp_path / str(weighs), placement=Placement("cpu"),
                    parts=StepParts(source_weights=[0.4, 1.9]), reporting=Reporting(console=False, source_names=["a", "b"]))  # fmt: skip
        stats = t.forward_backward([batch])
        stats.read()
        out[weighs] = (torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), stats)
    (g1, s1), (g0, s0) = out[True], out[False]
    assert ((g1 - g0).abs().max() / g0.abs().max()).item() <= 1e-5
    assert s1["loss"] == pytest.approx(s0["loss"], rel=1e-6)
    assert s1["loss_by_source"]["a"] == pytest.approx(s0["loss_by_source"]["a"], rel=1e-6)


def test_masked_lm_counts_every_token_and_a_run_saved_before_the_setting_resumes_with_tokens():
    # prompt-masked answers: the causal loss tokens are a quarter of the short source's tokens
    store = _store([(300, 12, 3), (100, 80, 60)])
    causal = batch_balance(store, weights=None, seed=0, rows=8)
    every_token = batch_balance(store, weights=None, seed=0, rows=8, counts=store.lengths)
    assert every_token[0] < causal[0]  # 12 of 92 tokens a pair, against 3 of 63 loss tokens

    from densebatch.config import RunConfig
    from densebatch.config.loading import config_from_dict, to_dict

    saved = to_dict(RunConfig())
    del saved["train"]["source_balance"]
    assert config_from_dict(saved, saved=True).train.source_balance == "tokens"  # what it computed
    assert config_from_dict(saved).train.source_balance == "batches"  # a new file: the default
    saved["train"]["source_balance"] = "batches"
    assert config_from_dict(saved, saved=True).train.source_balance == "batches"
