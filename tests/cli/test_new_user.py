"""What a new user trips on first: a missing data file is named as that even where a run already lies, and
torch's CPU threads sleep while they wait (unless the user chose) so a shared machine does not stall them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from densebatch.cli import main


@pytest.mark.parametrize("flag", ["--data.path=missing.json", "--data.eval_path=missing.json", "--data.path=corpus/*.jsonl"])
def test_a_missing_data_file_is_named_before_the_output_directory_is_judged(tmp_path, monkeypatch, capsys, flag):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.json").write_text('[{"instruction": "a", "output": "b"}]')
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')  # a run lies there
    args = ["--data.path=data.json", flag] if "eval_path" in flag else [flag]
    assert main(["train", *args, "--output_dir=runs/x", "--train.max_steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("file not found" in err[0] or "no file matches" in err[0]) and "holds a run" not in err[0], err
    assert flag.split("=")[0][2:] in err[0]


def _policy(env: dict, first: str = "") -> str:
    code = f"{first}from densebatch.cli import threads_wait_asleep; threads_wait_asleep(); import os; print(os.environ.get('OMP_WAIT_POLICY'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_cpu_threads_sleep_while_they_wait_unless_the_user_chose():
    assert _policy({}) == "PASSIVE"
    assert _policy({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
    assert _policy({"GOMP_SPINCOUNT": "10000"}) == "None"  # a spin count of the user's own: left alone
    loaded = "import sys, types; sys.modules['torch'] = types.ModuleType('torch'); "  # as if torch were imported
    assert _policy({}, first=loaded) == "None"  # too late once torch is loaded: nothing pretends otherwise
