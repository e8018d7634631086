"""Out-of-memory isolation: a batch that does not fit is split by rows within its step, with the unsplit gradient."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from densebatch.config import TrainConfig
from densebatch.errors import UserError
from densebatch.train.distributed import Distributed, TokenLosses
from densebatch.train.loop import Trainer
from densebatch.train.observe.monitor import read_metrics
from densebatch.train.parts import Evaluation, Placement, Reporting
from densebatch.train.passes import is_out_of_memory, split_rows


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 1e-2, "warmup_steps": 0, "progress": False, "device": "cpu", **kw})


class ForwardOOM(nn.Module):
    """TokenLosses that raises CUDA's out-of-memory error for batches of more than ``max_rows`` rows
    (only while ``armed``), as the caching allocator does before running anything."""

    def __init__(self, model: nn.Module, max_rows: int):
        super().__init__()
        self.inner, self.max_rows, self.armed, self.refused = TokenLosses(model), max_rows, True, 0

    def forward(self, batch):
        if self.armed and batch.num_rows > self.max_rows:
            self.refused += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self.inner(batch)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes (injected)")
        return grad, None


def _grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return ((a - b).abs().max() / b.abs().max()).item() <= 1e-6


def test_a_batch_out_of_memory_in_forward_is_split_with_the_unsplit_gradient(tiny, tmp_path):
    docs = tiny.make_docs(9, seed=3, min_len=2, max_len=30)
    batch = replace(tiny.collate(docs), documents=tuple(range(9)))
    plain = Trainer(
        tiny.TinyLM(), [batch], _cfg(), output_dir=tmp_path / "a", placement=Placement("cpu"), reporting=Reporting(console=False)
    )
    model = tiny.TinyLM()
    inject = ForwardOOM(model, max_rows=2)
    split = Trainer(
        model,
        [batch],
        _cfg(),
        output_dir=tmp_path / "b",
        placement=Placement(device="cpu", forward=inject),
        reporting=Reporting(console=False),
    )
    s1, s2 = plain.forward_backward([batch]), split.forward_backward([batch])
    s1.read(), s2.read()
    assert inject.refused == 4 and s2["oom_splits"] == 4  # 9 -> 5 + 4 -> 3 + 2 + 2 + 2 -> 2 + 1 + ...
    assert _close(_grad(split.model), _grad(plain.model))
    assert s2["loss"] == pytest.approx(s1["loss"], rel=1e-6)
    assert {k: s2[k] for k in ("loss_tokens", "real_tokens", "slot_tokens", "batches")} == {
        k: s1[k] for k in ("loss_tokens", "real_tokens", "slot_tokens", "batches")
    }


def test_out_of_memory_in_backward_replays_the_step_without_partial_gradients(tiny, tmp_path):
    """The error strikes after the head's gradient was accumulated: the step's gradients are zeroed
    and its passes replayed (the first batch too), else that part would count twice."""

    class BackwardOOM(tiny.TinyLM):
        max_rows, failures = 4, 0

        def forward(self, input_ids, positions):
            fail = input_ids.shape[0] > self.max_rows
            self.failures += fail
            x = _RaiseInBackward.apply(self.embed(input_ids), fail)  # raises after head, norm and block grads
            return self.head(self.norm(torch.tanh(self.block(x))))

    first = tiny.collate(tiny.make_docs(2, seed=1))
    big = tiny.collate(tiny.make_docs(8, seed=2, max_len=30))
    plain = Trainer(
        tiny.TinyLM(), [first], _cfg(), output_dir=tmp_path / "a", placement=Placement("cpu"), reporting=Reporting(console=False)
    )
    model = BackwardOOM()
    split = Trainer(
        model, [first], _cfg(), output_dir=tmp_path / "b", placement=Placement("cpu"), reporting=Reporting(console=False)
    )
    s1, s2 = plain.forward_backward([first, big]), split.forward_backward([first, big])
    s1.read(), s2.read()
    assert model.failures == 1 and s2["oom_splits"] == 1
    assert _close(_grad(split.model), _grad(plain.model))
    assert s2["loss"] == pytest.approx(s1["loss"], rel=1e-6)


def test_the_run_goes_on_and_the_split_is_logged_once(tiny, tmp_path, capsys):
    batches = [tiny.collate(tiny.make_docs(6, seed=s)) for s in range(3)]
    model = tiny.TinyLM()
    inject = ForwardOOM(model, max_rows=3)
    inject.armed = False
    trainer = Trainer(model, batches, _cfg(max_steps=3), output_dir=tmp_path, placement=Placement(device="cpu", forward=inject))

    def arm(result):  # the second and third steps run out of memory
        inject.armed = True

    trainer.after_step = arm
    result = trainer.run()
    assert result.stop_reason == "max_steps"
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r.get("oom_splits") for r in recs] == [None, 1, 1]
    assert all(r["outcome"] == "applied" for r in recs)
    assert capsys.readouterr().out.count("out of memory on a batch of 6 rows") == 1


def test_a_single_row_that_does_not_fit_stops_the_run_naming_its_document(tiny, tmp_path):
    batch = replace(tiny.collate(tiny.make_docs(1, seed=4, min_len=20, max_len=20)), documents=(41,))
    inject = ForwardOOM(tiny.TinyLM(), max_rows=0)
    trainer = Trainer(
        inject.inner.model,
        [batch],
        _cfg(),
        output_dir=tmp_path,
        placement=Placement(device="cpu", forward=inject),
        reporting=Reporting(console=False),
    )
    with pytest.raises(UserError, match=r"single row of 20 tokens \(document 41, 19 loss tokens\)") as err:
        trainer.forward_backward([batch])
    assert "\n" not in str(err.value)


def test_other_errors_are_not_taken_for_out_of_memory(tiny, tmp_path):
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))

    class Broken(nn.Module):
        def forward(self, batch):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    batch = tiny.collate(tiny.make_docs(4))
    trainer = Trainer(
        tiny.TinyLM(),
        [batch],
        _cfg(),
        output_dir=tmp_path,
        placement=Placement(device="cpu", forward=Broken()),
        reporting=Reporting(console=False),
    )
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        trainer.forward_backward([batch])


def test_under_torchrun_a_rank_refuses_to_split_alone(tiny, tmp_path, monkeypatch):
    batch = tiny.collate(tiny.make_docs(4))
    dist = Distributed(rank=1, world_size=2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op="sum": t)  # no process group in this test
    inject = ForwardOOM(tiny.TinyLM(), max_rows=1)
    trainer = Trainer(
        inject.inner.model,
        [batch],
        _cfg(),
        output_dir=tmp_path,
        placement=Placement(device="cpu", forward=inject, dist=dist),
        reporting=Reporting(console=False),
    )
    with pytest.raises(UserError, match="out of memory on rank 1 .* under torchrun batches are not split"):
        trainer.forward_backward([batch])
    assert inject.refused == 1


def test_out_of_memory_in_evaluation_never_changes_the_training_budget(tiny, tmp_path):
    """Evaluation is not split: its error reaches the caller; the training steps around it keep their
    batches whole (no split carried over), and the configuration (the budget) is untouched."""

    class EvalOOM(ForwardOOM):  # only passes without gradients (evaluation) run out of memory
        def forward(self, batch):
            if torch.is_grad_enabled():
                return self.inner(batch)
            return super().forward(batch)

    batches = [tiny.collate(tiny.make_docs(6, seed=s)) for s in range(2)]
    inject = EvalOOM(tiny.TinyLM(), max_rows=3)
    cfg = _cfg(max_steps=2)
    trainer = Trainer(
        inject.inner.model,
        batches,
        cfg,
        output_dir=tmp_path,
        evaluation=Evaluation(data=[tiny.collate(tiny.make_docs(6, seed=9))]),
        placement=Placement(device="cpu", forward=inject),
        reporting=Reporting(console=False),
    )
    first = trainer.train_step(trainer.next_step())
    with pytest.raises(torch.OutOfMemoryError):
        trainer.evaluate_now()
    assert inject.refused == 1  # raised once, not retried on halves
    second = trainer.train_step(trainer.next_step())
    for result, batch in zip((first, second), batches):
        assert "oom_splits" not in result.record and result.record["slot_tokens"] == batch.num_slots
    assert trainer.cfg == _cfg(max_steps=2) and trainer.cfg is cfg


def test_split_rows_keeps_exact_counts(tiny):
    batch = tiny.collate(tiny.make_docs(5, seed=7, max_len=30))
    a, b = split_rows(batch)
    assert (a.num_rows, b.num_rows) == (3, 2)
    assert a.num_loss_tokens + b.num_loss_tokens == batch.num_loss_tokens
    assert torch.equal(torch.cat([a.input_ids, b.input_ids]), batch.input_ids)
    assert a.max_position == int(batch.positions[:3].max()) and a.single_doc_rows is False  # unknown -> masked path
