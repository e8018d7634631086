"""Fixtures of the model tests: a seeded generator for random documents (``densebatch.testing.batches``
packs them into a Batch)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)
