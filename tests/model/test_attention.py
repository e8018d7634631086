"""Document masks, segment plans, the single-document fast-path test and backend resolution."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.batch import segment_bounds
from densebatch.errors import ConfigError
from densebatch.model.attention import (
    SEGMENTED_MIN_LEN,
    AttnOptions,
    attend,
    document_mask,
    only_padding_after_first_document,
    plan_attention,
    resolve_backend,
    segment_plan,
    segmented_attention,
)
from densebatch.testing.batches import pack


def positions_of(rows: list[list[int]], T: int) -> torch.Tensor:
    """Positions of rows of documents with these lengths, padded to T (padding restarts at 0). (rows, T)"""
    out = torch.zeros(len(rows), T, dtype=torch.int64)
    for r, lengths in enumerate(rows):
        pos = [p for n in lengths for p in range(n)]
        out[r] = torch.tensor(pos + list(range(T - len(pos))))
    return out


def qkv(rows: int, T: int, H: int = 2, D: int = 8, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, H, T, D, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def outputs_and_grads(q, k, v, fn):
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out) + out.detach())  # a non-uniform upstream
    return out, grads


def test_document_mask_is_block_diagonal_and_causal():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])  # a a a b b P P
    m = document_mask(pos)[0, 0]
    want = torch.zeros(7, 7, dtype=torch.bool)
    for lo, hi in [(0, 3), (3, 5), (5, 7)]:
        want[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(m, want)


def test_fast_path_only_when_rest_is_padding():
    assert only_padding_after_first_document(pack([[[1, 2, 3]], [[4, 5]]], seq_len=5))
    assert only_padding_after_first_document(pack([[[1, 2, 3, 4, 5]]]))
    # Two documents in a row look like document + padding by positions; the counts tell them apart.
    assert not only_padding_after_first_document(pack([[[1, 2, 3], [4, 5]], [[6, 7, 8, 9, 1]]]))
    assert not only_padding_after_first_document(pack([[[1, 2], [3, 4], [5]]]))


def test_resolve_backend_on_cpu():
    assert resolve_backend("auto", "cpu", training=True) == "segmented"
    assert resolve_backend("auto", "cpu", training=True, seq_len=SEGMENTED_MIN_LEN) == "segmented"
    # Short rows: the gathers cost as much as the scores they save.
    assert resolve_backend("auto", "cpu", training=True, seq_len=SEGMENTED_MIN_LEN - 1) == "masked"
    assert resolve_backend("segmented", "cpu", seq_len=8) == "segmented"
    assert resolve_backend("masked", "cpu") == "masked"
    assert resolve_backend("flex", "cpu", training=False) == "flex"
    with pytest.raises(ConfigError, match="no backward pass on CPU"):
        resolve_backend("flex", "cpu", training=True)
    with pytest.raises(ConfigError, match="needs CUDA"):
        resolve_backend("varlen", "cpu")
    with pytest.raises(ConfigError, match="expected one of"):
        resolve_backend("fast", "cpu")


def test_varlen_plan_fp32_falls_back_to_exact_segments():
    # The varlen plan's cu_seqlens are checked here; the kernel itself needs CUDA + half precision.
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])
    plan = plan_attention(pos, backend="varlen")
    assert plan.cu_seqlens.tolist() == [0, 3, 5, 9, 10] and plan.max_len == 4
    q, k, v = torch.randn(3, 2, 2, 5, 8).unbind(0)
    ref = attend(q, k=k, v=v, plan=plan_attention(pos, backend="masked"))
    assert torch.allclose(attend(q, k=k, v=v, plan=plan), ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["varlen", "flex", "segmented"])
def test_cuda_backends_match_masked(backend):
    torch.manual_seed(0)
    pos = torch.tensor([[*range(100), *range(60), *range(96)]] * 2, device="cuda")
    q, k, v = torch.randn(3, 2, 4, 256, 64, device="cuda", dtype=torch.bfloat16).unbind(0)
    ref = attend(q, k=k, v=v, plan=plan_attention(pos, backend="masked")).float()
    out = attend(q, k=k, v=v, plan=plan_attention(pos, backend=backend)).float()
    assert (out - ref).abs().max() < 2e-2


def test_segment_plan_buckets_and_round_trip():
    pos = positions_of([[5, 40, 3], [48], [1, 47]], T=48)
    seg = segment_plan(pos)  # default bounds: <= 32, (32, 40], (40, 50]
    assert seg.buckets == [(3, 5), (1, 40), (2, 48)]
    n_slots = sum(n * L for n, L in seg.buckets)
    assert seg.gather.shape == (n_slots,) and seg.pad_slots.numel() == n_slots - pos.numel()
    assert torch.equal(seg.gather[seg.scatter], torch.arange(pos.numel()))  # each token is its own slot
    # Slots of a segment are contiguous and in order: token t sits `offset` slots after its segment's first.
    assert torch.equal(seg.scatter[3 * 48 - 47 :] - seg.scatter[3 * 48 - 47], torch.arange(47))


def test_a_row_start_is_a_segment_start():
    # Left-over positions that do not restart at a row start still never attend across rows.
    pos = torch.tensor([[3, 4, 5, 0, 1], [7, 8, 0, 1, 2]])
    q, k, v = qkv(2, 5)
    ref = attend(q, k=k, v=v, plan=plan_attention(pos, backend="masked"))
    assert torch.allclose(attend(q, k=k, v=v, plan=plan_attention(pos, backend="segmented")), ref, atol=1e-6)


def test_one_segment_per_row_takes_the_causal_path():
    assert plan_attention(torch.arange(300).repeat(2, 1), backend="segmented").backend == "causal"
    assert plan_attention(positions_of([[3, 4]], 9), backend="segmented").backend == "segmented"


@pytest.mark.parametrize("causal", [True, False])
def test_segmented_matches_masked_with_gradients_and_dropout_off(causal):
    """Also bidirectional (an encoder): the padding slots of a bucket are then masked out as keys, and the
    gradient of every real token is still read from its one slot."""
    pos = positions_of([[100, 60, 90], [256], [1, 2, 3, 200], [17]], T=256)
    q, k, v = qkv(4, 256, H=4, D=16)
    ref, ref_g = outputs_and_grads(
        q, k, v, lambda q, k, v: attend(q, k=k, v=v, plan=plan_attention(pos, backend="masked", causal=causal))
    )
    out, out_g = outputs_and_grads(
        q, k, v, lambda q, k, v: attend(q, k=k, v=v, plan=plan_attention(pos, backend="segmented", causal=causal))
    )
    assert (out - ref).abs().max() <= 1e-5
    for a, b in zip(out_g, ref_g):
        assert (a - b).abs().max() <= 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_segmented_gradcheck_float64(causal):
    pos = positions_of([[3, 6], [2, 2, 4]], T=11)
    q, k, v = qkv(2, 11, H=1, D=3, dtype=torch.float64)
    seg = segment_plan(pos, ratio=1.5, min_len=2)  # several buckets, padded slots in most
    assert len(seg.buckets) > 2
    opts = AttnOptions(causal=causal)
    assert torch.autograd.gradcheck(lambda *x: segmented_attention(*x, seg, opts=opts), (q, k, v))


@st.composite
def layouts(draw):
    """Rows of document lengths plus trailing padding, and bucket settings that split them finely."""
    T = draw(st.integers(1, 40))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        lengths, left = [], T
        while left and draw(st.booleans()):
            n = draw(st.integers(1, left))
            lengths.append(n)
            left -= n
        rows.append(lengths)
    return T, rows, draw(st.sampled_from([1.25, 1.5, 2.0])), draw(st.integers(1, 8))


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_random_layouts_match_masked(layout):
    T, rows, ratio, min_len = layout
    pos = positions_of(rows, T)
    seg = segment_plan(pos, ratio=ratio, min_len=min_len)
    q, k, v = qkv(len(rows), T, seed=T)
    ref, ref_g = outputs_and_grads(q, k, v, lambda q, k, v: attend(q, k=k, v=v, plan=plan_attention(pos, backend="masked")))
    out, out_g = outputs_and_grads(q, k, v, lambda *x: segmented_attention(*x, seg))
    assert (out - ref).abs().max() <= 1e-5
    for a, b in zip(out_g, ref_g):
        assert (a - b).abs().max() <= 1e-5


def test_segmented_runs_in_bfloat16():
    pos = positions_of([[30, 50], [70]], T=80)
    q, k, v = (x.detach().bfloat16().requires_grad_() for x in qkv(2, 80))
    out = attend(q, k=k, v=v, plan=plan_attention(pos, backend="segmented"))
    ref = attend(q.float(), k=k.float(), v=v.float(), plan=plan_attention(pos, backend="masked"))
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() < 3e-2
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(1, 90), min_size=1, max_size=6), min_size=1, max_size=4), st.integers(0, 40))
def test_segment_plan_from_the_batchs_host_bounds_equals_the_one_found_on_the_device(rows, extra):
    """The collator's cu_seqlens give the same gather / scatter / padding indices and buckets as the
    segments read back from positions (the host path computes them with numpy, no device op)."""
    T = max(sum(r) for r in rows) + extra
    pos = positions_of(rows, T)
    cu, _ = segment_bounds(pos)
    host, found = segment_plan(pos, cu_seqlens=cu), segment_plan(pos)
    assert host.buckets == found.buckets
    for a, b in ((host.gather, found.gather), (host.scatter, found.scatter), (host.pad_slots, found.pad_slots)):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["segmented", "masked", "flex"])
@pytest.mark.parametrize(("window", "softcap", "kv_heads"), [(None, None, 1), (5, None, 2), (None, 0.5, 2), (7, 0.3, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_heads_windows_and_soft_caps_match_a_per_document_reference(backend, window, softcap, kv_heads, causal):
    """What transformers' layers pass (fewer key/value heads, a sliding window, a soft-cap, a scale) gives,
    for every document of packed rows, what plain attention over that document alone gives (flex: forward
    only, as it runs on CPU; on CUDA it is compiled and trains). ``causal`` False: an encoder's layer,
    each token seeing its whole document (a window then reaches both ways) and never the padding."""
    rows, T, H, D = [[9, 14, 5], [20], [3, 11, 1, 7]], 32, 4, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(rows), H, T, D, generator=gen)
    k, v = (torch.randn(len(rows), kv_heads, T, D, generator=gen) for _ in range(2))
    pos = positions_of(rows, T)
    cu, longest = segment_bounds(pos)
    opts = AttnOptions(scale=0.2, window=window, softcap=softcap)
    with torch.no_grad():
        plan = plan_attention(pos, backend=backend, cu_seqlens=cu, max_seqlen=longest, causal=causal)
        out = attend(q, k=k, v=v, plan=plan, opts=opts)
    for r, lengths in enumerate(rows):
        t = 0
        for n in lengths:
            qd, kd, vd = q[r, :, t : t + n], k[r, :, t : t + n], v[r, :, t : t + n]  # (heads, n, D)
            kd, vd = (x.repeat_interleave(H // kv_heads, dim=0) for x in (kd, vd))
            s = qd @ kd.transpose(-1, -2) * 0.2  # (H, n, n)
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            i = torch.arange(n)
            d = i[:, None] - i[None, :]
            if causal:
                allowed = (d >= 0) & ((d < window) if window else True)
            else:
                allowed = (d.abs() < window) if window else torch.ones(n, n, dtype=torch.bool)
            ref = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vd
            assert torch.allclose(out[r, :, t : t + n], ref, atol=1e-5)
            t += n
