"""Guards on the trees around the package: tests and benchmarks never import each other, benchmarks run as
modules (no ``sys.path`` edits), ``densebatch.testing`` is a leaf no other module of the package imports, and
docs/architecture.md names every module of the package (its map drifted once by 27 modules).

Code both trees need lives in ``densebatch.testing``. Imports are read with ``ast`` (inside functions too);
each guard is a function of a ``{path: source}`` mapping, so a planted violation shows that it fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support import imported

REPO = Path(__file__).resolve().parents[1]


def sources(folder: str) -> dict[str, str]:
    """{path relative to the repository: source} of every Python file under ``folder``."""
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in sorted((REPO / folder).rglob("*.py"))}


def reaching(files: dict[str, str], forbidden: set[str]) -> list[str]:
    """``path imports module`` for every import of ``files`` that is, or lies inside, a ``forbidden`` module
    (one line per statement: the shortest name that matched)."""
    problems = []
    for path, source in files.items():
        hits = sorted(m for m in imported(source) if any(m == f or m.startswith(f + ".") for f in forbidden))
        problems += [f"{path} imports {m}" for m in hits if not any(m.startswith(h + ".") for h in hits)]
    return problems


def path_edits(files: dict[str, str]) -> list[str]:
    """Every use of ``sys.path`` in ``files``."""
    return [
        f"{path}:{node.lineno} uses sys.path"
        for path, source in files.items()
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"
    ]


def module_names(files: dict[str, str]) -> set[str]:
    """The names a tree's files are imported by when their folder is on the path (``support``, ``common``)."""
    return {Path(p).stem for p in files} - {"__init__"}


# --------------------------------------------------------------------------------- the trees
def test_tests_import_no_benchmark_and_benchmarks_import_no_test():
    tests, benchmarks = sources("tests"), sources("benchmarks")
    problems = reaching(tests, {"benchmarks"} | module_names(benchmarks) - module_names(tests))
    problems += reaching(benchmarks, {"tests"} | module_names(tests) - module_names(benchmarks))
    assert not problems, "\n".join(problems)


def test_benchmarks_edit_no_import_path():
    problems = path_edits(sources("benchmarks"))
    assert not problems, "\n".join(problems)


def test_no_module_of_the_package_imports_densebatch_testing():
    package = {p: s for p, s in sources("src/densebatch").items() if not p.startswith("src/densebatch/testing/")}
    problems = reaching(package, {"densebatch.testing"})
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------- negative controls
def test_planted_violations_are_caught():
    assert reaching({"tests/t.py": "def f():\n    from benchmarks.common import CACHE\n"}, {"benchmarks"}) == [
        "tests/t.py imports benchmarks.common"
    ]
    assert reaching({"benchmarks/b.py": "import support\n"}, {"support"}) == ["benchmarks/b.py imports support"]
    planted = {"src/densebatch/train/x.py": "from densebatch.testing.batches import pack\n"}
    assert reaching(planted, {"densebatch.testing"}) == ["src/densebatch/train/x.py imports densebatch.testing.batches"]
    planted = {"src/densebatch/train/x.py": "from densebatch import testing\n"}
    assert reaching(planted, {"densebatch.testing"}) == ["src/densebatch/train/x.py imports densebatch.testing"]
    assert path_edits({"benchmarks/b.py": "import sys\nsys.path.insert(0, 'x')\n"}) == ["benchmarks/b.py:2 uses sys.path"]


def unmapped(files: list[str], doc: str) -> list[str]:
    """The package modules (paths under ``src/densebatch``) that the architecture doc ``doc`` never names, by
    their path inside the package or their file name."""
    inside = [str(Path(f).relative_to("src/densebatch")) for f in files if not f.endswith("__init__.py")]
    named = lambda name: re.search(rf"(?<![\w.]){re.escape(name)}", doc)  # noqa: E731  (not store_io.py for io.py)
    return [m for m in inside if not named(m) and not named(Path(m).name)]


def test_the_architecture_doc_names_every_module_of_the_package():
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert unmapped(list(sources("src/densebatch")), doc) == [], "place it in docs/architecture.md's module map"
    assert unmapped(["src/densebatch/data/prepare/new_stage.py"], doc) == ["data/prepare/new_stage.py"]
