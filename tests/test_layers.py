"""Guard: data/, model/ and train/ never import each other; planning imports no torch."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "densebatch"
LAYERS = ("data", "model", "train")


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative import inside a layer: resolve against the package
                base = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[: -node.level])
                mods.add(f"{base}.{node.module}")
            else:
                mods.add(node.module)
    return mods


def test_layers_do_not_reach_across():
    problems = []
    for layer in LAYERS:
        for path in (PKG / layer).rglob("*.py"):
            for mod in _imports(path):
                for other in LAYERS:
                    if other != layer and (mod == f"densebatch.{other}" or mod.startswith(f"densebatch.{other}.")):
                        problems.append(f"{path.relative_to(PKG)} imports {mod}")
                if mod in ("densebatch.run", "densebatch.cli"):
                    problems.append(f"{path.relative_to(PKG)} imports {mod}")
    assert not problems, "\n".join(problems)


def test_planning_imports_no_torch():
    mods = _imports(PKG / "data" / "plan.py")
    assert not any(m == "torch" or m.startswith("torch.") for m in mods)


def test_no_module_over_400_lines():
    """Modules stay small enough to read whole: split by responsibility past 400 lines."""
    long = [
        f"{p.relative_to(PKG)}: {n}" for p in PKG.rglob("*.py") if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400
    ]
    assert not long, "\n".join(long)
