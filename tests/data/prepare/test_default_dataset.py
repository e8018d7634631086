"""The embedded default dataset: deterministic, unique prompts, short checkable answers, long-tailed lengths."""

from __future__ import annotations

import numpy as np
import pytest

import densebatch.data.prepare.default_dataset as dd
from densebatch.data.prepare.default_dataset import TASKS, check_answer, generate_records
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.templates import alpaca_prompt
from densebatch.errors import ConfigError

COLORS = ("red", "green", "blue", "yellow", "black", "white")  # black and white: no longer answers, never in passages


def test_deterministic_from_the_seed():
    assert generate_records(300, seed=7) == generate_records(300, seed=7)
    assert generate_records(300, seed=7) != generate_records(300, seed=8)


def test_records_are_alpaca_with_unique_prompts_and_short_answers():
    recs = generate_records(6000, seed=1234)
    assert len(recs) == 6000
    assert len({(r["instruction"], r["input"]) for r in recs}) == 6000
    assert {r["task"] for r in recs} == set(TASKS)
    assert all(set(r) == {"instruction", "input", "output", "task"} and r["output"] for r in recs)
    assert max(len(r["output"].encode()) for r in recs) <= 12


def test_answers_are_right():
    for r in generate_records(2000, seed=3):
        task, inp, out = r["task"], r["input"], r["output"]
        if task == "key":
            assert out == ("yes" if "KEY" in inp.split() else "no")
            assert not inp.startswith("KEY")  # the same token every time: " KEY"
        elif task == "color":
            named = [w for w in inp.split() if w in COLORS]
            assert named == [out] and out != inp.split()[0]  # one color, never first: always " <color>"
        elif task == "upper":
            assert out == ("yes" if inp.isupper() else "no")
        elif task == "parity":
            (number,) = [w for w in inp.split() if w.isdigit()]  # exactly one number, one digit, never first
            assert len(number) == 1 and number != inp.split()[0] and out == ("even" if int(number) % 2 == 0 else "odd")
        assert check_answer(r, f"  {out}\n") and check_answer(r, out + "<|endoftext|>junk")
        assert not check_answer(r, out + "x")


def test_no_passage_word_starts_with_a_color():
    """A learned BPE splits "redo" into " red" + "o": the model would see a second color."""
    for r in generate_records(3000, seed=5):
        if r["task"] in ("key", "color", "parity"):
            words = [w for w in r["input"].split() if w.startswith(COLORS)]
            assert words == ([r["output"]] if r["task"] == "color" else [])


def test_both_answers_of_binary_tasks_are_common():
    recs = generate_records(6000, seed=1234)
    for task in ("key", "upper", "parity"):
        outs = [r["output"] for r in recs if r["task"] == task]
        for value in set(outs):
            assert 0.4 < outs.count(value) / len(outs) < 0.6, (task, value)


def test_every_task_keeps_its_share_to_the_end_of_a_long_list():
    """Duplicate draws of a small task used to drop it from the mix half-way through 20,000 records."""
    recs = generate_records(20000, seed=1234)
    total = sum(w for _, w in TASKS.values())
    for half in (recs[:10000], recs[10000:]):
        for task, (_, weight) in TASKS.items():
            share = sum(r["task"] == task for r in half) / len(half)
            assert abs(share - weight / total) < 0.03, (task, share)


def test_a_task_out_of_prompts_leaves_the_mix_and_too_many_records_is_an_error(monkeypatch):
    tiny = lambda rng: ("Pick a digit.", str(rng.randint(0, 9)), "ok")  # noqa: E731 - only 10 prompts
    monkeypatch.setattr(dd, "TASKS", {"tiny": (tiny, 1.0), "upper": TASKS["upper"]})
    recs = generate_records(500, seed=0)
    assert sum(r["task"] == "tiny" for r in recs) == 10 and len(recs) == 500
    monkeypatch.setattr(dd, "TASKS", {"tiny": (tiny, 1.0)})
    with pytest.raises(ConfigError, match="data.default.num_records"):
        generate_records(11, seed=0)


def test_lengths_are_long_tailed_and_fit_1024_bytes():
    recs = generate_records(6000, seed=1234)
    lengths = np.array([len((alpaca_prompt(r["instruction"], r["input"]) + r["output"]).encode()) + 1 for r in recs])
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p50 < 300 and p99 > 2.5 * p50 and lengths.max() <= 1024  # a bulk of short records, a long tail


def test_prepared_default_splits_are_disjoint(data_cfg):
    p = prepare(data_cfg(path=None, eval_fraction=0.05))
    assert p.summary.records_read == 6000 and len(p.eval) == 300 and len(p.eval_records) == 300
    train_prompts = set()
    for i in range(len(p.train)):
        t, m = p.train.document(i)
        train_prompts.add(bytes(t[~m.astype(bool)].tolist()))
    for r in p.eval_records:
        assert alpaca_prompt(r["instruction"], r["input"]).encode() not in train_prompts
    assert p.summary.truncated == 0 and p.train.lengths.max() <= 1024
