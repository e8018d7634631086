"""The fused chunked loss head: the plain path's losses and gradients, without its full logits.

Also the null batch (an idle rank's share of a step): zero loss, and a backward pass that reaches
every parameter, for both models and both heads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from densebatch.batch import IGNORE_INDEX, Batch
from densebatch.model import GPT
from densebatch.model.loss_head import head_token_losses, plain_head_token_losses
from densebatch.testing.batches import pack, random_docs
from densebatch.testing.models import tiny_gpt, two_layer_config

V = 97


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a against the reference b (norm of the difference / norm of b)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_head(fn, h, labels, head, weights):
    for t in (h, head.weight, head.bias):
        if t is not None:
            t.grad = None
    out = fn()
    (out * weights).sum().backward()
    grads = [t.grad.clone() for t in (h, head.weight, head.bias) if t is not None]
    return out.detach(), grads


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 3),
    T=st.integers(1, 19),
    chunk=st.integers(1, 40),
    bias=st.booleans(),
    uniform=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_head_matches_plain_losses_and_gradients(rows, T, chunk, bias, uniform, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, T, 16, generator=gen).requires_grad_()
    head = torch.nn.Linear(16, V, bias=bias)
    labels = torch.randint(0, V, (rows, T), generator=gen)
    labels[torch.rand(rows, T, generator=gen) < 0.3] = IGNORE_INDEX  # prompt / padding / boundaries
    # The trainer weighs every token alike (sum / count); other weights take the recomputing branch.
    weights = torch.full((rows, T), 0.37) if uniform else torch.rand(rows, T, generator=gen)
    n = int((labels != IGNORE_INDEX).sum())
    ref, ref_grads = run_head(lambda: plain_head_token_losses(h, labels, head), h, labels, head, weights)
    got, got_grads = run_head(
        lambda: head_token_losses(h, labels, head.weight, head.bias, n, chunk_tokens=chunk), h, labels, head, weights
    )
    assert got.dtype == torch.float32 and got.shape == (rows, T)
    assert (got[labels == IGNORE_INDEX] == 0).all()
    assert rel(got, ref) <= 1e-6 or n == 0
    for a, b in zip(got_grads, ref_grads):
        assert rel(a, b) <= 1e-6 or b.norm() == 0 and a.norm() == 0


def test_weights_equal_on_the_targets_but_not_elsewhere_scale_by_the_targets_weight():
    """Found by the property test above (rows 1, T 2, the first position without a target): a weight that is
    uniform over the targets is taken from a target's position, not from position 0."""
    h = torch.randn(1, 3, 16, requires_grad=True)
    head = torch.nn.Linear(16, V)
    weights = torch.tensor([[0.0, 0.5, 0.5]])  # e.g. a mask times a mean: 0 where nothing is predicted
    for labels in (torch.tensor([[IGNORE_INDEX, 5, 7]]), torch.full((1, 3), IGNORE_INDEX)):  # and no target at all
        n = int((labels != IGNORE_INDEX).sum())
        ref, ref_grads = run_head(lambda y=labels: plain_head_token_losses(h, y, head), h, labels, head, weights)
        got, got_grads = run_head(
            lambda y=labels, n=n: head_token_losses(h, y, head.weight, head.bias, n), h, labels, head, weights
        )
        assert torch.allclose(got, ref, atol=1e-6)
        for a, b in zip(got_grads, ref_grads):
            assert rel(a, b) <= 1e-6 or b.norm() == 0 and a.norm() == 0


def test_backward_needs_no_host_read_for_the_trainers_sum(monkeypatch):
    # As on an accelerator: no equality check on the host. The trainer's sum / count reaches the head
    # as one value expanded over all positions, so the forward's sums only get scaled...
    import densebatch.model.loss_head as lh

    monkeypatch.setattr(lh, "_CHECK_UNIFORM_ON_HOST", set())
    h = torch.randn(2, 7, 16, requires_grad=True)
    head = torch.nn.Linear(16, V, bias=False)
    labels = torch.randint(0, V, (2, 7))
    ref, ref_grads = run_head(lambda: plain_head_token_losses(h, labels, head), h, labels, head, torch.full((2, 7), 1 / 14))

    def no_recompute(*a, **kw):
        raise AssertionError("recomputed although the weights were visibly uniform")

    with monkeypatch.context() as m:
        m.setattr(lh, "_weighted_head_grads", no_recompute)
        h.grad = head.weight.grad = None
        (head_token_losses(h, labels, head.weight, None, 14).sum() / 14).backward()
    assert rel(h.grad, ref_grads[0]) <= 1e-6 and rel(head.weight.grad, ref_grads[1]) <= 1e-6
    # ...while uniform weights it cannot see as such are recomputed, still exactly.
    got, got_grads = run_head(
        lambda: head_token_losses(h, labels, head.weight, None, 14, chunk_tokens=5), h, labels, head, torch.full((2, 7), 1 / 14)
    )
    assert rel(got, ref) <= 1e-6 and all(rel(a, b) <= 1e-6 for a, b in zip(got_grads, ref_grads))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 3), T=st.integers(1, 19), chunk=st.integers(1, 40), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_token_weights_give_weighted_losses_whose_sum_backpropagates_without_recomputing(rows, T, chunk, bias, seed):
    """train.source_balance: weights given to the head (per position) multiply each CE, and the forward's
    gradient sums carry them, so the trainer's plain sum of the result needs no second projection."""
    import densebatch.model.loss_head as lh

    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, T, 16, generator=gen).requires_grad_()
    head = torch.nn.Linear(16, V, bias=bias)
    labels = torch.randint(0, V, (rows, T), generator=gen)
    labels[torch.rand(rows, T, generator=gen) < 0.3] = IGNORE_INDEX
    w = torch.rand(rows, T, generator=gen) + 0.1
    n = int((labels != IGNORE_INDEX).sum())
    ref, ref_grads = run_head(lambda: plain_head_token_losses(h, labels, head), h, labels, head, w)

    def no_recompute(*a, **kw):
        raise AssertionError("recomputed the head for weights it was given")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(lh, "_CHECK_UNIFORM_ON_HOST", set())  # as on an accelerator
        m.setattr(lh, "_weighted_head_grads", no_recompute)
        for t in (h, head.weight, head.bias):
            if t is not None:
                t.grad = None
        out = head_token_losses(h, labels, head.weight, head.bias, n, chunk_tokens=chunk, token_weights=w)
        out.sum().backward()  # as the trainer does: one value expanded over every position
        got, got_grads = out.detach(), [t.grad.clone() for t in (h, head.weight, head.bias) if t is not None]
    ones = torch.ones(rows, T)
    plain, plain_grads = run_head(lambda: plain_head_token_losses(h, labels, head, token_weights=w), h, labels, head, ones)
    assert rel(got, ref * w) <= 1e-6 or n == 0
    assert rel(plain, ref * w) <= 1e-6 or n == 0
    for a, b, c in zip(got_grads, ref_grads, plain_grads):
        assert rel(a, b) <= 1e-6 or b.norm() == 0 and a.norm() == 0
        assert rel(c, b) <= 1e-6 or b.norm() == 0 and c.norm() == 0
    # any other use of the weighted losses (a non-uniform gradient from downstream) is exact too: the
    # recomputing branch carries the forward's weights
    v = torch.rand(rows, T, generator=gen) + 0.1
    ref_v, ref_v_grads = run_head(lambda: plain_head_token_losses(h, labels, head), h, labels, head, w * v)
    got_v, got_v_grads = run_head(
        lambda: head_token_losses(h, labels, head.weight, head.bias, n, chunk_tokens=chunk, token_weights=w), h, labels, head, v
    )
    for a, b in zip(got_v_grads, ref_v_grads):
        assert rel(a, b) <= 1e-6 or b.norm() == 0 and a.norm() == 0


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_fused_head_never_holds_all_logits():
    vocab, C, n, chunk = 1000, 8, 64, 16
    h = torch.randn(1, n, C, requires_grad=True)
    head = torch.nn.Linear(C, vocab, bias=False)
    labels = torch.randint(0, vocab, (1, n))
    sizes = {}
    for name, fn in {
        "plain": lambda: plain_head_token_losses(h, labels, head),
        "fused": lambda: head_token_losses(h, labels, head.weight, None, n, chunk_tokens=chunk),
    }.items():
        with LargestTensor() as mode:
            fn().sum().backward()
        sizes[name] = mode.largest
    assert sizes["plain"] >= n * vocab  # the full logits (and their gradient)
    assert sizes["fused"] <= max(chunk * vocab, vocab * C)  # one chunk of logits, or the weight's gradient


def test_fused_head_without_grad_computes_only_losses():
    h = torch.randn(2, 5, 16)
    head = torch.nn.Linear(16, V, bias=False)
    labels = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        got = head_token_losses(h, labels, head.weight, None, chunk_tokens=3)
    assert not got.requires_grad
    assert rel(got, plain_head_token_losses(h, labels, head).detach()) <= 1e-6


def test_fused_head_under_bf16_autocast_is_close_and_float32(gen):
    torch.manual_seed(0)
    h = torch.randn(2, 9, 16, requires_grad=True)
    head = torch.nn.Linear(16, V, bias=False)
    labels = torch.randint(0, V, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = head_token_losses(h, labels, head.weight, None, chunk_tokens=4)
        plain = plain_head_token_losses(h, labels, head)
    assert fused.dtype == torch.float32
    assert (fused - plain).abs().max() <= 1e-5  # the same bf16 products (measured 5e-7)
    assert (fused - plain_head_token_losses(h, labels, head)).abs().max() > 1e-4  # ...and bf16 they were
    fused.sum().backward()
    assert h.grad.dtype == torch.float32 and torch.isfinite(h.grad).all()


# ---------------------------------------------------------------------------------- models
def gpt(loss_head: str) -> GPT:
    return tiny_gpt(V, loss_head=loss_head)


def hf(kind: str, tmp_path, loss_head: str):
    pytest.importorskip("transformers")
    from densebatch.model.hf.adapter import HFCausalLM

    two_layer_config(kind, V).save_pretrained(tmp_path)
    torch.manual_seed(0)
    return HFCausalLM(tmp_path, loss_head=loss_head)


MODELS = ["gpt", "gpt2", "llama"]


def build(kind: str, tmp_path, loss_head: str = "fused"):
    return gpt(loss_head) if kind == "gpt" else hf(kind, tmp_path / loss_head, loss_head)


@pytest.mark.parametrize("kind", MODELS)
def test_models_fused_and_plain_heads_agree(kind, tmp_path, gen):
    batch = pack([random_docs(gen, row, V) for row in [[7, 12, 5], [20], [3, 9, 1, 6]]], seq_len=24)
    results = []
    for loss_head in ("plain", "fused"):
        model = build(kind, tmp_path, loss_head).train()
        losses = model.token_losses(batch)
        (losses.sum() / batch.num_loss_tokens).backward()
        results.append((losses.detach(), [p.grad for p in model.parameters()]))
    (ref, ref_grads), (got, got_grads) = results
    assert rel(got, ref) <= 1e-6
    assert max(rel(a, b) for a, b in zip(got_grads, ref_grads)) <= 1e-6


@pytest.mark.parametrize("loss_head", ["fused", "plain"])
@pytest.mark.parametrize("kind", MODELS)
def test_null_batch_runs_forward_and_backward_with_zero_loss(kind, loss_head, tmp_path):
    model = build(kind, tmp_path, loss_head).train()
    null = Batch.null(pad_id=0)
    losses = model.token_losses(null)
    assert losses.shape == (1, 1) and float(losses.detach().sum()) == 0.0
    (losses.sum() / max(1, null.num_loss_tokens)).backward()
    # Every parameter takes part (DDP / FSDP gradient hooks fire on every rank), with a zero gradient.
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters outside the graph: {missing[:3]}"
    assert all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())


def test_batch_facts_spare_recomputation_and_are_trusted(gen):
    model = gpt("fused").eval()
    batch = pack([[d] for d in random_docs(gen, [5, 9], V)], seq_len=12)
    known = dataclasses.replace(batch, single_doc_rows=True, max_position=int(batch.positions.max()))
    assert torch.allclose(model.token_losses(known), model.token_losses(batch), atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_the_losses_are_a_tensor_of_their_own_not_a_view(fused):
    """The losses are what the module FSDP2 shards returns; a view there makes FSDP2 warn that an in-place
    op on it would skip the pre-backward all-gather (and, were one done, the gradients would be wrong)."""
    h = torch.randn(2, 5, 16, requires_grad=True)
    head = torch.nn.Linear(16, V)
    labels = torch.randint(0, V, (2, 5))
    labels[0, :2] = IGNORE_INDEX
    if fused:
        out = head_token_losses(h, labels, head.weight, head.bias, chunk_tokens=3)
    else:
        out = plain_head_token_losses(h, labels, head)
    assert out.shape == (2, 5) and not out._is_view()
    out.sum().backward()  # the expanded (stride 0) gradient of a sum, the trainer's case
    assert h.grad is not None and head.weight.grad is not None


def test_chunks_are_sized_per_device_and_low_precision_products_accumulate_in_float32():
    from densebatch.model.loss_head import _add_product, _fp32_out_matmul, chunk_tokens_for

    assert chunk_tokens_for(50257) == 2**27 // (4 * 50257)  # CPU: 128 MiB of float32 logits
    assert chunk_tokens_for(32000, device="cuda") == 2**30 // (4 * 32000)  # GPU: 1 GiB, large products
    assert not _fp32_out_matmul(torch.device("cpu"))  # torch 2.13 has no fp32-output bf16 product on CPU
    gen = torch.Generator().manual_seed(0)
    d, h = torch.randn(64, 16, generator=gen), torch.randn(16, 8, generator=gen)
    grad = torch.zeros(64, 8)
    out = _add_product(grad, d.bfloat16(), h.bfloat16())
    assert out.dtype == torch.float32 and out is grad
    assert torch.allclose(out, d @ h, rtol=2e-2, atol=5e-2)
