"""benchmarks/gpu.sh --dry-run end to end on CPU: each row printed as it finishes, and SIGTERM halfway still
prints the table and writes the JSON (the GPU check must return its table even when its lease runs out)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


def test_the_dry_run_prints_rows_as_they_finish_and_survives_sigterm_halfway(tmp_path):
    out = tmp_path / "check"
    env = os.environ | {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = ["bash", "benchmarks/gpu.sh", "--dry-run", "--no-tests", "--out", str(out)]
    cmd += ["--methods", "densebatch,hf-flattening,hf-group_by_length", "--seq-lens", "64,128", "--slots", "512"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:  # the first row arrives while the other runs are still to come
            seen.append(line)
            if line.startswith("| gpt2 | 64 | densebatch |"):
                break
        assert seen and seen[-1].startswith("| gpt2 | 64 | densebatch |"), "".join(seen)
        first = json.loads((out / "results.json").read_text())  # rewritten as each row finishes
        assert [r["method"] for r in first["runs"]] == ["densebatch"] and first["stopped"] is None
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(timeout=120) == 143, rest
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped by SIGTERM" in rest and "[gpu.sh] stopped by SIGTERM" in rest
    table = rest[rest.index("| model | context |") :]
    assert "| gpt2 | 64 | densebatch | attention " in table and "not run: stopped by SIGTERM" in table
    doc = json.loads((out / "results.json").read_text())
    assert doc["stopped"].startswith("SIGTERM") and doc["runs"][0]["tokens_per_s"] > 0
    assert all(r["tokens_per_s"] > 0 or r["note"] for r in doc["runs"])
    planned = 2 * 2 * 2 + 2  # 2 models x 2 contexts x 2 methods, and group_by_length per model
    assert len(doc["runs"]) + len(doc["not_run"]) == planned
    assert (out / "table.md").read_text() in rest and "| gpt2 | 64 | densebatch |" in (out / "log").read_text()
