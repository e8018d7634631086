"""Data × context = 2 × 2 (train/parallel/mesh.py): the trainer's step equals one process's, under DDP and FSDP2.

Four forked ranks in one gloo group form torch's DeviceMesh of 2 data ranks × 2 context ranks. A step of
four batches is dealt as the data layer deals it (data rank d: batches 2d and 2d+1, read by both of its
context ranks, each keeping its columns). The step's loss, loss tokens, real tokens and every parameter's
gradient (after DDP's all-reduce, or FSDP2's reduce-scatter, over all four ranks) equal one process's
step over the four whole batches (fp32, 1e-5); an optimizer step then runs on the sharded parameters.
"""

from __future__ import annotations

import pytest
import torch

from densebatch.config import TrainConfig
from densebatch.testing.batches import pack, random_docs
from densebatch.testing.models import tiny_gpt
from densebatch.testing.ranks import on_ranks
from densebatch.train.distributed import Distributed, wrap_model
from densebatch.train.loop import Trainer
from densebatch.train.parallel.mesh import context_ranks
from densebatch.train.parts import Placement

T = 64
# four batches of rows (document lengths): documents across chunk boundaries, shorter than a chunk, padding
STEP = [
    [[40, 9, 3, 12], [64]],
    [[5, 30, 20, 1, 8]],
    [[7, 33], [60], [2, 2, 2]],
    [[64], [31, 31]],
]


def _batches():
    gen = torch.Generator().manual_seed(3)
    return [pack([random_docs(gen, row, 50) for row in rows], seq_len=T) for rows in STEP]


def _cfg(accumulate: int) -> TrainConfig:
    return TrainConfig(lr=1e-2, warmup_steps=0, progress=False, device="cpu", grad_accum_batches=accumulate, max_steps=1)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g  # FSDP2: DTensor shards, gathered
    return out


def _ranks(rank: int, world: int, mode: str, out: str) -> None:
    batches = _batches()
    one = Trainer(tiny_gpt(50), batches, _cfg(4), output_dir=f"{out}/one-{rank}")
    want = one.forward_backward(batches)
    want.read()
    want_grads = _grads(one.model)

    dist = Distributed(rank=rank, world_size=world)
    ranks = context_ranks(dist, 2)
    assert (ranks.data_size, ranks.degree) == (2, 2) and (ranks.data_rank, ranks.index) == divmod(rank, 2)
    model = tiny_gpt(50)
    forward = wrap_model(model, mode, dist)
    mine = batches[2 * ranks.data_rank : 2 * ranks.data_rank + 2]  # as StepSettings deals 2 data ranks' shares
    trainer = Trainer(model, mine, _cfg(2), output_dir=f"{out}/{mode}-{rank}", placement=Placement("cpu", dist, forward, ranks))
    step = trainer.next_step()
    assert all(b.shard is not None and b.shard.index == ranks.index and b.seq_len == T // 2 for b in step.batches)
    got = trainer.forward_backward(step.batches)
    got.read()
    for key in ("loss_tokens", "real_tokens", "slot_tokens"):
        assert got[key] == want[key], key
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    got_grads = _grads(model)
    scale = max(float(g.abs().max()) for g in want_grads.values())
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{mode} {n}: {m}")
    outcome, norm, _ = trainer.apply_update(got)
    assert outcome.name == "APPLIED" and norm == pytest.approx(
        float(torch.cat([g.flatten() for g in want_grads.values()]).norm()), rel=1e-5
    )


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_data_ranks_by_two_context_ranks_step_like_one_process(mode, tmp_path):
    on_ranks(_ranks, 4, mode, str(tmp_path))
