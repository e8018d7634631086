"""Shared test fixtures: ../shared/data (tests that need it skip when it is absent), reproducible property
tests, one intra-op thread per pytest-xdist worker. Helpers that test modules import are in support.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from support import shared_data_dir

# Property tests draw the same examples on every run by default, so a CI run is reproducible (its
# .hypothesis/ database is never kept); HYPOTHESIS_PROFILE=explore draws new ones (run it when changing
# an invariant: it found the fused head's scale bugs).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
# tests/mutations.py: a planted bug must fail a test; the failure is reported, not minimised (shrinking takes minutes)
settings.register_profile("mutations", derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


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
