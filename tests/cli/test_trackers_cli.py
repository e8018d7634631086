"""`train --train.report_to=wandb,mlflow`, offline: every scalar of metrics.jsonl, read back from each tracker."""

from __future__ import annotations

import json
import struct
import sys

import pytest
from cli_args import TINY

from densebatch.cli import main
from densebatch.errors import ConfigError

STEPS = 3


def _wandb_history(path) -> list[dict]:
    """The history rows of an offline wandb run file (``run-<id>.wandb``): its records are protobuf
    ``Record`` messages in 32 KiB blocks of (crc32, length, type) chunks, after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, rows, at, pending = path.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B"
    while at + 7 <= len(data):
        block_left = 32768 - at % 32768
        if block_left < 7:  # the block's tail is padding
            at += block_left
            continue
        length, kind = struct.unpack("<HB", data[at + 4 : at + 7])
        pending += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    out = tmp_path_factory.mktemp("trackers") / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""}
    with pytest.MonkeyPatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        m.delenv("MLFLOW_TRACKING_URI")
        assert main(["train", f"--output_dir={out}", *TINY, f"--train.max_steps={STEPS}", "--train.report_to=wandb,mlflow"]) == 0
    return out


def _records(out, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]


@pytest.mark.slow
def test_wandb_offline_holds_every_train_loss_and_the_config(run):
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    rows = _wandb_history(files[0])
    logged = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert logged == {r["step"]: pytest.approx(r["loss"], rel=1e-9) for r in _records(run, "train")}
    assert any("eval/loss" in r for r in rows)
    assert json.loads((run / "tracker-runs.json").read_text())["wandb"] in files[0].name


@pytest.mark.slow
def test_mlflow_file_store_holds_every_train_loss_and_the_config_as_parameters(run):
    from mlflow.tracking import MlflowClient

    ids = json.loads((run / "tracker-runs.json").read_text())
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "train/loss")}
    assert history == {r["step"]: pytest.approx(r["loss"], rel=1e-9) for r in _records(run, "train")}
    mlrun = client.get_run(ids["mlflow"])
    assert mlrun.data.params["train.max_steps"] == str(STEPS) and "batching.strategy" in mlrun.data.params
    assert mlrun.info.status == "FINISHED"


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_tracker_package_is_a_one_line_config_error(tmp_path, monkeypatch, name):
    from densebatch.train.observe.sinks import build_sinks

    monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=rf"needs the {name} package: pip install 'densebatch\[{name}\]'") as e:
        build_sinks([name], tmp_path, {})
    assert "\n" not in str(e.value)


def test_wandb_without_a_login_is_a_one_line_config_error(tmp_path, monkeypatch):
    """Online mode with no API key: one line saying how to log in or go offline, not wandb's traceback."""
    pytest.importorskip("wandb")
    from densebatch.train.observe.sinks import build_sinks

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ConfigError, match="wandb login.*WANDB_MODE=offline") as e:
        build_sinks(["wandb"], tmp_path / "run", {})
    assert "\n" not in str(e.value)
