"""Random-number-generator states (Python, NumPy, torch CPU, CUDA) as JSON-able data, captured and restored exactly.

Resume is exact only when every generator continues where it stopped: dropout masks come from the
torch generators, anything sampled in Python or NumPy from theirs. The state is plain JSON (lists of
ints, base64 strings) so a checkpoint can carry it in ``state.json`` without pickle.
"""

from __future__ import annotations

import base64
import random
import warnings
from typing import Any

import numpy as np
import torch

from densebatch.train.checkpoint.format import CheckpointError

RNG_FORMAT = 1


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


def capture_rng_state(include_cuda: bool | None = None) -> dict[str, Any]:
    """Every global generator's state as JSON-able data::

        {"format": 1,
         "python": {"version": 3, "state": [625 ints], "gauss_next": float | None},
         "numpy":  {"bit_generator": "MT19937", "key": [624 ints], "pos": int,
                    "has_gauss": int, "cached_gaussian": float},
         "torch":  base64 of torch.get_rng_state(),
         "cuda":   [base64 per device] | None}

    ``include_cuda=None`` captures CUDA only when CUDA is already initialised: a process that never
    touched the GPU has nothing to save, and capturing would create a CUDA context just for this.
    """
    version, mt, gauss_next = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    if include_cuda is None:
        include_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    cuda = [_b64(s) for s in torch.cuda.get_rng_state_all()] if include_cuda and torch.cuda.is_available() else None
    return {
        "format": RNG_FORMAT,
        "python": {"version": version, "state": list(mt), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": name,
            "key": key.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": _b64(torch.get_rng_state()),
        "cuda": cuda,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put every generator back to ``state`` (from ``capture_rng_state``). CUDA states are restored
    on as many devices as both runs have; a different device count warns (resume is then inexact)."""
    try:
        if state["format"] != RNG_FORMAT:
            raise CheckpointError(f"RNG state format {state['format']!r} is not supported (expected {RNG_FORMAT})")
        py, npy = state["python"], state["numpy"]
        py_state = (int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"])
        np_state = (
            npy["bit_generator"],
            np.asarray(npy["key"], dtype=np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached_gaussian"]),
        )
        torch_state = _unb64(state["torch"])
        cuda_states = [_unb64(s) for s in state["cuda"]] if state.get("cuda") else []
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"RNG state is malformed ({type(e).__name__}: {e}); was it written by capture_rng_state?") from None
    try:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"RNG state cannot be restored: {e}") from None
    if cuda_states:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have != len(cuda_states):
            warnings.warn(
                f"RNG state was captured on {len(cuda_states)} CUDA device(s), this process has {have}: "
                f"restoring {min(have, len(cuda_states))}; random draws on the GPU will differ from the original run",
                RuntimeWarning,
                stacklevel=2,
            )
        for i in range(min(have, len(cuda_states))):
            torch.cuda.set_rng_state(cuda_states[i], device=i)
