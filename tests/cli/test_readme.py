"""The README's commands run as written: every line of the bash block under "## Using it", in order,
in two halves that share nothing (``_part``), each in a fresh directory laid out as a checkout
(``configs/``, and ``../shared`` beside it), and what they claim shows in their output. Lines that
read ../shared/data (the example configs, and the run they train) are skipped where it is absent."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import shared_data_dir, subprocess_env

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The lines of the bash block under "## Using it", activation left out (PATH does that here)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Using it", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md: no bash block under '## Using it'"
    lines = [line.strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith((". ", "source ", "#"))]


def needs_shared(line: str) -> bool:
    """The example configs read ../shared/data; the eval, generate and resume lines use their run."""
    return "configs/" in line or "runs/" in line


def test_the_readme_block_is_what_this_test_expects():
    lines = readme_commands()
    assert sum(line.startswith("densebatch ") for line in lines) >= 9
    verbs = [line.split()[1] for line in lines if line.startswith("densebatch ")]
    assert verbs.count("train") == 2 and {"prepare", "inspect", "analyze", "eval", "generate", "config"} <= set(verbs)
    resume = [line for line in lines if "--resume" in line]
    assert len(resume) == 1 and lines.index(resume[0]) > max(i for i, x in enumerate(lines) if "generate" in x)


def _checkout(root: Path) -> tuple[Path, bool]:
    """A directory laid out like a checkout: configs/ (copied) and ../shared (a link) when present."""
    work = root / "densebatch"
    shutil.copytree(REPO / "configs", work / "configs")
    shared = shared_data_dir()
    if shared is not None:
        (root / "shared").symlink_to(shared.parent, target_is_directory=True)
    return work, shared is not None


def _part(lines: list[str], part: str) -> list[str]:
    """The block in two halves that share no files, so that the suite can run them side by side: the
    lines before the first training run (prepare, analyze, the finders), and that run with what uses it."""
    first = next(i for i, x in enumerate(lines) if x.startswith("densebatch train"))
    return lines[:first] if part == "before training" else lines[first:]


def _run(line: str, cwd: Path) -> subprocess.CompletedProcess:
    env = subprocess_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # one thread each
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r["step"] for r in map(json.loads, lines) if r.get("kind") == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("part", ["before training", "training and after"])
def test_every_readme_command_runs_as_written(part, tmp_path):
    work, have_shared = _checkout(tmp_path)
    lines = _part(readme_commands(), part)
    ran = []
    for line in lines:
        if needs_shared(line) and not have_shared:
            continue
        r = _run(line, work)
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"README command failed ({r.returncode}): {line}\n{out[-3000:]}"
        assert "Traceback" not in out, f"{line}\n{out[-3000:]}"
        ran.append(line)
        _check(line, r, work)
    if part == "before training":
        assert any("--lengths" in x for x in ran)
    else:
        assert any(x.startswith("densebatch config") for x in ran)
    if have_shared:
        assert len(ran) == len(lines)


def _check(line: str, r: subprocess.CompletedProcess, work: Path) -> None:
    """What each command claims, beyond its exit code."""
    run_dir = work / "runs" / "alpaca-gpt2"
    if line.startswith("densebatch prepare"):
        assert "documents:" in r.stdout
    elif line.startswith("densebatch analyze --lengths"):
        assert set(json.loads(r.stdout)) == {"random", "length_grouped", "token_budget", "packed"}
        assert "wrote plan.json" in r.stderr  # says where it wrote
        assert (work / "plan.json").is_file()
    elif line.startswith("densebatch train") and "--resume" not in line:
        limit = int(re.search(r"--train\.max_steps=(\d+)", line).group(1))
        assert _steps(run_dir) == list(range(1, limit + 1))
        assert "strategy: packed" in (run_dir / "config.yaml").read_text()
    elif line.startswith("densebatch eval"):
        result = json.loads(r.stdout.strip().splitlines()[-1])
        assert result["tokens"] > 0 and result["loss"] > 0
    elif line.startswith("densebatch train") and "--resume" in line:
        # The resume continues the saved run: the same (packed) plan, steps after the saved ones, to
        # the new limit. (Resume semantics: run/resume.py.)
        limit = int(re.search(r"--train\.max_steps=(\d+)", line).group(1))
        assert _steps(run_dir) == list(range(1, limit + 1))
        config = (run_dir / "config.yaml").read_text()
        assert "strategy: packed" in config and f"max_steps: {limit}" in config
    elif line.startswith("densebatch config --keys"):
        assert "data.tokenizer" in r.stdout and "batching.strategy" in r.stdout
