"""The training loop: exact token-normalised loss across micro-batches, stopping, eval, hooks, state, determinism, the run's last record (one concept, 420 lines: the Trainer's own behaviour, one section a facet, sharing its helpers)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from densebatch.config import EvalConfig, TrainConfig
from densebatch.errors import ConfigError
from densebatch.train.distributed import Distributed
from densebatch.train.guard import Verdict
from densebatch.train.loop import StepOutcome, Trainer
from densebatch.train.observe.monitor import read_metrics


def _cfg(**kw) -> TrainConfig:
    base = dict(lr=1e-2, warmup_steps=0, progress=False, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def _trainer(tiny, tmp_path, batches, cfg=None, eval_cfg=None, eval_data=None, evaluate_fn=None, dist=None, **parts) -> Trainer:
    """A CPU trainer of a tiny model (``tiny.trainer``); ``parts``: guard, clipper, batch_schedule."""
    return tiny.trainer(tmp_path, batches, cfg or _cfg(), eval_cfg, eval_data, evaluate_fn, dist, **parts)


def _losses(path) -> list[float]:
    return [r["loss"] for r in read_metrics(path / "metrics.jsonl") if r["kind"] == "train"]


# ------------------------------------------------------------------- loss normalisation
def test_micro_batches_give_the_same_gradient_and_loss_as_one_batch(tiny, tmp_path):
    docs = tiny.make_docs(12, seed=1, min_len=2, max_len=40)
    whole = [tiny.collate(docs)]
    split = [tiny.collate(docs[:1]), tiny.collate(docs[1:9]), tiny.collate(docs[9:])]
    counts = [b.num_loss_tokens for b in split]
    assert max(counts) > 5 * min(counts)  # very different loss-token counts

    one = _trainer(tiny, tmp_path / "a", whole)
    many = _trainer(tiny, tmp_path / "b", split)
    s1, sk = one.forward_backward(whole), many.forward_backward(split)
    s1.read(), sk.read()
    g1, gk = tiny.flat_grad(one.model), tiny.flat_grad(many.model)
    assert ((g1 - gk).abs().max() / g1.abs().max()).item() <= 1e-6
    assert s1["loss_tokens"] == sk["loss_tokens"] == sum(counts)
    assert sk["loss"] == pytest.approx(s1["loss"], rel=1e-6)

    # Negative control: the mean of micro-batch means weights tokens of small batches more.
    model = tiny.TinyLM()
    for b in split:
        losses = model.token_losses(b)
        (losses.sum() / b.num_loss_tokens / len(split)).backward()
    assert ((g1 - tiny.flat_grad(model)).abs().max() / g1.abs().max()).item() > 1e-3


def test_loss_tokens_per_step_groups_batches(tiny, tmp_path):
    sizes = [5, 3, 10, 2, 2, 7]
    batches = [tiny.batch_with_loss_tokens(n, seed=i) for i, n in enumerate(sizes)]
    t = _trainer(tiny, tmp_path, batches, _cfg(loss_tokens_per_step=8, max_steps=3))
    assert [[b.num_loss_tokens for b in t.next_step().batches] for _ in range(3)] == [[5, 3], [10], [2, 2, 7]]

    t = _trainer(tiny, tmp_path, batches, _cfg(loss_tokens_per_step=8, max_steps=3))
    t.run()
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["batches"], r["loss_tokens"]) for r in recs] == [(2, 8), (1, 10), (3, 11)]

    # 5 + 9 would overshoot 8 by 6, more than 5 falls short (3): the 9 waits for the next step
    batches = [tiny.batch_with_loss_tokens(n, seed=i) for i, n in enumerate([5, 9, 4, 3, 6])]
    t = _trainer(tiny, tmp_path, batches, _cfg(loss_tokens_per_step=8, max_steps=3))
    assert [[b.num_loss_tokens for b in t.next_step().batches] for _ in range(3)] == [[5], [9], [4, 3]]


def test_grad_accum_batches_groups_batches(tiny, tmp_path):
    batches = [tiny.batch_with_loss_tokens(n, seed=n) for n in (1, 2, 3, 4, 5)]
    t = _trainer(tiny, tmp_path, batches, _cfg(grad_accum_batches=2))
    result = t.run()  # no limit: one epoch of 5 batches = 3 steps, the last one short
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["loss_tokens"] for r in recs] == [3, 7, 5]
    assert result.stop_reason == "max_epochs" and result.summary["steps"] == 3


# -------------------------------------------------------------------------- the update
def test_lr_multipliers_are_applied(tiny, tmp_path):
    cfg = _cfg(lr=0.1, schedule="constant", lr_mult_embeddings=0.5, lr_mult_head=3.0, max_steps=1)
    t = _trainer(tiny, tmp_path, [tiny.collate(tiny.make_docs(4))], cfg)
    t.run()
    lrs = {g["name"]: g["lr"] for g in t.optimizer.param_groups}
    assert lrs["embeddings.no_decay"] == pytest.approx(0.05)
    assert lrs["blocks.decay"] == pytest.approx(0.1)
    assert lrs["head.decay"] == pytest.approx(0.3)


def test_non_finite_loss_skips_the_step(tiny, tmp_path):
    batches = [tiny.collate(tiny.make_docs(4, seed=s)) for s in range(3)]
    t = _trainer(tiny, tmp_path, batches, _cfg(max_steps=3))
    t.model.poison_calls = {1}  # the second step's forward returns NaN
    before = {}
    seen = []

    def after_step(result):
        step = t.state.step
        seen.append((step, result.outcome))
        if step == 1:
            before.update({k: v.clone() for k, v in t.model.state_dict().items()})
        if step == 2:
            after = t.model.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before)

    t.after_step = after_step
    result = t.run()
    assert seen == [(1, StepOutcome.APPLIED), (2, StepOutcome.SKIPPED), (3, StepOutcome.APPLIED)]
    assert t.state.skipped_steps == 1 and result.summary["skipped_steps"] == 1
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert recs[1]["loss"] is None and recs[1]["outcome"] == "skipped"
    assert recs[1]["documents"] == [] and "documents" not in recs[0]  # hand-made batches name no documents
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])  # strict JSON (no NaN)


class ScriptedGuard:
    """A guard that records what it is asked and answers from a script."""

    def __init__(self, verdicts):
        self.verdicts, self.calls = list(verdicts), []

    def check(self, loss, grad_norm):
        self.calls.append((loss, grad_norm))
        return self.verdicts[len(self.calls) - 1]

    def state_dict(self):
        return {"calls": len(self.calls)}

    def load_state_dict(self, d):
        pass


def test_the_guard_receives_loss_and_norm_and_its_verdict_is_the_outcome(tiny, tmp_path):
    guard = ScriptedGuard([Verdict.OK, Verdict.ROLLBACK, Verdict.OK])
    t = _trainer(tiny, tmp_path, [tiny.collate(tiny.make_docs(4, seed=s)) for s in range(3)], _cfg(max_steps=3), guard=guard)
    t.run()
    assert len(guard.calls) == 3 and all(math.isfinite(loss) and g > 0 for loss, g in guard.calls)
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["outcome"] for r in recs] == ["applied", "rollback", "applied"]
    assert t.state.skipped_steps == 1


def test_a_step_without_loss_tokens_is_empty_not_an_anomaly(tiny, tmp_path):
    """0/0 is no reason to skip, roll back or lower the learning rate: the step is empty."""
    docs = tiny.make_docs(3, seed=4)
    empty = tiny.collate(docs)
    empty = type(empty)(empty.input_ids, torch.full_like(empty.labels, -100), empty.positions, 0, empty.num_real_tokens)
    batches = [tiny.collate(tiny.make_docs(3, seed=5)), empty, empty, empty, tiny.collate(docs)]
    guard = ScriptedGuard([Verdict.OK] * 5)
    t = _trainer(tiny, tmp_path, batches, _cfg(max_steps=5), guard=guard)
    weights = {}
    t.after_step = lambda r: weights.setdefault(t.state.step, [p.detach().clone() for p in t.model.parameters()])
    t.run()
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["outcome"] for r in recs] == ["applied", "empty", "empty", "empty", "applied"]
    assert len(guard.calls) == 2  # never asked about an empty step
    assert all(torch.equal(a, b) for a, b in zip(weights[1], weights[4]))  # no update
    assert (t.state.skipped_steps, t.state.empty_steps, t.state.lr_scale) == (0, 3, 1.0)
    assert recs[1]["loss_tokens"] == 0 and recs[1]["loss"] is None


# ------------------------------------------------------------------------------ stopping
@pytest.mark.parametrize(
    "kw, steps, reason",
    [
        (dict(max_steps=4), 4, "max_steps"),
        (dict(max_epochs=0.5), 3, "max_epochs"),
        (dict(max_epochs=2.0), 12, "max_epochs"),
        (dict(), 6, "max_epochs"),  # nothing set: one epoch
        (dict(max_steps=100, max_epochs=1.5), 9, "max_epochs"),
    ],
)
def test_stops_at_steps_or_epochs(tiny, tmp_path, kw, steps, reason):
    loader = tiny.ListLoader([tiny.collate(tiny.make_docs(2, seed=s)) for s in range(6)])
    result = _trainer(tiny, tmp_path, loader, _cfg(**kw)).run()
    assert (result.summary["steps"], result.stop_reason) == (steps, reason)
    assert loader.position == steps  # no batch drawn beyond the last step


def test_stops_at_max_tokens(tiny, tmp_path):
    batches = [tiny.collate(tiny.make_docs(2, seed=s)) for s in range(6)]
    per = [b.num_real_tokens for b in batches]
    limit = per[0] + per[1] + 1  # reached during the third step
    result = _trainer(tiny, tmp_path, tiny.ListLoader(batches), _cfg(max_tokens=limit)).run()
    assert (result.summary["steps"], result.stop_reason) == (3, "max_tokens")
    assert result.summary["real_tokens"] == sum(per[:3])


def test_should_stop_finishes_the_step_and_skips_final_eval(tiny, tmp_path):
    batches = [tiny.collate(tiny.make_docs(2, seed=s)) for s in range(6)]

    t = _trainer(tiny, tmp_path, tiny.ListLoader(batches), _cfg(max_steps=5), eval_data=batches[:2])

    def after_step(result):
        if t.state.step == 2:
            t.should_stop = True  # what a SIGTERM handler does

    t.after_step = after_step
    result = t.run()
    assert (result.stop_reason, result.summary["steps"]) == ("interrupted", 2)
    assert not [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "eval"]


# ---------------------------------------------------------------------- outputs and eval
def test_metrics_records_and_eval(tiny, tmp_path):
    batches = [tiny.collate(tiny.make_docs(3, seed=s)) for s in range(4)]
    t = _trainer(
        tiny,
        tmp_path,
        tiny.ListLoader(batches),
        _cfg(max_steps=4),
        EvalConfig(every_steps=2),
        eval_data=lambda: iter(batches[:2]),
        evaluate_fn=lambda model: {"accuracy": 0.75},
    )
    result = t.run()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    keys = {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "loss_tokens",
        "real_tokens",
        "slot_tokens",
        "fill_rate",
        "tokens_per_s",
        "elapsed_s",
        "epoch",
    }
    assert all(keys <= r.keys() for r in train)
    assert train[0]["real_tokens"] == batches[0].num_real_tokens and train[0]["slot_tokens"] == batches[0].num_slots
    assert train[0]["fill_rate"] == pytest.approx(batches[0].fill_rate)
    assert train[-1]["epoch"] == 1.0
    assert [e["step"] for e in evals] == [2, 4]  # the end coincides with step 4: no duplicate
    e = evals[-1]
    assert {"loss", "ppl", "tokens", "accuracy"} <= e.keys() and e["accuracy"] == 0.75
    assert e["ppl"] == pytest.approx(math.exp(e["loss"]))
    assert e["tokens"] == batches[0].num_loss_tokens + batches[1].num_loss_tokens
    assert result.summary["final_eval"]["loss"] == e["loss"]
    assert "accuracy" in result.text and str(tmp_path) in result.text


def test_early_stopping_with_patience(tiny, tmp_path):
    scripted = iter([3.0, 2.0, 2.5, 2.1, 1.0])
    batches = [tiny.collate(tiny.make_docs(2, seed=s)) for s in range(3)]
    t = _trainer(
        tiny,
        tmp_path,
        tiny.ListLoader(batches),
        _cfg(max_steps=10),
        EvalConfig(every_steps=1, patience=2),
        evaluate_fn=lambda model: {"loss": next(scripted)},
    )
    result = t.run()
    assert (result.stop_reason, result.summary["steps"]) == ("early_stopping", 4)
    assert t.state.best_eval_loss == 2.0


def test_bf16_autocast_runs_on_cpu_and_fp16_is_refused(tiny, tmp_path):
    batches = [tiny.collate(tiny.make_docs(3, seed=s)) for s in range(2)]
    result = _trainer(tiny, tmp_path, batches, _cfg(precision="bf16", max_steps=2), eval_data=batches).run()
    assert math.isfinite(result.summary["final_loss"]) and math.isfinite(result.summary["final_eval"]["loss"])
    with pytest.raises(ConfigError, match="fp16"):
        _trainer(tiny, tmp_path, batches, _cfg(precision="fp16"))


# ------------------------------------------------------------------ determinism and state
def test_two_identical_runs_give_bitwise_equal_losses_and_leave_global_rng_alone(tiny, tmp_path):
    batches = [tiny.collate(tiny.make_docs(5, seed=s)) for s in range(4)]
    rng = torch.get_rng_state()
    for name in ("a", "b"):
        _trainer(tiny, tmp_path / name, tiny.ListLoader(batches), _cfg(max_steps=6, grad_accum_batches=2)).run()
    assert torch.equal(rng, torch.get_rng_state())
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == 6 and a == b  # exact float equality


def test_state_round_trip_resumes_exactly(tiny, tmp_path):
    batches = [tiny.collate(tiny.make_docs(3, seed=s)) for s in range(5)]
    cfg = _cfg(max_steps=6, warmup_steps=2)
    _trainer(tiny, tmp_path / "full", tiny.ListLoader(batches), cfg).run()

    saved = {}
    first = _trainer(tiny, tmp_path / "resumed", tiny.ListLoader(batches), cfg)

    def checkpoint_and_stop(result):
        if first.state.step == 3:
            saved.update(first.state_dict())
            first.should_stop = True

    first.after_step = checkpoint_and_stop
    first.run()
    state = json.loads(json.dumps(saved["trainer"]))  # the trainer part is JSON-able
    assert set(state) == {"counters", "scaler", "data", "guard", "clipper"}
    assert state["counters"]["step"] == 3 and state["counters"]["total_steps"] == 6
    assert state["data"] == {"seen": 3, "inner": {"position": 3}}

    second = _trainer(tiny, tmp_path / "resumed", tiny.ListLoader(batches), cfg)
    second.load_state_dict({"model": saved["model"], "optimizer": saved["optimizer"], "trainer": state})
    second.run()
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "full")  # appended after step 3, bit for bit


def test_stateful_hooks_are_saved_and_restored(tiny, tmp_path):
    class Guard:
        def __init__(self):
            self.seen = 0

        def check(self, loss, grad_norm):
            self.seen += 1
            return "ok"

        def state_dict(self):
            return {"seen": self.seen}

        def load_state_dict(self, d):
            self.seen = d["seen"]

    class Clipper(Guard):
        def step(self, norm):
            self.seen += 1
            return 0.5

    batches = [tiny.collate(tiny.make_docs(2, seed=s)) for s in range(3)]
    guard, clipper = Guard(), Clipper()
    t = _trainer(tiny, tmp_path, tiny.ListLoader(batches), _cfg(max_steps=2), guard=guard, clipper=clipper)
    t.run()
    state = t.trainer_state()
    assert state["guard"] == {"seen": 2} and state["clipper"] == {"seen": 2} and state["data"]["inner"] == {"position": 2}
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert all(r["grad_norm"] > 0 and r["clip_limit"] == 0.5 for r in recs)
    g2, c2 = Guard(), Clipper()
    t2 = _trainer(tiny, tmp_path, tiny.ListLoader(batches), _cfg(max_steps=2), guard=g2, clipper=c2)
    t2.load_trainer_state(state)
    assert (g2.seen, c2.seen, t2.data.batches.position, t2.state.step) == (2, 2, 2, 2)
    with pytest.raises(KeyError, match="clipper"):
        t2.load_trainer_state({k: v for k, v in state.items() if k != "clipper"})


# ------------------------------------------------------------------ several ranks, faked
class _FakeRanks(Distributed):
    """Rank ``rank`` of a two-rank world whose other rank contributed ``other`` to every all-reduce
    (recorded from that rank's own pass): the loop's normaliser, not torch.distributed, is under test."""

    def __init__(self, other: list):
        super().__init__(rank=0, world_size=2)
        self.other, self.seen = list(other), []

    def all_reduce(self, t, op="sum"):
        self.seen.append(t.detach().clone())
        return t + self.other.pop(0).to(t.device) if self.other else t

    def agree(self, flag):
        return flag


def test_two_ranks_normalise_by_the_tokens_of_both(tiny, tmp_path):
    """Rank gradients averaged (as DDP does) equal the one-process gradient of all the step's batches,
    and both ranks log the one-process loss: sum of per-token losses of both / loss tokens of both."""
    docs = tiny.make_docs(10, seed=2, min_len=2, max_len=30)
    a, b = [tiny.collate(docs[:2]), tiny.collate(docs[2:3])], [tiny.collate(docs[3:])]  # very unequal shares
    recorders = []
    for mine in (a, b):  # each rank's own contributions to the all-reduces
        rec = _FakeRanks([])
        _trainer(tiny, tmp_path / f"r{len(recorders)}", mine, dist=rec).forward_backward(mine)
        recorders.append(rec.seen)
    grads, stats = [], []
    for mine, other in ((a, recorders[1]), (b, recorders[0])):
        t = _trainer(tiny, tmp_path / "x", mine, dist=_FakeRanks(other))
        stats.append(t.forward_backward(mine))
        stats[-1].read()
        grads.append(tiny.flat_grad(t.model))
    one = _trainer(tiny, tmp_path / "one", a + b)
    s1 = one.forward_backward(a + b)
    s1.read()
    g1 = tiny.flat_grad(one.model)
    mean = (grads[0] + grads[1]) / 2  # DDP's average over ranks
    assert ((mean - g1).abs().max() / g1.abs().max()).item() <= 1e-6
    assert stats[0]["loss"] == pytest.approx(s1["loss"], rel=1e-12) and stats[1]["loss"] == pytest.approx(s1["loss"], rel=1e-12)
    assert stats[0]["loss_tokens"] == stats[1]["loss_tokens"] == s1["loss_tokens"]


def test_the_last_record_holds_the_run_s_peak_memory_and_attention_kernels(tiny, tmp_path):
    """metrics.jsonl ends with ``"kind": "run"``: each rank's true peak memory and the kernels its layers ran
    (none here: the tiny model has no attention; tests/model/test_torch_releases.py checks the record of
    ``attend``); the summary shows the peak."""
    batches = [tiny.collate(tiny.make_docs(3, seed=s)) for s in range(2)]
    result = _trainer(tiny, tmp_path, tiny.ListLoader(batches), _cfg(max_steps=2)).run()
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert last["kind"] == "run" and last["step"] == 2 and last["stop_reason"] == result.stop_reason
    assert len(last["memory_peak"]) == 1 and last["memory_peak"][0]["mem_peak_rss_gb"] > 0  # CPU: no CUDA figures
    assert last["attention"] == [] and result.summary["attention"] == {}
    assert result.summary["memory_peak"] == last["memory_peak"] and "peak memory      rank 0:" in result.text


def test_a_trainer_built_with_lr_auto_trains_only_once_it_takes_a_rate(tiny, tmp_path):
    """``train.lr: auto`` is no placeholder: the trainer refuses to run until ``set_lr`` gives it the range
    test's rate, and then trains as one built with that rate does (the loop sets every group's rate each step)."""
    docs = tiny.make_docs(8, seed=3, min_len=2, max_len=30)
    batches = [tiny.collate(docs[:4]), tiny.collate(docs[4:])]
    auto = _trainer(tiny, tmp_path / "auto", batches, _cfg(lr="auto", max_steps=2))
    with pytest.raises(ValueError, match="set_lr"):
        auto.run()
    auto.set_lr(_cfg().lr)
    auto.run()
    given = _trainer(tiny, tmp_path / "given", batches, _cfg(max_steps=2))
    given.run()
    assert _losses(tmp_path / "auto") == _losses(tmp_path / "given")
    assert all(torch.equal(a, b) for a, b in zip(auto.model.parameters(), given.model.parameters()))
