"""Label smoothing (train.label_smoothing): torch's definition, in the fused and plain heads, exact under any
batching (per token), training passes only (evaluation reports the plain cross-entropy)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.batch import IGNORE_INDEX
from densebatch.model import GPT, GPTConfig
from densebatch.model.loss_head import head_token_losses, plain_head_token_losses
from densebatch.testing.batches import pack, random_docs

V = 61


@settings(max_examples=20, deadline=None, derandomize=True)
@given(rows=st.integers(1, 3), T=st.integers(1, 15), chunk=st.integers(1, 30), eps=st.sampled_from([0.05, 0.1, 0.5]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_fused_smoothed_loss_and_gradients_match_torch(rows, T, chunk, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, T, 8, generator=gen, requires_grad=True)
    head = torch.nn.Linear(8, V, bias=True)
    labels = torch.randint(0, V, (rows, T), generator=gen)
    labels[torch.rand(rows, T, generator=gen) < 0.3] = IGNORE_INDEX
    keep = labels != IGNORE_INDEX
    if not keep.any():
        return
    # the reference: torch's own label smoothing on the full logits
    ref = torch.zeros(rows, T)
    ref[keep] = torch.nn.functional.cross_entropy(head(h[keep]), labels[keep], reduction="none", label_smoothing=eps)
    ref.sum().backward()
    ref_grads = [t.grad.clone() for t in (h, head.weight, head.bias)]
    for t in (h, head.weight, head.bias):
        t.grad = None
    got = head_token_losses(h, labels, head.weight, head.bias, int(keep.sum()), chunk_tokens=chunk, label_smoothing=eps)
    got.sum().backward()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip((h.grad, head.weight.grad, head.bias.grad), ref_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    plain = plain_head_token_losses(h.detach(), labels, head, eps)
    assert torch.allclose(plain, ref.detach(), rtol=1e-6, atol=1e-7)


def test_smoothing_is_exact_under_batching_and_off_in_evaluation(gen):
    config = GPTConfig(vocab_size=V, n_layer=1, n_head=2, n_embd=16, block_size=64)
    model = GPT(config, label_smoothing=0.1)  # passed when the model is built (build_model: train.label_smoothing)
    docs = random_docs(gen, [9, 14, 5, 20], V)
    whole = pack([[docs[0], docs[1]], [docs[2], docs[3]]], seq_len=25)
    parts = [pack([[docs[0], docs[1]]], seq_len=25), pack([[docs[2], docs[3]]], seq_len=25)]
    model.train()
    a = model.token_losses(whole)
    b = torch.cat([model.token_losses(p) for p in parts])  # the same rows, two batches
    assert torch.allclose(a, b, atol=1e-6)
    model.eval()
    with torch.no_grad():
        plain = model.token_losses(whole)
    same = GPT(config)  # the same weights, no smoothing
    same.load_state_dict(model.state_dict())
    same.train()
    unsmoothed = same.token_losses(whole)
    assert torch.allclose(plain, unsmoothed, atol=1e-6)  # evaluation ignores smoothing
    assert (a - unsmoothed).abs().max().item() > 1e-4  # training uses it
