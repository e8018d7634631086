"""densebatch train on preference pairs, end to end: the embedded default as pairs, dpo with its reference
precomputed and stored beside the prepared pairs (reused only by the same weights), TRL's metric names in train
and eval records with each step's pairs, inspect shows a pair's three parts; the mistakes are one line each."""

from __future__ import annotations

import json

import pytest
from cli_args import TINY

from densebatch.cli import main
from densebatch.run.preference import REFERENCE_DIR

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")


@pytest.mark.slow
def test_dpo_on_the_embedded_pairs_logs_trls_metrics_and_keeps_its_reference(tmp_path, capsys):
    cache = tmp_path / "cache"
    args = [*TINY, f"--data.cache_dir={cache}", "--data.eval_fraction=0.1", "--train.objective=dpo", "--train.max_steps=3"]
    args.append("--data.on_bad_record=skip")  # the longest prompts leave no room within 256 tokens: counted skips
    assert main(["train", *args, f"--output_dir={tmp_path / 'a'}"]) == 0
    records = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(train) == 3 and all(set(METRICS) <= set(r) and r["pairs"] > 0 for r in train)
    assert abs(train[0]["loss"] - 0.693147) < 1e-4  # the policy is the reference at step 1: every reward 0
    assert evals and set(METRICS) <= set(evals[-1]) and evals[-1]["pairs"] > 0
    tables = sorted(p.name for p in cache.rglob(f"{REFERENCE_DIR}/*.npy"))
    assert len(tables) == 2 and {t.split("-")[1] for t in tables} == {"train", "eval"}  # beside the pairs
    # another seed is other starting weights: its own tables; the same weights again read the stored ones
    assert main(["train", *args, "--seed=1", f"--output_dir={tmp_path / 'b'}"]) == 0
    assert len(list(cache.rglob(f"{REFERENCE_DIR}/*.npy"))) == 4
    capsys.readouterr()
    assert main(["inspect", *args, "--num=1"]) == 0
    shown = capsys.readouterr().out
    assert "--- pair 0:" in shown and "[prompt: " in shown and "[chosen: " in shown and "[rejected: " in shown


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--data.pairs=false"], "data.pairs: false"),
        (["--train.label_smoothing=0.6"], "train.label_smoothing"),
        (["--batching.seq_len=64"], "batching.seq_len: a preference pair takes up to"),
    ],
)
def test_mistakes_are_one_line(tmp_path, capsys, extra, words):
    args = [
        *TINY,
        f"--data.cache_dir={tmp_path / 'c'}",
        "--train.objective=dpo",
        "--train.max_steps=1",
        "--data.on_bad_record=skip",
        *extra,
    ]
    assert main(["train", *args, f"--output_dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_prompt_laid_twice_is_said_once():
    from densebatch.config import load_config
    from densebatch.run.preference import prompt_layout

    assert prompt_layout(load_config(None, ["--train.objective=dpo"])) == (True, None)
    shared, line = prompt_layout(load_config(None, ["--train.objective=dpo", "--model.attention=varlen"]))
    assert not shared and "laid twice" in line and "varlen" in line
