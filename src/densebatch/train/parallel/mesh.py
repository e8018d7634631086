"""The ranks of a run as a mesh of data × context ranks (``train.context_parallel``), on torch's ``DeviceMesh``.

World = data ranks × context ranks (N = ``train.context_parallel``). The N context ranks of one data rank read
the same rows (the data layer's plan is dealt over the data ranks alone) and each keeps its columns of them
(``shards.py``); gradients are reduced over the whole world by DDP or FSDP2 as before, since the context
ranks' gradients are parts of one sum (each holds its own targets). Ranks are laid out context-minor, as
``init_device_mesh((data, context))`` numbers them: the context ranks of a data rank are neighbours (the same
node, where the all-to-all of every layer is cheapest).
"""

from __future__ import annotations

from dataclasses import dataclass

from densebatch import torch_features
from densebatch.errors import ConfigError
from densebatch.train.distributed import Distributed


@dataclass(frozen=True)
class ContextRanks:
    """Where this rank sits in the data × context mesh; ``degree`` 1 (the default) is no split at all."""

    degree: int = 1  # context ranks sharing every row (N)
    index: int = 0  # this rank's place among them
    data_rank: int = 0  # which share of each step this rank's data rank reads
    data_size: int = 1  # data ranks (world / N)
    group: object = None  # the context ranks' process group (None when degree is 1)
    mesh: object = None  # the DeviceMesh ("data", "context"), None when degree is 1

    @property
    def split(self) -> bool:
        return self.degree > 1


def check_world(world: int, degree: int) -> None:
    """``ConfigError`` in one line when ``degree`` context ranks do not divide ``world`` processes."""
    if degree < 1 or world % degree:
        raise ConfigError(
            f"train.context_parallel: {degree} context ranks do not divide the {world} process"
            f"{'es' if world > 1 else ''} of this run (world = data ranks x context ranks); launch a multiple of {degree}"
        )


def context_ranks(dist: Distributed, degree: int) -> ContextRanks:
    """The mesh of ``dist``'s world with ``degree`` context ranks (``check_world`` first: every rank says the
    same, before any work). Every rank calls it (the mesh's process groups are made collectively)."""
    world = dist.world_size
    check_world(world, degree)
    if degree == 1:
        return ContextRanks(data_rank=dist.rank, data_size=world)
    torch_features.require(
        torch_features.all_to_all_autograd(), "torch.distributed's all_to_all_single_autograd", "train.context_parallel"
    )
    from torch.distributed.device_mesh import init_device_mesh  # torch.distributed: only when rows are split

    mesh = init_device_mesh(dist.device.type, (world // degree, degree), mesh_dim_names=("data", "context"))
    data_rank, index = mesh.get_coordinate()
    return ContextRanks(degree, index, data_rank, world // degree, mesh["context"].get_group(), mesh)
