"""Trackers configured as their users configure them: an explicit MLflow file store, wandb's WANDB_DIR."""

from __future__ import annotations

import pytest

from densebatch.errors import ConfigError


def test_mlflow_file_uri_without_the_opt_in_is_one_line_and_with_it_writes_there(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from densebatch.train.observe.sinks import build_sinks

    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match="is a file store.*MLFLOW_ALLOW_FILE_STORE=true") as e:
        build_sinks(["mlflow"], tmp_path / "run", {})
    assert "\n" not in str(e.value) and store.as_uri() in str(e.value)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    sinks = build_sinks(["mlflow"], tmp_path / "run", {"train": {"lr": 0.1}})
    for s in sinks:
        s.write({"kind": "train", "step": 1, "loss": 2.5})
        s.close()
    assert any(store.rglob("loss")) and not (tmp_path / "run" / "mlruns").exists()  # where the user said


def test_wandb_writes_under_wandb_dir_when_the_user_sets_it(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from densebatch.train.observe.sinks import build_sinks

    # wandb reads its environment once per process (its setup singleton): a wandb run started earlier in this
    # test process (another test's) would keep its settings and ignore the ones below
    wandb.teardown()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    sinks = build_sinks(["wandb"], tmp_path / "run", {})
    for s in sinks:
        s.write({"kind": "train", "step": 1, "loss": 2.5})
        s.close()
    assert list((tmp_path / "wandb-home" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert not (tmp_path / "run" / "wandb").exists()
