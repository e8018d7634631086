"""Keys that moved are refused with their new name (file, command line), a configuration saved by a run
before the move is read under the new names (an older run still resumes), and an unknown key suggests the
closest real one."""

from __future__ import annotations

import re

import pytest
import yaml

from densebatch.cli import main
from densebatch.config import load_config
from densebatch.config.moved import MOVED
from densebatch.errors import ConfigError

VALUES = {  # a valid value for each moved key, at its new place
    "train.optimizer.weight_decay": 0.05,
    "train.optimizer.decay_all": True,
    "train.optimizer.beta1": 0.8,
    "train.optimizer.beta2": 0.9,
    "train.optimizer.eps": 1e-6,
    "train.batch_schedule.ramp_steps": 5,
    "train.batch_schedule.ramp_start": 0.5,
    "train.batch_schedule.ramp_unit": "tokens",
    "train.batch_schedule.backoff_patience": 2,
    "train.batch_schedule.backoff_factor": 0.25,
    "train.batch_schedule.backoff_floor": 0.25,
    "train.batch_schedule.backoff_cap": 2.0,
    "train.batch_schedule.backoff_max": 1,
    "train.batch_schedule.lr_scaling": "sqrt",
    "train.guard.spike_zscore": 0.0,
    "train.guard.spike_window": 20,
    "train.guard.max_bad_steps": 2,
    "train.guard.rollback_lr_factor": 0.25,
    "finder.memory_reserve": 0.2,
    "train.health.memory_headroom": 0.1,
    "train.loss_tokens_per_step": 4096,
}


def _get(cfg, key: str):
    for k in key.split("."):
        cfg = getattr(cfg, k)
    return cfg


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = out
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return out


def test_every_moved_key_has_a_value_here_and_lands_on_a_real_key():
    assert set(MOVED.values()) == set(VALUES)
    cfg = load_config(None, [f"--{k}={v}" for k, v in VALUES.items()] + ["--eval.every_steps=2"])
    assert all(_get(cfg, k) == v for k, v in VALUES.items())


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_key_is_refused_with_its_new_name(old, tmp_path, capsys):
    new = MOVED[old]
    with pytest.raises(ConfigError, match="^" + re.escape(f"{old} has moved: it is now {new}")):
        load_config(None, [f"--{old}={VALUES[new]}"])
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(_nested({old: VALUES[new]})))
    with pytest.raises(ConfigError, match="has moved"):
        load_config(path)
    assert main(["config", str(path)]) == 2  # one line, exit 2, no traceback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and new in err and "Traceback" not in err


def test_a_saved_configuration_with_old_keys_is_read_under_the_new_names(tmp_path):
    path = tmp_path / "config.yaml"
    old = _nested({o: VALUES[n] for o, n in MOVED.items()} | {"eval.every_steps": 2})
    path.write_text(yaml.safe_dump(old))
    cfg = load_config(path, saved=True)
    assert all(_get(cfg, k) == v for k, v in VALUES.items())


def test_an_unknown_key_suggests_the_closest_one():
    with pytest.raises(
        ConfigError, match=r"unknown key 'train\.warmup_step' in section 'train'; did you mean 'train\.warmup_steps'\?"
    ):
        load_config(None, ["--train.warmup_step=5"])
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--train.zzzz=5"])
    assert "did you mean" not in str(e.value)
