"""Rows split over context ranks (model/context_attention.py): exact against one rank computing the whole rows.

Every check runs on forked ranks in one gloo group (``densebatch.testing.ranks``). Each rank computes the
whole rows alone (the reference), then only its own columns (``batch.shard_columns``: a head and a tail
chunk) with the other columns exchanged over the group, and compares its per-token losses and, once the
ranks' gradients are summed, every parameter's gradient (fp32: 1e-5). The rows hold documents that cross
chunk boundaries, documents shorter than a chunk, one as long as the row, one of a single token, and padding.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from densebatch import torch_features
from densebatch.batch import RowShard, segment_bounds, shard_columns
from densebatch.errors import ConfigError
from densebatch.model.attention import attend, plan_attention
from densebatch.model.context_attention import heads_problem
from densebatch.testing.batches import pack, random_docs
from densebatch.testing.models import ARCHITECTURES, VOCAB, tiny_gpt, write_config_dir
from densebatch.testing.ranks import on_ranks
from densebatch.train.parallel.mesh import ContextRanks
from densebatch.train.parallel.shards import shard_batch

T = 64  # 8 chunks of 8 tokens over 4 ranks, 4 of 16 over 2
# documents per row: 40 crosses 4 chunks of 8; 3, 1 and 5 are shorter than a chunk; 64 is the whole row
ROWS = [[40, 9, 3, 12], [64], [5, 30, 20, 1, 8], [7, 33]]
ONE_DOC_ROWS = [[50], [64], [9]]  # one document then padding: the plain causal path of whole rows


def _batch(vocab: int, rows=ROWS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return pack([random_docs(gen, lengths, vocab) for lengths in rows], seq_len=T)


def _split_equals_whole(model, batch, rank: int, world: int, grad_tol: float = 1e-5) -> None:
    """``model``'s losses and gradients on this rank's columns of ``batch`` (gradients summed over the ranks)
    against the whole rows on this rank alone."""
    whole = model.token_losses(batch)  # (rows, T)
    whole.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    mine = shard_batch(batch, ContextRanks(world, rank, group=dist.group.WORLD))
    got = model.token_losses(mine)  # (rows, T / N)
    got.sum().backward()
    cols = shard_columns(batch.seq_len, world, rank)
    assert got.shape == (batch.num_rows, batch.seq_len // world)
    torch.testing.assert_close(got, whole[:, cols], rtol=1e-5, atol=1e-5)
    # a gradient that is 0 in exact arithmetic (a key projection's bias) is float noise on both paths:
    # absolute differences are judged against the model's largest gradient
    scale = max(float(g.abs().max()) for g in want.values())
    for name, p in model.named_parameters():
        if name not in want:
            continue
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, want[name], rtol=grad_tol, atol=grad_tol * scale, msg=lambda m, n=name: f"{n}: {m}")
    model.zero_grad(set_to_none=True)


def _gpt_ranks(rank: int, world: int) -> None:
    batch = _batch(50)
    for attention in ("masked", "segmented"):
        _split_equals_whole(tiny_gpt(50, attention=attention), batch, rank, world)
    # recomputed in the backward pass: the exchanges run again there, on every rank alike
    _split_equals_whole(tiny_gpt(50, attention="segmented", gradient_checkpointing=True).train(), batch, rank, world)
    torch_features.reset_kernels()
    _split_equals_whole(tiny_gpt(50), replace(_batch(50, ONE_DOC_ROWS), single_doc_rows=True), rank, world)
    assert any(k.startswith("causal") and "context ranks" in k for k in torch_features.kernels_used())  # whole rows' causal path


@pytest.mark.parametrize("world", [2, 4])
def test_reference_gpt_split_over_context_ranks_equals_the_whole_rows(world):
    on_ranks(_gpt_ranks, world)


def _hf_ranks(rank: int, world: int, root: str, kinds: list[str]) -> None:
    from densebatch.model.hf.adapter import HFCausalLM  # transformers: imported by the test before the fork

    batch = _batch(VOCAB)
    for kind in kinds:
        torch.manual_seed(0)
        model = HFCausalLM(f"{root}/{kind}").eval()  # eval: no dropout (GPT-2, OPT), the same masks on both paths
        _split_equals_whole(model, batch, rank, world)


# every architecture densebatch supports (bloom: ALiBi, refused everywhere); the tiny configs have 4 query heads
# and 2 key/value heads (llama family), 1 (falcon, gpt_bigcode) or 4: over 4 ranks, 2 and 1 are repeated
SUPPORTED = [kind for kind, _ in ARCHITECTURES if kind != "bloom"]


@pytest.mark.parametrize("world", [2, 4])
def test_hugging_face_families_split_over_context_ranks_equal_the_whole_rows(world, tmp_path):
    pytest.importorskip("transformers")
    from densebatch.model.hf.adapter import HFCausalLM

    for kind in SUPPORTED:
        HFCausalLM(write_config_dir(tmp_path, kind))  # its modules imported here once: the forked ranks share them
    on_ranks(_hf_ranks, world, str(tmp_path), SUPPORTED)


def test_heads_the_exchange_cannot_split_are_named():
    assert heads_problem(8, 8, 4) is None and heads_problem(8, 2, 4) is None and heads_problem(4, 1, 4) is None
    assert "6 attention heads" in heads_problem(6, 6, 4)
    assert "3 key/value heads" in heads_problem(6, 3, 2)
    with pytest.raises(ConfigError, match="context_parallel: 6 attention heads"):
        from densebatch.model.context_attention import attend_across

        x = torch.zeros(1, 6, 4, 2)
        attend_across(x, x, x, RowShard(0, 4, torch.zeros(1, 16, dtype=torch.int64)), lambda q, k, v: (q, ""))


# ------------------------------------------------------------------- kernels only a GPU runs, as recorded
def _qkv(world: int, rank: int, dtype, kv_heads: int = 2):
    """Whole-row q (rows, 4, T, 8), k, v (rows, kv_heads, T, 8), the same on every rank, and this rank's columns."""
    gen = torch.Generator().manual_seed(7)
    whole = [torch.randn(len(ROWS), h, T, 8, generator=gen).to(dtype).requires_grad_() for h in (4, kv_heads, kv_heads)]
    cols = shard_columns(T, world, rank)
    mine = [x.detach()[:, :, cols].clone().requires_grad_() for x in whole]
    return whole, mine, cols


def _varlen_ranks(rank: int, world: int, releases: list[str]) -> None:
    from test_torch_releases import RELEASES  # the recorded signature of varlen_attn in each release
    from torch.nn.attention import varlen as varlen_module

    pos = _batch(50).positions
    cu, longest = segment_bounds(pos)
    shard = RowShard(rank, world, pos, cu, longest, dist.group.WORLD)
    for release in releases:
        calls = []

        @functools.wraps(RELEASES[release])  # inspect.signature reads the release's own
        def recorded(*args, _fn=RELEASES[release], _calls=calls, **kw):
            _calls.append((args[0].shape, args[1].shape, args[3].tolist()))
            return _fn(*args, **kw)

        varlen_module.varlen_attn = recorded
        torch_features.reset_kernels()
        whole, mine, cols = _qkv(world, rank, torch.bfloat16)
        plan = plan_attention(pos, backend="varlen", cu_seqlens=cu, max_seqlen=longest)
        ref = attend(whole[0], k=whole[1], v=whole[2], plan=plan)  # (rows, 4, T, 8)
        ref_grads = torch.autograd.grad(ref.float().pow(2).sum(), whole)
        split = plan_attention(pos[:, cols], backend="varlen", shard=shard)
        out = attend(mine[0], k=mine[1], v=mine[2], plan=split)  # (rows, 4, T / N, 8)
        grads = torch.autograd.grad(out.float().pow(2).sum(), mine)
        assert any(k.startswith("varlen (FlashAttention)") and "context ranks" in k for k in torch_features.kernels_used())
        # the kernel ran whole rows (the batch's own bounds) of 4 / N query heads and their key/value heads
        rows_T = len(ROWS) * T
        assert calls[-1][0] == (rows_T, 4 // world, 8) and calls[-1][2] == cu.tolist(), calls[-1]
        assert calls[-1][1][1] == max(1, 2 // world)
        torch.testing.assert_close(out.float(), ref[:, :, cols].float(), rtol=0, atol=1e-2)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g.float(), r[:, :, cols].float(), rtol=0, atol=2e-2)


def test_varlen_of_every_recorded_release_runs_split_rows_as_whole_rows():
    """varlen_attn as each release's signature takes it (bf16 on CPU through a reference kernel): the split
    rows reach it as the whole rows' segments, with a share of the heads, and give the whole rows' result."""
    pytest.importorskip("torch.nn.attention.varlen")
    on_ranks(_varlen_ranks, 2, ["2.10", "2.11", "2.12", "2.13"])


def _flex_ranks(rank: int, world: int) -> None:
    pos = _batch(50).positions
    cu, longest = segment_bounds(pos)
    whole, mine, cols = _qkv(world, rank, torch.float32)
    whole, mine = [x.detach() for x in whole], [x.detach() for x in mine]  # flex has no backward pass on CPU
    ref = attend(whole[0], k=whole[1], v=whole[2], plan=plan_attention(pos, backend="flex"))
    shard = RowShard(rank, world, pos, cu, longest, dist.group.WORLD)
    out = attend(mine[0], k=mine[1], v=mine[2], plan=plan_attention(pos[:, cols], backend="flex", shard=shard))
    torch.testing.assert_close(out, ref[:, :, cols], rtol=1e-5, atol=1e-5)


def test_flex_runs_split_rows_as_whole_rows():
    if torch_features.flex_attention() is None:
        pytest.skip("this torch has no flex_attention")
    x = torch.zeros(1, 1, 4, 8)
    attend(x, k=x, v=x, plan=plan_attention(torch.arange(4)[None], backend="flex"))  # flex's first call, once before the fork
    on_ranks(_flex_ranks, 2)
