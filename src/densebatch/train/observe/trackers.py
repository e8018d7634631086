"""Experiment trackers as metric sinks: Weights & Biases (``wandb``) and MLflow (``mlflow``).

Each is handed exactly the records ``metrics.jsonl`` receives and logs every numeric scalar of each
(``scalars.numeric_scalars``) as ``<kind>/<key>`` (``train/loss``, ``eval/loss``,
``train/loss_by_source/web``) at the record's step, with the run's resolved configuration, flattened
(``train.lr``, ``batching.strategy``, ...), as the run's parameters.

- **wandb**: ``wandb.init`` in ``WANDB_DIR`` when the user sets it, else in ``output_dir`` (its ``wandb/`` folder), with the project from
  ``WANDB_PROJECT`` (default ``densebatch``) and the run's id kept in ``output_dir/tracker-runs.json``,
  so a resumed run (``--resume``) continues the same wandb run. The step is logged as the value
  ``step`` and every metric is plotted against it (``define_metric``): wandb's own step must only grow,
  and a run that rolls back or resumes logs some steps again. ``WANDB_MODE=offline`` writes the run
  locally (``wandb sync`` uploads it later).
- **mlflow**: a run in ``MLFLOW_TRACKING_URI`` (default: a file store in ``output_dir/mlruns``, opted in
  with ``MLFLOW_ALLOW_FILE_STORE`` as MLflow 3 asks), the
  experiment from ``MLFLOW_EXPERIMENT_NAME`` (default ``densebatch``), resumed the same way; parameters
  (values cut to MLflow's 6,000 characters) and metrics at their step. A ``file:`` (or plain path)
  ``MLFLOW_TRACKING_URI`` without ``MLFLOW_ALLOW_FILE_STORE`` is refused by MLflow 3: one line says so.

An absent package is a one-line ``ConfigError`` naming the extra to install, raised when the sinks are
built, before training starts.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from densebatch.errors import ConfigError
from densebatch.train.observe.scalars import flatten, numeric_scalars, record_step

RUNS_FILE = "tracker-runs.json"  # output_dir/tracker-runs.json: {"wandb": id, "mlflow": id}


def _need(module: str, extra: str):
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(f"train.report_to: {extra} needs the {module} package: pip install 'densebatch[{extra}]'") from None


def _runs(output_dir: Path) -> dict:
    try:
        return json.loads((output_dir / RUNS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _remember(output_dir: Path, name: str, run_id: str) -> None:
    runs = _runs(output_dir)
    if runs.get(name) != run_id:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RUNS_FILE).write_text(json.dumps(dict(runs, **{name: run_id}), sort_keys=True), encoding="utf-8")


def _params(config: dict) -> dict[str, Any]:
    """The configuration flattened to ``section.key`` (lists as their JSON text), for a tracker's parameters."""
    flat = flatten(config)
    return {k.replace("/", "."): (json.dumps(v) if isinstance(v, list | dict) else v) for k, v in flat.items()}


class WandbSink:
    """Every numeric scalar to a Weights & Biases run (see the module docstring)."""

    def __init__(self, output_dir: str | Path, config: dict, name: str | None = None) -> None:
        self.wandb = _need("wandb", "wandb")
        self.output_dir = Path(output_dir)
        run_id = _runs(self.output_dir).get("wandb") or secrets.token_hex(6)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = self.wandb.init(
                project=os.environ.get("WANDB_PROJECT", "densebatch"),
                dir=None if os.environ.get("WANDB_DIR") else str(self.output_dir),  # wandb reads WANDB_DIR itself
                name=name or self.output_dir.name,
                id=run_id,
                resume="allow",
                config=_params(config),
                reinit="create_new",
            )
        except Exception as e:  # wandb's own errors (no API key, no network) are not ours to show as a traceback
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"train.report_to: wandb could not start a run ({why}): run `wandb login`, or set WANDB_MODE=offline"
            ) from None
        _remember(self.output_dir, "wandb", run_id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict) -> None:
        step = record_step(record)
        if step is None:
            return
        kind = str(record.get("kind", "train"))
        values = {f"{kind}/{k}": v for k, v in numeric_scalars(record).items()}
        if values:
            self.run.log({"step": step, **values})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
            if self.wandb.run is None:  # no other run of this process: stop wandb's service, which writes the rest
                self.wandb.teardown()


def _mlflow_error(uri: str, e: Exception) -> ConfigError:
    why = (str(e).splitlines() or [type(e).__name__])[0]
    if "MLFLOW_ALLOW_FILE_STORE" in why:
        return ConfigError(
            f"train.report_to: mlflow: MLFLOW_TRACKING_URI={uri} is a file store, which this MLflow refuses unless "
            "MLFLOW_ALLOW_FILE_STORE=true is set: set it, use a database (sqlite:///mlflow.db) or a server, or unset "
            "MLFLOW_TRACKING_URI (densebatch then writes output_dir/mlruns)"
        )
    return ConfigError(f"train.report_to: mlflow could not start a run in {uri} ({why[:300]})")


class MLflowSink:
    """Every numeric scalar to an MLflow run (see the module docstring)."""

    MAX_PARAM = 6000

    def __init__(self, output_dir: str | Path, config: dict, name: str | None = None) -> None:
        _need("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self.output_dir = Path(output_dir)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow 3 asks to opt in to the file store, the one backend that needs no server or database
            uri = (self.output_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self.client = MlflowClient(tracking_uri=uri)
            run_id = self._start(config, name)
        except Exception as e:  # MLflow's own errors (a refused file store, no server) are one line, not a traceback
            raise _mlflow_error(uri, e) from None
        self.run_id = run_id
        self.uri = uri

    def _start(self, config: dict, name: str | None) -> str:
        run_id = _runs(self.output_dir).get("mlflow")
        if run_id is None:
            exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "densebatch")
            exp = self.client.get_experiment_by_name(exp_name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(exp_name)
            run_id = self.client.create_run(exp_id, run_name=name or self.output_dir.name).info.run_id
            params = [(k, str(v)[: self.MAX_PARAM]) for k, v in _params(config).items()]
            from mlflow.entities import Param

            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                self.client.log_batch(run_id, params=[Param(k, v) for k, v in params[i : i + 100]])
            _remember(self.output_dir, "mlflow", run_id)
        else:  # a resumed run goes on in the same MLflow run
            self.client.update_run(run_id, status="RUNNING")
        return run_id

    def write(self, record: dict) -> None:
        step = record_step(record)
        if step is None:
            return
        from mlflow.entities import Metric

        kind = str(record.get("kind", "train"))
        stamp = int(time.time() * 1000)
        metrics = [Metric(f"{kind}/{k}", v, stamp, step) for k, v in numeric_scalars(record).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None
