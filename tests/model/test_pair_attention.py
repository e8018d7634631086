"""Pairs laid with their prompt once: every backend that keeps a rejected branch from its chosen one gives each
answer target the log-probability it has in its own sequence alone (prompt + answer, plain causal attention),
packed or padded, prompt once or twice (fp32, 1e-5); the plain causal kernel is never taken for them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.data.load.pair_collate import PairCollator, laid_lengths
from densebatch.data.store.pair_layout import pair_document, pair_spans
from densebatch.data.store.store import DocumentStore
from densebatch.model.attention import plan_attention
from densebatch.testing.batches import pack
from densebatch.testing.models import tiny_gpt
from densebatch.train.objectives.pair_logps import pair_logps

V = 50


def _pairs(seed: int, n: int, longest: int = 8):
    rng = np.random.default_rng(seed)
    raw = [tuple(rng.integers(3, V, int(k)) for k in rng.integers(1, longest, 3)) for _ in range(n)]
    docs = [pair_document(p, c, r, chosen_loss=np.ones(len(c)), rejected_loss=np.ones(len(r))) for p, c, r in raw]
    return raw, DocumentStore.from_documents(docs, meta={"eos_id": 0, "pad_id": 0, "pairs": True})


def _alone(model, raw) -> torch.Tensor:
    """(pairs, 2): each answer's summed log-probability in prompt + answer alone, one row, causal."""
    out = []
    for p, c, r in raw:
        row = []
        for a in (c, r):
            seq = np.concatenate([p, a]).tolist()
            losses = model.token_losses(pack([[seq]]))[0]
            row.append(-losses[len(p) - 1 : len(seq) - 1].sum().item())
        out.append(row)
    return torch.tensor(out)


def _layouts(store, shared: bool = True):
    """Rows of one pair each (padded) and of three (packed), each pair planned as laid (``laid_lengths``)."""
    prefixes = pair_spans(np.asarray(store.loss_mask), store.lengths)[:, 0]
    n, lengths = len(store), [int(x) for x in laid_lengths(store.lengths, prefixes, shared)]
    whole = lambda i: (i, 0, lengths[i])  # noqa: E731
    padded = [[whole(i)] for i in range(n)]
    packed = [[whole(i) for i in range(k, min(n, k + 3))] for k in range(0, n, 3)]
    return {"padded": padded, "packed": packed}


@pytest.mark.parametrize("attention", ["masked", "segmented", "flex"])
def test_each_answer_scores_as_in_its_sequence_alone_in_every_layout(attention):
    raw, store = _pairs(0, 7)
    model = tiny_gpt(V, attention=attention).eval()  # flex on CPU: forward only (no gradients here)
    with torch.no_grad():
        want = _alone(model, raw)
        for shared in (True, False):
            for name, rows in _layouts(store, shared).items():
                batch = PairCollator(0, shared=shared)(store, rows)
                got = pair_logps(model.token_losses(batch), batch).sums
                assert (got - want).abs().max() < 1e-5, (attention, shared, name)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6))
def test_the_rejected_branch_never_sees_the_chosen_one(seed, n):
    """Changing a chosen answer's tokens leaves every rejected target's loss as it was (segmented, with
    gradients: the path CPU training takes)."""
    raw, store = _pairs(seed, n)
    model = tiny_gpt(V, attention="segmented")
    rows = _layouts(store)["packed"]
    batch = PairCollator(0)(store, rows)
    other = batch.input_ids.clone()
    chosen = batch.pairs.branches == 1
    other[chosen] = (other[chosen] + 7) % (V - 3) + 3
    from dataclasses import replace

    a, b = model.token_losses(batch), model.token_losses(replace(batch, input_ids=other))
    rejected = (batch.pairs.answer >= 0) & (batch.pairs.answer % 2 == 1)
    assert torch.equal(a[rejected], b[rejected])


def test_pair_plans_never_take_the_plain_causal_kernel():
    _, store = _pairs(1, 3)
    batch = PairCollator(0)(store, _layouts(store)["padded"])  # one pair a row: still two branches
    for backend in ("segmented", "masked", "varlen"):
        plan = plan_attention(batch.positions, backend=backend, single_doc_rows=True, branches=batch.pairs.branches)
        assert plan.backend in ("segmented", "masked")  # varlen cannot draw the mask: the segmented path on CPU
    assert batch.single_doc_rows is False


@pytest.mark.parametrize("impl", ["densebatch", "sdpa"])
def test_a_hugging_face_model_keeps_the_branches_apart_too(tmp_path, impl):
    pytest.importorskip("transformers")
    from densebatch.model.hf.adapter import HFCausalLM
    from densebatch.testing.models import two_layer_config

    two_layer_config("llama", vocab_size=V).save_pretrained(tmp_path / "m")
    torch.manual_seed(0)
    model = HFCausalLM(tmp_path / "m", attn_implementation=impl).eval()
    raw, store = _pairs(2, 5)
    with torch.no_grad():
        want = _alone(model, raw)
        for shared in (True, False):
            batch = PairCollator(0, shared=shared)(store, _layouts(store, shared)["packed"])
            got = pair_logps(model.token_losses(batch), batch).sums
            assert (got - want).abs().max() < 1e-5, shared
