"""Schedules: batch-size ramp and back-off (fractions, decisions, state, trainer hooks), per-group and layer-wise rates."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support import random_store

from densebatch.config import ConfigError, EvalConfig, GroupScheduleConfig, ModelConfig, TrainConfig, load_config
from densebatch.data.load.collate import CausalCollator
from densebatch.data.load.loader import StepLoader
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.steps import StepSettings
from densebatch.model import build_model
from densebatch.train.checkpoint.manager import CheckpointManager
from densebatch.train.guard import Verdict
from densebatch.train.loop import Trainer
from densebatch.train.observe.monitor import read_metrics
from densebatch.train.optim import estimate_total_steps, group_lr_at, lr_at, param_groups
from densebatch.train.parts import Evaluation, Placement, Reporting, StepParts
from densebatch.train.schedule import BatchSchedule
from densebatch.train.session import Session


# ---------------------------------------------------------------------------------- fractions
def test_ramp_in_steps_is_linear_from_start_to_one():
    s = BatchSchedule(ramp_steps=20, ramp_start=0.25)
    assert s.fraction(0) == 0.25
    for n in range(20):
        assert s.fraction(n) == pytest.approx(0.25 + 0.75 * n / 20)
    assert [s.fraction(n) for n in (20, 21, 10_000)] == [1.0, 1.0, 1.0]


def test_ramp_in_tokens_is_linear_in_the_data_consumed():
    s = BatchSchedule(ramp_steps=10, ramp_start=0.2, ramp_unit="tokens")
    consumed, n = 0.0, 0  # full steps' worth of data before step n, summed here independently
    while consumed < 10:
        assert s.fraction(n) == pytest.approx(0.2 + 0.8 * consumed / 10, rel=1e-12), n
        consumed, n = consumed + s.fraction(n), n + 1
    assert s.fraction(n) == 1.0 and s.fraction(n - 1) < 1.0
    assert n > 10  # smaller first steps: a ramp over 10 steps' worth of tokens takes more than 10 steps
    later = [s.fraction(k) for k in range(n + 5)]
    assert BatchSchedule(ramp_steps=10, ramp_start=0.2, ramp_unit="tokens").fraction(n + 4) == later[-1]  # any order


def test_steps_for_counts_the_ramps_smaller_steps():
    assert BatchSchedule().steps_for(7.0) == 7
    s = BatchSchedule(ramp_steps=4, ramp_start=0.5)  # 0.5 + 0.625 + 0.75 + 0.875 = 2.75 full steps in 4
    assert s.steps_for(2.75) == 4 and s.steps_for(2.8) == 5 and s.steps_for(10.0) == 4 + math.ceil(10 - 2.75)
    cfg = TrainConfig(max_epochs=1.0)
    assert estimate_total_steps(cfg, 10, 100, s) == 4 + math.ceil(10 - 2.75)
    # a token limit: the first step (half a full step) held 100 tokens, so a full step holds 200
    assert estimate_total_steps(TrainConfig(max_tokens=2000), None, 100, s) == s.steps_for(10.0)


@pytest.mark.parametrize("rule, expected", [("none", 1.0), ("sqrt", 0.5), ("linear", 0.25)])
def test_lr_follows_the_fraction_by_the_configured_rule(rule, expected):
    assert BatchSchedule(ramp_steps=8, ramp_start=0.25, lr_scaling=rule).lr_factor(0) == expected


# ----------------------------------------------------------------------------------- back-off
def test_backoff_after_patience_evaluations_without_a_new_best():
    s = BatchSchedule(backoff_patience=2, backoff_factor=0.5, backoff_floor=0.2, backoff_max=5)
    decisions = [s.observe_eval(loss, next_step=10 * i) for i, loss in enumerate([3.0, 2.0, 2.5, 2.1, 1.9, 1.95, 1.9])]
    assert [d is not None for d in decisions] == [False, False, False, True, False, False, True]
    assert s.changes == ((30, 0.5), (60, 0.25))
    assert [s.fraction(n) for n in (29, 30, 59, 60, 1000)] == [1.0, 0.5, 0.5, 0.25, 0.25]
    for i in range(4):  # the floor, then no more changes
        s.observe_eval(5.0, 100 + i)
    assert s.changes[-1] == (101, 0.2) and len(s.changes) == 3
    assert s.observe_eval(float("nan"), 200) is None and s.bad_evals == 2  # a non-finite eval is ignored


def test_growth_with_a_factor_above_one_stops_at_the_cap_and_the_limit():
    s = BatchSchedule(backoff_patience=1, backoff_factor=2.0, backoff_cap=3.0, backoff_max=2)
    for i, loss in enumerate([1.0, 1.0, 1.0, 1.0, 1.0]):
        s.observe_eval(loss, i)
    assert s.changes == ((1, 2.0), (2, 3.0))


def test_state_round_trip_gives_the_same_fractions_after_a_change_mid_ramp():
    a = BatchSchedule(ramp_steps=12, ramp_start=0.25, ramp_unit="tokens", backoff_patience=1, backoff_factor=0.5)
    before = [a.fraction(n) for n in range(6)]
    a.observe_eval(2.0, 3)
    assert a.observe_eval(2.0, 6) is not None  # applies from loader step 6
    assert [a.fraction(n) for n in range(6)] == before  # the past is unchanged
    b = BatchSchedule(ramp_steps=12, ramp_start=0.25, ramp_unit="tokens", backoff_patience=1, backoff_factor=0.5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [b.fraction(n) for n in range(60)] == [a.fraction(n) for n in range(60)]
    assert a.fraction(6) < a.fraction(5)  # halved mid-ramp; the ramp goes on from there
    assert (b.best_loss, b.bad_evals) == (2.0, 0)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["--train.batch_schedule.ramp_steps=5", "--train.batch_schedule.ramp_start=0"], "train.batch_schedule.ramp_start"),
        (["--train.batch_schedule.ramp_steps=5", "--train.batch_schedule.ramp_start=1.5"], "train.batch_schedule.ramp_start"),
        (["--train.batch_schedule.backoff_patience=2"], "eval.every_steps"),
        (
            ["--train.batch_schedule.backoff_patience=2", "--eval.every_steps=5", "--train.batch_schedule.backoff_factor=1"],
            "backoff_factor",
        ),
        (
            ["--train.batch_schedule.backoff_patience=2", "--eval.every_steps=5", "--train.batch_schedule.backoff_floor=0"],
            "backoff_floor",
        ),
        (["--train.layer_lr_decay=1.5"], "train.layer_lr_decay"),
        (["--train.batch_schedule.ramp_unit=epochs"], "train.batch_schedule.ramp_unit"),
        (["--train.embeddings.schedule=step"], "train.embeddings.schedule"),
    ],
)
def test_schedule_keys_are_checked(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_schedule_from_config_only_when_asked_for():
    assert BatchSchedule.from_config(TrainConfig().batch_schedule) is None
    t = load_config(
        None,
        [
            "--train.batch_schedule.ramp_steps=20",
            "--train.batch_schedule.ramp_start=0.25",
            "--train.batch_schedule.lr_scaling=linear",
        ],
    ).train
    s = BatchSchedule.from_config(t.batch_schedule)
    assert (s.fraction(0), s.fraction(20), s.lr_factor(0)) == (0.25, 1.0, 0.25)
    assert (t.embeddings.schedule, t.head.warmup_steps) == ("same", None)
    t = load_config(None, ["--train.head.schedule=constant", "--train.head.warmup_steps=0"]).train
    assert t.head == GroupScheduleConfig(schedule="constant", warmup_steps=0) and t.blocks == GroupScheduleConfig()


# ------------------------------------------------------------------------ in the trainer
def _loader(prefetch=2):  # 2 packed rows of 32 per batch, 4 batches per step: 8 rows
    settings = PlanSettings(strategy="packed", seq_len=32, max_tokens_per_batch=64)
    return StepLoader(
        random_store(80, vocab=30, lengths=(4, 40)),
        settings=settings,
        collator=CausalCollator(pad_id=0),
        seed=1,
        steps=StepSettings(4),
        prefetch=prefetch,
    )


class ScriptedEval:
    """``evaluate_fn`` returning the given eval losses in turn (the eval record's ``loss``)."""

    def __init__(self, losses):
        self.losses = list(losses)

    def __call__(self, model):
        return {"loss": self.losses.pop(0)}


def _run(tiny, tmp_path, schedule, steps=12, losses=(), every=2, stop_at=None, state=None):
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, schedule="constant", max_steps=steps, progress=False, device="cpu")
    t = Trainer(
        tiny.TinyLM(),
        _loader(),
        cfg,
        output_dir=tmp_path,
        evaluation=Evaluation(cfg=EvalConfig(every_steps=every), extra=ScriptedEval(losses)),
        placement=Placement("cpu"),
        parts=StepParts(batch_schedule=schedule),
        reporting=Reporting(console=False),
    )
    if state is not None:
        t.load_state_dict(state)
    rows, saved = [], {}

    def after(result):
        rows.append(sum(b.input_ids.shape[0] for b in result.step.batches))
        if t.state.step == stop_at:
            saved.update(t.state_dict())
            t.should_stop = True

    t.after_step = after
    t.run()
    return t, rows, saved


def test_trainer_ramps_backs_off_and_records_every_change(tiny, tmp_path):
    schedule = BatchSchedule(ramp_steps=4, ramp_start=0.25, backoff_patience=1, backoff_factor=0.5, lr_scaling="sqrt")
    t, rows, _ = _run(tiny, tmp_path, schedule, losses=[3.0, 2.0, 2.5, 1.0, 1.0, 1.0])
    # ramp 0.25, 0.4375, 0.625, 0.8125 of 8 rows (rounded to whole rows), then 8; eval at 6 (2.5 > 2.0): 4 from
    # step 7; evals at 10 and 12 (1.0, not below 1.0 at step 8): 2 rows from step 11, 1 from step 13 (after the run)
    assert rows == [2, 4, 5, 7, 8, 8, 4, 4, 4, 4, 2, 2]
    recs = read_metrics(tmp_path / "metrics.jsonl")
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["batch_fraction"] for r in train[:7]] == [0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0, 0.5]
    assert [r["lr"] for r in train[:7:6]] == pytest.approx([1e-2 * 0.5, 1e-2 * 0.5**0.5])  # sqrt of 0.25 and 0.5
    events = [(r["step"], r["fraction"], r["reason"]) for r in recs if r["kind"] == "batch_size"]
    assert events == [
        (0, 0.25, "ramp_start"),
        (4, 1.0, "ramp_end"),
        (6, 0.5, "backoff"),
        (10, 0.25, "backoff"),
        (12, 0.125, "backoff"),
    ]
    assert t.trainer_state()["batch_schedule"]["changes"] == [[6, 0.5], [10, 0.25], [12, 0.125]]


def test_trainer_resume_mid_ramp_and_after_a_backoff_is_exact(tiny, tmp_path):
    def schedule():
        return BatchSchedule(ramp_steps=6, ramp_start=0.25, ramp_unit="tokens", backoff_patience=1, lr_scaling="sqrt")

    losses = [3.0, 2.0, 2.5, 1.5, 1.6, 1.0, 1.1]
    full, full_rows, _ = _run(tiny, tmp_path / "full", schedule(), steps=14, losses=losses)
    reference = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if r["kind"] == "train"]
    for cut in (3, 8):  # mid-ramp; after the first back-off (at step 6)
        out = tmp_path / f"cut{cut}"
        _, rows_a, saved = _run(tiny, out, schedule(), steps=14, losses=losses, stop_at=cut)
        state = json.loads(json.dumps(saved["trainer"]))
        resumed = {"model": saved["model"], "optimizer": saved["optimizer"], "trainer": state}
        _, rows_b, _ = _run(tiny, out, schedule(), steps=14, losses=losses[cut // 2 :], state=resumed)
        got = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
        assert rows_a + rows_b == full_rows
        assert [(r["loss"], r["batch_fraction"], r["lr"]) for r in got] == [
            (r["loss"], r["batch_fraction"], r["lr"]) for r in reference
        ]


class RollbackAt:
    """A guard whose verdict is a rollback at the given step (1-based), OK otherwise."""

    def __init__(self, step):
        self.step, self.calls = step, 0

    def check(self, loss, grad_norm):
        self.calls += 1
        return Verdict.ROLLBACK if self.calls == self.step else Verdict.OK

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, d):
        self.calls = d["calls"]


def test_a_rollback_keeps_the_schedule_and_the_data_position(tiny, tmp_path):
    """A back-off decided after the checkpoint the rollback returns to stays in force, as the data position does."""
    schedule = BatchSchedule(backoff_patience=1, backoff_factor=0.5)
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, schedule="constant", max_steps=5, progress=False, device="cpu", grad_clip=0.0)
    t = Trainer(
        tiny.TinyLM(),
        _loader(),
        cfg,
        output_dir=tmp_path,
        evaluation=Evaluation(cfg=EvalConfig(every_steps=1), extra=ScriptedEval([2.0, 1.0, 1.5, 0.9, 0.8, 0.7])),
        placement=Placement("cpu"),
        parts=StepParts(batch_schedule=schedule, guard=RollbackAt(3)),
        reporting=Reporting(console=False),
    )
    session = Session(t, checkpoints=CheckpointManager(tmp_path / "checkpoints"), every_steps=2)
    rows = []
    t.after_step = lambda result: (
        rows.append(sum(b.input_ids.shape[0] for b in result.step.batches)),
        session.after_step(result),
    )
    t.run()
    # step 3: eval 1.5 > 1.0 halves the step from loader step 3 on; its verdict rolls back to the checkpoint of step 2
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["kind"] for r in recs if r["kind"] in ("batch_size", "rollback")] == ["batch_size", "rollback"]
    assert schedule.changes == ((3, 0.5),) and t.data.state_dict()["steps"] == len(rows) == 6
    assert rows == [8, 8, 8, 4, 4, 4]  # the steps after the rollback are at the halved size
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 3, 4, 5]  # step numbers restart at 2


def test_a_schedule_needs_a_step_loader(tiny, tmp_path):
    with pytest.raises(ValueError, match="StepLoader"):
        Trainer(
            tiny.TinyLM(),
            [tiny.collate(tiny.make_docs(2))],
            TrainConfig(device="cpu"),
            output_dir=tmp_path,
            parts=StepParts(batch_schedule=BatchSchedule(ramp_steps=2)),
        )


# ------------------------------------------------------------------- per-group and layer-wise
def test_group_schedules_default_to_the_train_schedule_and_can_differ():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    for step in range(0, 40, 3):
        assert group_lr_at(step, cfg, 40, "blocks") == lr_at(step, cfg, 40)
    cfg = TrainConfig(
        lr=1.0, warmup_steps=4, embeddings=GroupScheduleConfig(schedule="constant", warmup_steps=0),
        head=GroupScheduleConfig(warmup_steps=0, min_lr_ratio=0.0),
    )  # fmt: skip
    assert [group_lr_at(s, cfg, 40, "embeddings") for s in (0, 20, 39)] == [1.0, 1.0, 1.0]
    assert group_lr_at(0, cfg, 40, "head") == 1.0 and group_lr_at(40, cfg, 40, "head") == 0.0
    assert group_lr_at(20, cfg, 40, "head") == pytest.approx(0.5)  # cosine half way from its own start (no warm-up)
    assert group_lr_at(0, cfg, 40, "blocks") == 0.25  # the train warm-up


def _gpt(n_layer=4):
    return build_model(ModelConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=32), 40)


def test_layer_wise_decay_gives_each_block_its_groups_and_every_parameter_once():
    model = _gpt()
    groups = param_groups(model, TrainConfig(layer_lr_decay=0.5, lr_mult_blocks=2.0))
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    mults = {g["name"]: g["lr_mult"] for g in groups}
    for i in range(4):
        assert mults[f"blocks.{i}.decay"] == mults[f"blocks.{i}.no_decay"] == 2.0 * 0.5 ** (3 - i)
        assert {id(p) for p in model.blocks[i].parameters()} == {
            id(p) for g in groups if g["name"].startswith(f"blocks.{i}.") for p in g["params"]
        }
    assert "blocks.decay" not in mults and mults["embeddings.no_decay"] == 1.0


def test_run_with_layer_wise_decay_shows_rates_falling_by_the_factor_per_block(tmp_path):
    """The issue's check: in the optimizer's groups, each block below the top learns at decay x the one above."""
    model = _gpt()
    batch = _loader(prefetch=0)
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, max_steps=2, layer_lr_decay=0.7, progress=False, device="cpu",
                      head=GroupScheduleConfig(schedule="constant"))  # fmt: skip
    t = Trainer(model, batch, cfg, output_dir=tmp_path, placement=Placement("cpu"), reporting=Reporting(console=False))
    t.run()
    lr = {g["name"]: g["lr"] for g in t.optimizer.param_groups}
    top = lr["blocks.3.decay"]
    assert top == pytest.approx(lr_at(1, cfg, 2))
    for i in range(3):
        assert lr[f"blocks.{i}.decay"] / lr[f"blocks.{i + 1}.decay"] == pytest.approx(0.7)
    rec = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"][-1]
    assert rec["lr_groups"]["blocks.0"] == pytest.approx(top * 0.7**3) and rec["lr_groups"]["head"] == 1e-3
    assert torch.isfinite(torch.tensor(rec["loss"]))
