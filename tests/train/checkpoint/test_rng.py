"""RNG states: capture → draw A → restore → draw B gives A == B for every generator, through JSON."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from densebatch.train.checkpoint.manager import CheckpointError
from densebatch.train.checkpoint.rng import capture_rng_state, restore_rng_state


def draw_all() -> dict:
    out = {
        "python": [random.random() for _ in range(5)] + [random.gauss(0, 1)],
        "numpy": np.random.standard_normal(5).tolist() + np.random.randint(0, 1000, 5).tolist(),
        "torch": torch.randn(5).tolist() + torch.randint(0, 1000, (5,)).tolist(),
        "dropout": torch.nn.functional.dropout(torch.ones(64), 0.5).tolist(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.randn(5, device="cuda").tolist()
    return out


@pytest.mark.parametrize("half_gauss", [False, True])
def test_round_trip_is_exact_for_every_generator(half_gauss):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draw_all()
    # Python and NumPy both cache the second value of a Box-Muller pair: test with and without one.
    while (random.getstate()[2] is not None) != half_gauss:
        random.gauss(0, 1)
    while bool(np.random.get_state()[3]) != half_gauss:
        np.random.standard_normal()
    state = json.loads(json.dumps(capture_rng_state()))  # must survive state.json
    a = draw_all()
    draw_all()  # move on, so the restore has something to undo
    restore_rng_state(state)
    b = draw_all()
    assert a == b
    assert (state["python"]["gauss_next"] is not None) == half_gauss
    assert state["numpy"]["has_gauss"] == int(half_gauss)


def test_state_is_plain_json():
    state = capture_rng_state()
    assert set(state) == {"format", "python", "numpy", "torch", "cuda"}
    assert json.loads(json.dumps(state)) == state
    assert len(state["python"]["state"]) == 625 and len(state["numpy"]["key"]) == 624


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_states_are_captured_when_initialised():
    torch.randn(1, device="cuda")
    assert len(capture_rng_state()["cuda"]) == torch.cuda.device_count()


def test_malformed_state_is_a_clear_error():
    state = capture_rng_state()
    before = random.getstate()
    for broken in ({**state, "python": {"version": 3}}, {**state, "torch": "not base64!"}, {**state, "format": 99}):
        with pytest.raises(CheckpointError, match="RNG state"):
            restore_rng_state(broken)
    assert random.getstate() == before  # nothing restored halfway
