"""The embedded default dataset: deterministic, unique prompts, short checkable answers, long-tailed lengths."""

from __future__ import annotations

import numpy as np

from densebatch.data.default_dataset import TASKS, check_answer, generate_records
from densebatch.data.prepare import prepare
from densebatch.data.templates import alpaca_prompt


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
        elif task == "color":
            named = [w for w in inp.split() if w in ("red", "green", "blue", "yellow", "black", "white")]
            assert named == [out]  # exactly one color word: the answer is never ambiguous
        elif task == "upper":
            assert out == ("yes" if inp.isupper() else "no")
        elif task == "parity":
            n = int(next(w for w in r["instruction"].split() if w.isdigit()))
            assert out == ("even" if n % 2 == 0 else "odd")
        assert check_answer(r, f"  {out}\n") and check_answer(r, out + "<|endoftext|>junk")
        assert not check_answer(r, out + "x")


def test_both_answers_of_binary_tasks_are_common():
    recs = generate_records(6000, seed=1234)
    for task in ("key", "upper", "parity"):
        outs = [r["output"] for r in recs if r["task"] == task]
        for value in set(outs):
            assert 0.4 < outs.count(value) / len(outs) < 0.6, (task, value)


def test_lengths_are_long_tailed_and_fit_1024_bytes():
    recs = generate_records(6000, seed=1234)
    lengths = np.array([len((alpaca_prompt(r["instruction"], r["input"]) + r["output"]).encode()) + 1 for r in recs])
    p10, p50, p99 = np.percentile(lengths, [10, 50, 99])
    assert p10 < 200 and p50 > 250 and p99 > 700 and lengths.max() <= 1024


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
