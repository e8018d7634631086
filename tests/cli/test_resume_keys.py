"""What a resume keeps: the saved run's values, changed only by keys named on the command line, and never
in a way that moves what evaluations decide.

- ``plan_resume`` on configurations: a key the config file alone changes is ignored (reported), a
  resumable key named on the command line changes (reported), any other named key is refused;
  evaluation cadence and size are refused while a batch-size back-off or early stopping reads them.
- End to end: a run started with ``--train.max_steps=40 --batching.strategy=packed``, stopped by
  SIGTERM and resumed with ``CONFIG --resume`` (whose file says 200 steps and token budgets) ends at
  step 40 with the packed plan.
"""

from __future__ import annotations

import re
import signal

import fault_driver as fd
import pytest

from densebatch.config import RunConfig, load_config, to_dict
from densebatch.errors import ConfigError
from densebatch.run.resume import plan_resume


def _saved(**train) -> dict:
    cfg = load_config(None, [f"--train.{k}={v}" for k, v in train.items()])
    return to_dict(cfg)


def _requested(overrides: list[str], file: dict | None = None) -> RunConfig:
    return load_config(None, [f"--{k}={v}" for k, v in (file or {}).items()] + overrides)


def test_the_config_files_differences_are_ignored_even_for_resumable_keys():
    saved = _saved(max_steps=40)
    requested = _requested([], {"train.max_steps": 200, "checkpoint.every_steps": 7, "batching.strategy": "token_budget"})
    plan = plan_resume(saved, requested, overrides=[])
    assert plan.config.train.max_steps == 40 and plan.config.batching.strategy == "packed"
    assert plan.config.checkpoint.every_steps == RunConfig().checkpoint.every_steps
    assert not plan.changed
    assert {line.split(":")[0] for line in plan.ignored} == {"train.max_steps", "checkpoint.every_steps", "batching.strategy"}


def test_a_resumable_key_named_on_the_command_line_changes_and_is_reported():
    plan = plan_resume(_saved(max_steps=40), _requested(["--train.max_steps=60"]), ["--train.max_steps=60"])
    assert plan.config.train.max_steps == 60
    assert plan.changed == ["train.max_steps: 40 → 60"]


def test_a_named_key_that_changes_the_updates_is_refused():
    with pytest.raises(ConfigError, match=r"train\.lr \(saved"):
        plan_resume(_saved(lr=1e-3), _requested(["--train.lr=2e-3"]), ["--train.lr=2e-3"])


@pytest.mark.parametrize("steer", ["--train.batch_schedule.backoff_patience=2", "--eval.patience=3"])
@pytest.mark.parametrize("key", ["--eval.every_steps=4", "--eval.max_batches=2"])
def test_evaluation_cadence_is_refused_while_something_acts_on_evaluations(steer, key):
    every = "--eval.every_steps=2"  # a back-off needs evaluations
    saved = to_dict(load_config(None, [steer, every]))
    with pytest.raises(ConfigError, match="acts on every evaluation"):
        plan_resume(saved, _requested([steer, every, key]), [key])
    # Without a back-off or early stopping, evaluations are only recorded: their cadence may change.
    plan = plan_resume(to_dict(load_config(None, [every])), _requested([every, key]), [key])
    assert plan.changed and plan.changed[0].startswith(key[2:].split("=")[0])


def test_output_dir_is_where_the_run_was_found():
    saved = to_dict(load_config(None, ["--output_dir=runs/old"]))
    plan = plan_resume(saved, _requested(["--output_dir=runs/moved"]), ["--output_dir=runs/moved"])
    assert plan.config.output_dir == "runs/moved" and not plan.changed and not plan.ignored


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_resumes_with_its_own_steps_and_strategy(tmp_path):
    cache = tmp_path / "cache"
    config = fd.write_config(
        tmp_path / "run.yaml",
        tmp_path / "run",
        cache,
        batching={"strategy": "token_budget"},
        train={"max_steps": 200},
        checkpoint={"every_steps": 5},
    )
    out = tmp_path / "run"
    started = ["train", str(config), "--train.max_steps=40", "--batching.strategy=packed"]
    r = fd.signal_at_step(started, out, step=3, sig=signal.SIGTERM)
    assert r.returncode == 0, r.stderr
    assert "stopped by signal" in r.stdout
    stopped_at = fd.last_step(out)
    assert 3 <= stopped_at < 40
    r = fd.run(["train", str(config), "--resume"], timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"ignored: train\.max_steps: 200 \(the saved run has 40\)", r.stdout), r.stdout
    assert re.search(r"ignored: batching\.strategy: 'token_budget' \(the saved run has 'packed'\)", r.stdout), r.stdout
    assert fd.last_step(out) == 40
    saved = load_config(out / "config.yaml")
    assert saved.batching.strategy == "packed" and saved.train.max_steps == 40


def test_an_mlm_run_saved_with_causal_loss_tokens_resumes_as_it_ran():
    """A masked-LM run prepared before data.loss_on became all under mlm (it saved response) resumes with
    what it saved; a fresh mlm config gets all (the difference is reported, not refused)."""
    mlm = ["--batching.mode=mlm", "--model.kind=hf", "--model.path=x", "--train.max_steps=60"]
    saved = to_dict(load_config(None, mlm))
    saved["data"]["loss_on"] = "response"
    plan = plan_resume(saved, _requested(mlm), ["--train.max_steps=60"])
    assert plan.config.data.loss_on == "response" and plan.config.batching.mode == "mlm"
    assert any(line.startswith("data.loss_on: 'all'") for line in plan.ignored)
