"""Shared test fixtures: where ../shared/data lives (tests that need it skip when it is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]

# Property tests draw the same examples on every run by default, so a CI run is reproducible (its
# .hypothesis/ database is never kept); HYPOTHESIS_PROFILE=explore draws new ones (run it when changing
# an invariant: it found the fused head's scale bugs).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def shared_data_dir() -> Path | None:
    env = os.environ.get("DENSEBATCH_SHARED")
    for cand in ([Path(env) / "data"] if env else []) + [REPO.parent / "shared" / "data"]:
        if (cand / "README.md").is_file():
            return cand
    return None


@pytest.fixture
def shared_data() -> Path:
    d = shared_data_dir()
    if d is None:
        pytest.skip("../shared/data is absent")
    return d


@pytest.fixture(autouse=True)
def _few_threads():
    """Two pytest-xdist workers share two cores: one intra-op thread each avoids oversubscription."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
