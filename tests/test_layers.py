"""Guards on the package's shape: layers never reach across, planning imports no torch, no import cycle.

The import graph is built with ``ast`` from every module of ``src/densebatch``, counting imports inside
functions too (a cycle hidden in a function is still a cycle). Each guard is a function of a
``{module: source}`` mapping, so a planted violation shows that it fails (negative controls below).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "densebatch"
LAYERS = ("data", "model", "train")
PLANNING = "densebatch.data.plan"
NO_TORCH = ("torch", "transformers", "peft", "safetensors")  # planning is numpy only


def package_sources(root: Path = PKG) -> dict[str, str]:
    """{dotted module name: source} of every module under ``root`` (a package's ``__init__`` is the package)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path.read_text(encoding="utf-8")
    return out


def imports_of(name: str, source: str, modules: set[str]) -> set[str]:
    """Every module ``name`` imports, anywhere in its body (functions included). ``from a import b``
    counts as importing ``a.b`` when that is a module of the package, else ``a``."""
    is_pkg = any(m.startswith(name + ".") for m in modules)
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: against this module's package
                parts = name.split(".")
                anchor = parts if is_pkg else parts[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    return out


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """{module: the package's modules it imports}."""
    modules = set(sources)
    return {m: {i for i in imports_of(m, s, modules) if i in modules and i != m} for m, s in sources.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _within(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def layer_violations(sources: dict[str, str]) -> list[str]:
    """data/, model/ and train/ import neither each other nor the wiring (``densebatch.run`` and any of
    its modules, ``densebatch.cli``)."""
    modules, problems = set(sources), []
    for name, source in sorted(sources.items()):
        layer = next((x for x in LAYERS if _within(name, f"densebatch.{x}")), None)
        if layer is None:
            continue
        for mod in sorted(imports_of(name, source, modules)):
            for other in LAYERS:
                if other != layer and _within(mod, f"densebatch.{other}"):
                    problems.append(f"{name} imports {mod}")
            if _within(mod, "densebatch.run") or _within(mod, "densebatch.cli"):
                problems.append(f"{name} imports {mod}")
    return problems


INTEGRATIONS = "densebatch.integrations"


def integration_violations(sources: dict[str, str]) -> list[str]:
    """The integrations' room is reached only through the package's public names: no module but the package's
    ``__init__`` (its lazy exports) imports ``densebatch.integrations``, and the room imports nothing of the
    command line's wiring (``densebatch.run``, ``densebatch.cli``)."""
    modules, problems = set(sources), []
    for name, source in sorted(sources.items()):
        inside = _within(name, INTEGRATIONS)
        for mod in sorted(imports_of(name, source, modules)):
            if not inside and name != "densebatch" and _within(mod, INTEGRATIONS):
                problems.append(f"{name} imports {mod}")
            if inside and (_within(mod, "densebatch.run") or _within(mod, "densebatch.cli")):
                problems.append(f"{name} imports {mod}")
    return problems


def planning_torch_imports(sources: dict[str, str]) -> list[str]:
    """Imports of torch (or a library built on it) reached from the planning package, following the
    package's own imports transitively (planning → config → ... counts)."""
    modules = set(sources)
    graph = import_graph(sources)
    seen, todo = set(), [m for m in modules if _within(m, PLANNING)]
    if not todo:
        return [f"{PLANNING} is not a package"]
    problems = []
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for i in sorted(imports_of(m, sources[m], modules)):
            if any(_within(i, t) for t in NO_TORCH):
                problems.append(f"{m} imports {i}")
        todo.extend(graph[m])
    return problems


def uncommented_local_imports(sources: dict[str, str]) -> list[str]:
    """Imports of a densebatch module inside a function without a comment on the line saying why (the one
    reason allowed: deferring a heavy or optional dependency, e.g. a fast ``--help``)."""
    problems = []
    for name, source in sorted(sources.items()):
        lines = source.splitlines()
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                mods += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if any(m == "densebatch" or m.startswith("densebatch.") for m in mods) and "#" not in lines[node.lineno - 1]:
                    problems.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return problems


# --------------------------------------------------------------------------------- the tree
def test_layers_do_not_reach_across():
    problems = layer_violations(package_sources())
    assert not problems, "\n".join(problems)


def test_integrations_are_a_room_reached_only_through_the_public_names():
    assert (PKG / "integrations" / "__init__.py").is_file()
    problems = integration_violations(package_sources())
    assert not problems, "\n".join(problems)


def test_planning_is_a_package_that_reaches_no_torch():
    assert (PKG / "data" / "plan" / "__init__.py").is_file()
    problems = planning_torch_imports(package_sources())
    assert not problems, "\n".join(problems)


def test_no_import_cycle_anywhere_counting_function_local_imports():
    found = cycles(import_graph(package_sources()))
    assert not found, "\n".join(" ⇄ ".join(c) for c in found)


def test_function_local_imports_of_the_package_say_why():
    problems = uncommented_local_imports(package_sources())
    assert not problems, "\n".join(problems)


def test_strategy_rules_live_with_the_planner():
    """No module outside ``data/plan/`` compares strategy names: each strategy's rules are the planner's."""
    compare = re.compile(r"strategy\s*(==|!=|\bin\b|\bnot in\b)")
    found = [
        f"{p.relative_to(PKG)}:{i}: {line.strip()}"
        for p in PKG.rglob("*.py")
        if not p.is_relative_to(PKG / "data" / "plan")
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if compare.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, "\n".join(found)


SIZE_REASON = re.compile(r"\(one concept, \d+ lines: [^)]+\)")  # the stated reason a module passes 400 lines


def size_problem(text: str) -> str | None:
    """Why a module breaks the size rule (None: it keeps it): at most 400 lines, or up to 500 with the reason
    in the first line of its docstring, ``(one concept, N lines: why it stays whole)``."""
    n = len(text.splitlines())
    if n > 500:
        return f"{n} lines (never past 500: split it by concept)"
    if n > 400 and not SIZE_REASON.search(((ast.get_docstring(ast.parse(text)) or "").splitlines() or [""])[0]):
        return f"{n} lines without '(one concept, N lines: why)' in its docstring's first line"
    return None


def test_modules_keep_the_size_rule():
    """Modules stay small enough to read whole: split by concept past 400 lines, unless the first docstring
    line says why the concept stays whole; never past 500."""
    found = [f"{p.relative_to(PKG)}: {why}" for p in PKG.rglob("*.py") if (why := size_problem(p.read_text(encoding="utf-8")))]
    assert not found, "\n".join(found)


def test_the_size_rule_catches_a_long_module_without_its_reason():
    body = "\n".join(f"x{i} = {i}" for i in range(420))
    assert size_problem(f'"""A module."""\n{body}\n') is not None
    assert size_problem(f'"""A module (one concept, 421 lines: a table).\n"""\n{body}\n') is None
    assert size_problem(f'"""A module (one concept, 601 lines: a table)."""\n{body}\n{body}\n') is not None


# ------------------------------------------------------------------- negative controls
def _planted(**extra: str) -> dict[str, str]:
    return package_sources() | {k.replace("__", "."): v for k, v in extra.items()}


def test_a_layer_importing_a_run_submodule_inside_a_function_is_caught():
    src = _planted(densebatch__data__load__planted="def f():\n    import densebatch.run.training\n")
    assert any("planted imports densebatch.run.training" in p for p in layer_violations(src))
    src = _planted(densebatch__train__planted="from densebatch.data.plan import planner\n")
    assert any("densebatch.train.planted imports densebatch.data.plan.planner" in p for p in layer_violations(src))


def test_a_layer_importing_the_integrations_and_an_integration_importing_run_are_caught():
    src = _planted(densebatch__train__planted="def f():\n    from densebatch.integrations import hf_loss\n")
    assert integration_violations(src) == ["densebatch.train.planted imports densebatch.integrations.hf_loss"]
    src = _planted(densebatch__integrations__planted="from densebatch.run import build\n")
    assert integration_violations(src) == ["densebatch.integrations.planted imports densebatch.run.build"]


def test_torch_reached_through_another_module_from_planning_is_caught():
    src = _planted(
        densebatch__data__plan__planted="from densebatch.data.plan import helper_planted\n",
        densebatch__data__plan__helper_planted="def f():\n    import torch.nn\n",
    )
    assert planning_torch_imports(src) == ["densebatch.data.plan.helper_planted imports torch.nn"]


def test_an_unexplained_function_local_import_is_caught():
    src = {
        "densebatch.x": "def f():\n    from densebatch.run import build\n\n\ndef g():\n    import densebatch.cli  # late: fast --help\n"
    }
    assert uncommented_local_imports(src) == ["densebatch.x:2: from densebatch.run import build"]


def test_a_cycle_through_a_function_local_import_is_caught():
    src = {
        "densebatch.a": "from densebatch import b\n",
        "densebatch.b": "def f():\n    from densebatch.c import x\n",
        "densebatch.c": "from .a import y\n",
        "densebatch": "",
    }
    assert cycles(import_graph(src)) == [["densebatch.a", "densebatch.b", "densebatch.c"]]
