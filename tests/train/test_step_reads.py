"""A distributed step reads the device once, at its end (issue 22): the step's loss-token count over ranks
divides every micro-batch's loss from the device and is read with the loss sums and the gradient norm.
Two identical ranks are stubbed (no process group): a sum over ranks doubles."""

from __future__ import annotations

import pytest
import torch

from densebatch.train.distributed import Distributed
from densebatch.train.loop import StepOutcome


class TwinRanks(Distributed):
    """Two ranks holding the same batches, with no process group: a sum over ranks doubles."""

    def __init__(self):
        super().__init__(world_size=2)

    def all_reduce(self, t, op="sum"):
        return t.detach().clone() * (2 if op == "sum" else 1)


def _reads(fn) -> int:
    """``.item()`` / ``float(t)`` / ``int(t)`` reads of a tensor while ``fn`` runs, and ``fn``'s result."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return sum(e.name in ("aten::_local_scalar_dense", "aten::item") for e in prof.events()), out


def test_a_distributed_step_reads_its_loss_token_count_with_its_end_of_step_stats(tiny, tmp_path):
    """Under DDP / FSDP the step's loss tokens over ranks divide every micro-batch's loss: the count
    stays on the device (no read before the backward passes) and is read in the step's one transfer,
    with the loss sums and the gradient norm. Two identical ranks give one process's gradient and loss."""
    docs = tiny.make_docs(8, seed=2, min_len=2, max_len=30)
    batches = [tiny.collate(docs[:4]), tiny.collate(docs[4:])]
    one, two = tiny.trainer(tmp_path / "one", batches), tiny.trainer(tmp_path / "two", batches, dist=TwinRanks())
    reads, stats = _reads(lambda: two.forward_backward(batches))
    assert reads == 0
    assert "loss_tokens" not in dict(stats) and stats.has_targets and not stats.is_empty()  # decided on the host
    with pytest.raises(KeyError, match="read"):  # a device value only comes with the step's one read
        stats["loss"]  # noqa: B018
    ref = one.forward_backward(batches)
    ref.read()
    assert torch.allclose(tiny.flat_grad(two.model), tiny.flat_grad(one.model), rtol=1e-6, atol=1e-9)
    two.apply_update(stats)
    assert stats["loss_tokens"] == 2 * ref["loss_tokens"] and stats["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    # a step without loss tokens on any rank: found empty from the device's count, and no update
    empty = tiny.collate(docs[:2])
    empty = type(empty)(empty.input_ids, torch.full_like(empty.labels, -100), empty.positions, 0, empty.num_real_tokens)
    before = [p.detach().clone() for p in two.model.parameters()]
    stats = two.forward_backward([empty])
    assert not stats.has_targets and stats.is_empty() and stats["loss_tokens"] == 0
    assert two.apply_update(stats)[0] == StepOutcome.EMPTY
    assert all(torch.equal(a, b) for a, b in zip(before, two.model.parameters()))
