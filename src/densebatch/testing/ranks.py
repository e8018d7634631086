"""Ranks in one machine for tests and benchmarks: a function run on N processes joined in a gloo group.

``on_ranks(fn, world, *args)`` starts ``world`` processes (``fork`` by default: they share the caller's
imports, about 0.3 s each where a fresh interpreter importing torch and transformers takes 5-10 s on two
loaded cores), joins them in a gloo process group on a free localhost port, runs ``fn(rank, world, *args)``
on each with one intra-op thread, and returns when all have; an error on any rank raises in the caller
with that rank's traceback (``torch.multiprocessing``'s), and the others are ended.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # before any parallel region: a forked OpenMP pool is not the child's
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def on_ranks(fn: Callable, world: int, *args, start_method: str = "fork") -> None:
    """``fn(rank, world, *args)`` on ``world`` processes in one gloo group (``fn`` and ``args`` must be
    picklable under ``spawn``: module-level functions)."""
    mp.start_processes(_rank_main, args=(world, free_port(), fn, args), nprocs=world, start_method=start_method, join=True)
