"""Every code block of README.md and docs/*.md runs as written, as a user runs it, or says in the page why not.

Each page's blocks run in order in a fresh directory laid out as a checkout (``configs/`` copied, ``../shared``
beside it, ``.venv`` the test's environment), as a reader following the page would: a ``bash`` (``sh``) block
saved as a script and run with ``bash -e``, a ``python`` block saved as a file and run with ``python``, each
with a time limit. A block is also decided by the page itself, in an HTML comment on the line before it:

- ``<!-- docs-test: skip: WHY -->``: not run, for the reason given (a GPU, several machines, a placeholder such
  as CONFIG, minutes of work that a benchmark or another test runs);
- ``<!-- docs-test: file NAME -->``: the block is a file's content (a YAML configuration), written as NAME for
  the blocks after it.

A block tagged ``text`` is output, a diagram or a formula: never run. Any other block (untagged, yaml, json,
...) that is neither runnable nor marked fails ``test_every_block_is_runnable_or_marked``, so a new block
cannot slip by. A block that reads ``../shared`` (or the example configs, which do) is skipped, with the rest
of its page, where ``../shared/data`` is absent. README's block also has its claims checked (``README_CLAIMS``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import shared_data_dir, subprocess_env

REPO = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
RUNNABLE = {"bash": "sh", "sh": "sh", "python": "py"}
NOT_CODE = ("text",)
MARK = re.compile(r"^<!--\s*docs-test:\s*(?P<kind>skip|file)\b:?\s*(?P<arg>.*?)\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")  # indented inside a list item too
# Seconds a block may run: a script of many commands (README's: ~100 s of 2 idle cores; 6.5 min at a load average
# of 10), a Python block 2 minutes (the check of data.md's datatrove script, which once never ended).
TIMEOUT = {"sh": 900, "py": 120}


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    mark: tuple[str, str] | None  # (skip | file, the reason or the file name)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def needs_shared(self) -> bool:
        return "../shared" in self.code or "configs/" in self.code


def blocks(page: str, text: str | None = None) -> list[Block]:
    """The fenced code blocks of ``page`` (or of ``text``), with the mark on the line before each."""
    lines = (REPO / page).read_text(encoding="utf-8").splitlines() if text is None else text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a code block that never closes"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(before)
        code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        out.append(Block(page, i + 1, m["lang"], code, (mark["kind"], mark["arg"]) if mark else None))
        i = end + 1
    return out


def problems(found: list[Block]) -> list[str]:
    """Why each block that is neither runnable, marked, nor text breaks the rule, in one line each."""
    out = []
    for b in found:
        if b.mark is not None:
            if not b.mark[1]:
                out.append(
                    f"{b.where}: a docs-test {b.mark[0]} mark needs {'its reason' if b.mark[0] == 'skip' else 'a file name'}"
                )
        elif not b.lang:
            out.append(f"{b.where}: an untagged block: tag it (bash, python, or text for output), or mark it")
        elif b.lang not in RUNNABLE and b.lang not in NOT_CODE:
            out.append(
                f"{b.where}: a {b.lang} block is not run: mark it <!-- docs-test: file NAME --> or <!-- docs-test: skip: WHY -->"
            )
    return out


def test_every_block_is_runnable_or_marked():
    found = [b for page in PAGES for b in blocks(page)]
    assert len(found) > 80
    assert not problems(found), "\n".join(problems(found)) + "\n(see tests/cli/test_docs_blocks.py's docstring)"


def test_the_rule_catches_a_block_that_is_neither():
    page = "x\n```\nrun me\n```\n<!-- docs-test: skip -->\n```bash\nmake gpu\n```\n```yaml\na: 1\n```\n<!-- docs-test: file a.yaml -->\n```yaml\na: 1\n```\n"
    found = blocks("x.md", page)
    assert [b.lang for b in found] == ["", "bash", "yaml", "yaml"] and found[3].mark == ("file", "a.yaml")
    said = problems(found)
    assert len(said) == 3 and "untagged" in said[0] and "needs its reason" in said[1] and "yaml block" in said[2]


def test_blocks_that_read_the_shared_data_are_known():
    """Where ../shared/data is absent, a page's blocks stop at the first that reads it (or writes a file that does)."""
    readme = [b for b in blocks("README.md") if b.lang in RUNNABLE and b.mark is None]
    data = blocks("docs/data.md")
    assert readme and all(b.needs_shared for b in readme)
    assert data[0].mark == ("file", "mix.yaml") and data[0].needs_shared  # the mixture's sources
    assert not any(b.needs_shared for b in blocks("docs/python.md"))


# ------------------------------------------------------------------ running the pages
def _checkout(root: Path) -> tuple[Path, bool]:
    """A directory laid out like a checkout: configs/ (copied), .venv (this environment), ../shared (a link)."""
    work = root / "densebatch"
    shutil.copytree(REPO / "configs", work / "configs")
    (work / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    shared = shared_data_dir()
    if shared is not None:
        (root / "shared").symlink_to(shared.parent, target_is_directory=True)
    return work, shared is not None


def run_block(b: Block, work: Path, n: int) -> str:
    """Run ``b`` as its page's reader would, in ``work``; its output (stdout, then stderr)."""
    script = work / f".docs-block-{n}.{RUNNABLE[b.lang]}"
    script.write_text(b.code, encoding="utf-8")
    cmd = ["bash", "-e", "-o", "pipefail", script.name] if b.lang in ("bash", "sh") else ["python", script.name]
    env = subprocess_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    limit = TIMEOUT[RUNNABLE[b.lang]]
    # A session of its own: on a timeout the block's whole process group goes (worker pools included).
    p = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        raise AssertionError(f"{b.where}: still running after {limit} s:\n{b.code}\n{(stdout + stderr)[-2000:]}") from None
    out = stdout + stderr
    assert p.returncode == 0, f"{b.where}: exit {p.returncode}\n{b.code}\n{out[-4000:]}"
    assert "Traceback" not in out, f"{b.where}: printed a traceback\n{out[-4000:]}"
    return out


def runnable_pages() -> list[str]:
    return [p for p in PAGES if any(b.lang in RUNNABLE and (b.mark is None or b.mark[0] == "file") for b in blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", runnable_pages())
def test_the_pages_blocks_run_as_written(page, tmp_path):
    work, have_shared = _checkout(tmp_path)
    ran, outputs = 0, []
    for n, b in enumerate(blocks(page)):
        if b.needs_shared and not have_shared and (b.mark is None or b.mark[0] == "file") and b.lang in (*RUNNABLE, "yaml"):
            pytest.skip(f"{b.where} (and the blocks after it) read ../shared/data, absent here")
        if b.mark is not None and b.mark[0] == "file":
            (work / b.mark[1]).parent.mkdir(parents=True, exist_ok=True)
            (work / b.mark[1]).write_text(b.code, encoding="utf-8")
            continue
        if b.mark is not None or b.lang not in RUNNABLE:
            continue
        outputs.append(run_block(b, work, n))
        ran += 1
    assert ran
    if page in CLAIMS:
        CLAIMS[page](work, outputs)


# ------------------------------------------------------------------ what the pages say their commands show
def _train_steps(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r["step"] for r in map(json.loads, lines) if r.get("kind") == "train"]


def readme_claims(work: Path, outputs: list[str]) -> None:
    """README's "Using it" block: each command shows what its comment says."""
    out = "\n".join(outputs)
    run = work / "runs" / "alpaca-gpt2"
    assert "documents:" in out  # prepare's summary
    packed = re.search(r"^\{\n  \"packed\".*?^\}$", out, re.S | re.M)  # analyze --json --strategy packed
    assert packed and list(json.loads(packed.group(0))) == ["packed"], "analyze --strategy packed printed other strategies"
    assert (work / "runs" / "plan.json").is_file() and (work / "runs" / "lengths.txt").is_file()  # under runs/
    assert not (work / "plan.json").exists() and not (work / "lengths.txt").exists()
    assert "suggested learning rate:" in out and (run / "lr_finder.json").is_file()
    assert "without diverging" not in out  # its held-out loss ends 7x its lowest: the line says so (issue 55)
    assert "max_tokens_per_batch=" in out  # find-batch's suggestion
    assert _train_steps(run) == list(range(1, 9))  # 4 steps, then resumed to 8
    config = (run / "config.yaml").read_text(encoding="utf-8")
    assert "strategy: packed" in config and "max_steps: 8" in config
    assert sorted(p.name for p in (run / "plots").glob("*.png"))
    ev = [json.loads(line) for line in out.splitlines() if line.startswith("{") and line.endswith("}") and '"tokens"' in line]
    assert ev and ev[-1]["tokens"] > 0 and abs(ev[-1]["loss"] - 10.09) < 0.05  # eval --json: README's "near chance (10.09"
    assert "resumed from" in out and "data.tokenizer" in out and "batching.strategy" in out  # config --keys
    assert not [
        p
        for p in work.iterdir()
        if p.name not in {"configs", "runs", ".venv", ".densebatch-cache"} and not p.name.startswith(".docs-block-")
    ]


CLAIMS = {"README.md": readme_claims}
