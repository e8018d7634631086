"""``train.compile``: what training runs is compiled, a token_budget epoch does not recompile per batch,
and compiled losses equal eager ones (fp32, CPU).

``nn.Module.compile()`` alone compiled ``forward``, which training never calls (it calls
``token_losses``): dynamo's counters stayed at zero. Here the blocks are compiled with dynamic shapes and
attention runs eagerly between the compiled parts (model/attention.py ``attend_eagerly``), so every
batch of a token_budget run, each with its own (rows, T), reuses the graphs of the first step
(evaluation, with grad mode off, compiles its own set once: left out here, it would double the cost).
"""

from __future__ import annotations

import json
import re

from cli_args import TINY

from densebatch.cli import main

ARGS = [
    *TINY,
    "--batching.strategy=token_budget",
    "--batching.max_tokens_per_batch=512",
    "--train.max_steps=5",
    "--data.eval_fraction=0",  # no evaluation: it would compile its own (no-grad) graphs, a minute on CI's CPUs
    "--checkpoint.every_steps=0",
]


def losses(run) -> list[float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def test_compiled_training_compiles_once_and_matches_eager(tmp_path, capsys):
    assert main(["train", f"--output_dir={tmp_path / 'eager'}", *ARGS]) == 0
    capsys.readouterr()
    assert main(["train", f"--output_dir={tmp_path / 'compiled'}", *ARGS, "--train.compile=true"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"compile: (\d+) graphs \((\d+) at the first step, (\d+) after it\)", out)
    assert m, out
    graphs, first, after = map(int, m.groups())
    assert first > 0  # the first step ran compiled graphs
    assert after == 0, out  # the 4 later steps, each of its own (rows, T), compile nothing more
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(eager) == len(compiled) == 5
    records = [json.loads(x) for x in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len({r["slot_tokens"] for r in records if r["kind"] == "train"}) > 1  # the batches did differ in shape
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= 1e-5, (eager, compiled)
