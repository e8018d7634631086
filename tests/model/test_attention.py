"""Document masks, the single-document fast-path test and backend resolution."""

from __future__ import annotations

import pytest
import torch

from conftest import pack
from densebatch.errors import ConfigError
from densebatch.model.attention import (
    attend,
    document_mask,
    only_padding_after_first_document,
    plan_attention,
    resolve_backend,
)


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
    assert resolve_backend("auto", "cpu", training=True) == "masked"
    assert resolve_backend("masked", "cpu") == "masked"
    assert resolve_backend("flex", "cpu", training=False) == "flex"
    with pytest.raises(ConfigError, match="no backward pass on CPU"):
        resolve_backend("flex", "cpu", training=True)
    with pytest.raises(ConfigError, match="needs CUDA"):
        resolve_backend("varlen", "cpu")
    with pytest.raises(ConfigError, match="expected one of"):
        resolve_backend("fast", "cpu")


def test_varlen_plan_fp32_falls_back_to_exact_mask():
    # The varlen plan's cu_seqlens are checked here; the kernel itself needs CUDA + half precision.
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])
    plan = plan_attention(pos, "varlen")
    assert plan.cu_seqlens.tolist() == [0, 3, 5, 9, 10] and plan.max_len == 4
    q, k, v = torch.randn(3, 2, 2, 5, 8).unbind(0)
    ref = attend(q, k, v, plan_attention(pos, "masked"))
    assert torch.allclose(attend(q, k, v, plan), ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_cuda_backends_match_masked(backend):
    torch.manual_seed(0)
    pos = torch.tensor([[*range(100), *range(60), *range(96)]] * 2, device="cuda")
    q, k, v = torch.randn(3, 2, 4, 256, 64, device="cuda", dtype=torch.bfloat16).unbind(0)
    ref = attend(q, k, v, plan_attention(pos, "masked")).float()
    out = attend(q, k, v, plan_attention(pos, backend)).float()
    assert (out - ref).abs().max() < 2e-2
