"""DTensor shards as the checkpoint and the meta-device build meet them: whether a tensor is one, and where its rows begin.

FSDP2 turns parameters into ``DTensor`` s placed ``Shard(0)``; a checkpoint writes each rank's rows under
their global offset (``train/checkpoint/shards.py``), and ``train/meta_init.py`` materialises each rank's
rows of the whole build from the same offset.
"""

from __future__ import annotations

from typing import Any


def is_dtensor(t: Any) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def first_row(t) -> int:
    """The global index of the first row of DTensor ``t``'s local shard (0 for a 0-dimensional tensor)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return int(offset[0]) if t.dim() else 0
