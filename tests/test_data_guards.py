"""Guards on the data layer's shape: strategy names are spelled only where strategies are defined, and the
stages of ``data/`` stand on the store without reaching into each other.

- A batching strategy's name (``random``, ``length_grouped``, ``token_budget``, ``packed``) appears as a
  string only in ``data/plan/strategies.py`` (the ``Strategy`` objects and their registry) and in
  ``config/`` (the ``batching.strategy`` Literal): every other module asks the strategy object.
- No module of ``data/prepare/`` imports ``densebatch.data.plan``, and none of ``data/plan/`` or
  ``data/load/`` imports ``densebatch.data.prepare``: what they share is ``data/store/``.

Each guard is a function of a ``{path: source}`` mapping, so a planted violation shows that it fails.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import numpy as np
from support import imported

from densebatch.config import BatchingConfig
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.strategies import DEFAULT_STRATEGY, STRATEGIES

PKG = Path(__file__).resolve().parents[1] / "src" / "densebatch"
NAME = re.compile(r"""['"](random|length_grouped|token_budget|packed)['"]""")  # the issue's own check, as git grep runs it
NAMES_ALLOWED = ("data/plan/strategies.py", "config/")
STAGES_APART = {  # folder of data/: the stages its modules must not import
    "data/prepare/": ("densebatch.data.plan",),
    "data/plan/": ("densebatch.data.prepare",),
    "data/load/": ("densebatch.data.prepare",),
}


def package_files() -> dict[str, str]:
    """{path inside the package: source} of every module."""
    return {str(p.relative_to(PKG)): p.read_text(encoding="utf-8") for p in sorted(PKG.rglob("*.py"))}


def strategy_names_spelled(files: dict[str, str]) -> list[str]:
    """``path:line: text`` of every string spelling a strategy's name outside the allowed modules."""
    return [
        f"{path}:{i}: {line.strip()}"
        for path, source in files.items()
        if not path.startswith(NAMES_ALLOWED)
        for i, line in enumerate(source.splitlines(), 1)
        if NAME.search(line)
    ]


def stages_reaching_across(files: dict[str, str]) -> list[str]:
    """``path imports module`` for every import of a stage that another stage of ``data/`` forbids it."""
    problems = []
    for path, source in files.items():
        forbidden = next((f for folder, f in STAGES_APART.items() if path.startswith(folder)), ())
        hits = sorted(m for m in imported(source) if any(m == f or m.startswith(f + ".") for f in forbidden))
        problems += [f"{path} imports {m}" for m in hits if not any(m.startswith(h + ".") for h in hits)]
    return problems


# --------------------------------------------------------------------------------- the package
def test_strategy_names_are_spelled_only_by_the_strategies_and_the_config():
    found = strategy_names_spelled(package_files())
    assert not found, "ask STRATEGIES[...] instead:\n" + "\n".join(found)


def test_prepare_plan_and_load_import_nothing_of_each_other():
    problems = stages_reaching_across(package_files())
    assert not problems, "\n".join(problems)
    assert (PKG / "data" / "store" / "__init__.py").is_file()


def test_the_registry_holds_four_strategies_with_a_plan_and_a_fixed_seed_tag():
    assert list(STRATEGIES) == ["random", "length_grouped", "token_budget", "packed"]
    assert [s.seed_tag for s in STRATEGIES.values()] == [0, 1, 2, 3]  # today's seeds: plans never move
    assert all(name == s.name and callable(s.plan) for name, s in STRATEGIES.items())
    lengths = np.array([5, 3, 9, 1, 4], np.int64)
    for s in STRATEGIES.values():
        settings = PlanSettings(strategy=s.name, rows_per_batch=2, seq_len=16, max_tokens_per_batch=32)
        plan = s.plan(lengths, settings, np.random.default_rng(0))
        assert sorted(plan.doc.tolist()) == [0, 1, 2, 3, 4]


def test_the_config_literal_names_exactly_the_registered_strategies():
    literal = typing.get_args(typing.get_type_hints(BatchingConfig)["strategy"])
    assert list(literal) == list(STRATEGIES) and BatchingConfig().strategy == DEFAULT_STRATEGY


# ------------------------------------------------------------------- negative controls
def test_a_strategy_name_spelled_outside_the_strategies_is_caught():
    planted = {
        "run/planted.py": "if cfg.batching.strategy == 'packed':\n    pass\n",
        "data/load/planted.py": 'UNITS = {"token_budget": 1}\n',
        "data/plan/strategies.py": 'name = "packed"\n',
        "config/data_sections.py": 'Literal["random", "packed"]\n',
        "data/plan/other.py": "'''packed rows'''\n",
    }
    assert strategy_names_spelled(planted) == [
        "run/planted.py:1: if cfg.batching.strategy == 'packed':",
        'data/load/planted.py:1: UNITS = {"token_budget": 1}',
    ]


def test_a_stage_importing_another_stage_is_caught():
    planted = {
        "data/prepare/planted.py": "def f():\n    from densebatch.data.plan.store_epochs import epoch_shares\n",
        "data/plan/planted.py": "from densebatch.data.prepare import store\n",
        "data/load/planted.py": "import densebatch.data.prepare.sources\n",
        "data/plan/fine.py": "from densebatch.data.store.store import DocumentStore\n",
        "run/fine.py": "from densebatch.data.prepare.pipeline import prepare\nfrom densebatch.data.plan import rules\n",
    }
    assert stages_reaching_across(planted) == [
        "data/prepare/planted.py imports densebatch.data.plan.store_epochs",
        "data/plan/planted.py imports densebatch.data.prepare",
        "data/load/planted.py imports densebatch.data.prepare.sources",
    ]
