"""The command line end to end: exit codes and messages, prepare / inspect / analyze / train / eval / generate."""

from __future__ import annotations

import json
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_args import TINY

from densebatch.cli import _parser, _split_overrides, main

REPO = Path(__file__).resolve().parents[2]


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "densebatch.cli", *args], capture_output=True, text=True, timeout=300)


def test_bad_override_exits_2_without_traceback():
    r = run_cli(["prepare", "--train.max_steps=abc"])
    assert r.returncode == 2
    assert "train.max_steps" in r.stderr and "Traceback" not in r.stderr


def test_unknown_key_and_missing_config(tmp_path, capsys):
    assert main(["prepare", "--batching.stratgy=packed"]) == 2
    assert "batching.stratgy" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def _malformed_jsonl(path: Path) -> list[int]:
    """1,000 records, 50 of them malformed in different ways; returns the bad line numbers."""
    rng = random.Random(0)
    bad_lines = sorted(rng.sample(range(1, 1001), 50))
    kinds = [
        "{not json",
        '{"instruction": null, "input": "", "output": "x"}',
        '{"instruction": "", "input": "", "output": "x"}',
        '{"input": "", "output": "x"}',
        '{"instruction": 5, "input": "", "output": ["a"]}',
        '["a", "list"]',
        "",
    ]
    lines = []
    for i in range(1, 1001):
        if i in bad_lines:
            lines.append(kinds[i % len(kinds)])
        else:
            lines.append(json.dumps({"instruction": f"Say {i}.", "input": "", "output": f"{i}"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return bad_lines


def test_prepare_malformed_jsonl_error_and_skip(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    bad = _malformed_jsonl(data)
    common = [f"--data.path={data}", f"--data.cache_dir={tmp_path / 'cache'}", f"--output_dir={tmp_path / 'out'}"]
    assert main(["prepare", *common]) == 2
    err = capsys.readouterr().err
    assert f"{data}:{bad[0]}:" in err and "Traceback" not in err
    assert main(["prepare", *common, "--data.on_bad_record=skip"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\b50 skipped\b", out), out


def test_inspect_marks_loss_tokens(tmp_path, capsys):
    assert main(["inspect", "--num", "1", f"--data.cache_dir={tmp_path}", "--data.default.num_records=50"]) == 0
    out = capsys.readouterr().out
    assert "### Response:" in out and "carry loss" in out
    for start in ("999999", "-1"):  # past the split, or before it: one line saying what it holds (it printed nothing)
        assert main(["inspect", "--start", start, f"--data.cache_dir={tmp_path}", "--data.default.num_records=50"]) == 2
        assert "the train split holds documents 0 to" in capsys.readouterr().err


def test_analyze_lengths_json_and_dump_plan(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 0.9, 3000).astype(int), 2, 2048)
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    plan_file = tmp_path / "plan.json"
    assert (
        main(
            [
                "analyze",
                "--lengths",
                str(tmp_path / "lengths.txt"),
                "--json",
                "--strategy",
                "token_budget",
                "--dump-plan",
                str(plan_file),
                "--batching.max_tokens_per_batch=8192",
                "--batching.seq_len=2048",
            ]
        )
        == 0
    )
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"token_budget"}  # --strategy: that strategy alone
    plan = json.loads(plan_file.read_text())
    seen = sorted(d for batch in plan for row in batch for d in row)
    assert seen == list(range(len(lengths)))  # every document exactly once
    for batch in plan:  # rows x longest row within the budget
        assert len(batch) * max(lengths[row[0]] for row in batch) <= 8192
    assert main(["analyze", "--lengths", str(tmp_path / "lengths.txt"), "--json", "--batching.seq_len=2048"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"random", "length_grouped", "token_budget", "packed"}  # no --strategy: every one
    assert results["packed"]["fill_rate"] >= 0.99


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for a few steps on the embedded default data."""
    tmp = tmp_path_factory.mktemp("run")
    common = TINY + [f"--data.cache_dir={tmp / 'cache'}", "--data.eval_fraction=0.2"]
    assert main(["train", f"--output_dir={tmp / 'out'}", "--train.max_steps=4", *common]) == 0
    return tmp / "out", common


def test_eval_loss_does_not_depend_on_strategy(trained, capsys):
    out, common = trained
    losses = {}
    for strategy in ("random", "length_grouped", "token_budget", "packed"):
        assert (
            main(
                [
                    "eval",
                    str(REPO / "configs" / "default.yaml"),
                    "--checkpoint",
                    str(out),
                    "--json",
                    f"--batching.strategy={strategy}",
                    *common,
                ]
            )
            == 0
        )
        losses[strategy] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = losses["packed"]
    for name, res in losses.items():
        assert res["tokens"] == ref["tokens"], name
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5), name


def test_train_outputs_and_generate(trained, capsys):
    out, _ = trained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "loss_tokens", "real_tokens", "slot_tokens", "tokens_per_s", "elapsed_s"):
        assert key in train[0]
    assert any(r["kind"] == "eval" for r in records)
    assert (out / "config.yaml").is_file() and (out / "final" / "model.safetensors").is_file()
    assert (
        main(["generate", "--checkpoint", str(out), "--prompt", "Convert the word to uppercase.", "--max-new-tokens", "5"]) == 0
    )
    capsys.readouterr()
    # A step checkpoint works too, and a missing directory is a clear error.
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--raw", "--max-new-tokens", "3"]) == 0
    assert main(["generate", "--checkpoint", str(out / "nope"), "--prompt", "hi"]) == 2


def test_readme_commands_parse():
    """Every `densebatch ...` line the README shows is accepted by the argument parser."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"^densebatch (.+?)(?:\s+#.*)?$", text, flags=re.M)
    assert len(commands) >= 5
    for line in commands:
        rest, overrides = _split_overrides(shlex.split(line))
        _parser().parse_args(rest)
        for o in overrides:
            assert "=" in o
