"""``train.context_parallel``: what it needs, refused in one line before any work, and the mesh of ranks it builds.

``context_mesh(cfg, dist)`` is the first thing every training command does after finding its device (before
documents are prepared or a model is built), on every rank: a kernel that cannot attend across ranks
(transformers' own ``sdpa`` / ``eager``), an encoder (``batching.mode: mlm``, not covered), a budget that
``auto`` would probe on unsplit rows, rows of a fixed length (``batching.seq_len``) that 2N does not divide,
heads the all-to-all cannot split (read from the model's configuration) and a degree that does not divide the
world are each one ``ConfigError``; then the ranks' ``DeviceMesh`` (``train/parallel/mesh.py``).
"""

from __future__ import annotations

from densebatch.config import RunConfig
from densebatch.data.plan.rules import longest_train_row
from densebatch.errors import ConfigError
from densebatch.model import attention_heads
from densebatch.model.context_attention import heads_problem
from densebatch.train.distributed import Distributed
from densebatch.train.parallel.mesh import ContextRanks, check_world, context_ranks

KEY = "train.context_parallel"


def check_context_parallel(cfg: RunConfig, world_size: int) -> None:
    """``ConfigError`` in one line for what ``train.context_parallel`` cannot run with (see the module docstring)."""
    N = cfg.train.context_parallel
    if N == 1:
        return
    b, m = cfg.batching, cfg.model
    if m.kind == "hf" and m.attn_implementation != "densebatch":
        raise ConfigError(
            f"{KEY}: model.attn_implementation {m.attn_implementation} (transformers' own kernel) cannot attend across "
            "context ranks; use densebatch (its kernels run on whole rows of a share of the heads)"
        )
    if b.mode == "mlm":
        raise ConfigError(f"{KEY}: splits the rows of causal models; batching.mode mlm (an encoder) runs with 1")
    if b.max_tokens_per_batch == "auto":
        raise ConfigError(
            f"{KEY}: batching.max_tokens_per_batch auto probes whole rows on one rank; set a number "
            "(each rank then holds that budget's rows / context ranks)"
        )
    row, key = longest_train_row(b, 0)
    if key == "batching.seq_len" and row % (2 * N):
        raise ConfigError(
            f"{key}: rows of {row} tokens do not split into {2 * N} equal chunks (a head and a tail for each of "
            f"{N} context ranks); use a multiple of {2 * N}"
        )
    if (problem := heads_problem(*attention_heads(m), N)) is not None:
        raise ConfigError(f"{KEY}: {problem}; use a context_parallel that divides the heads")
    check_world(world_size, N)


def context_mesh(cfg: RunConfig, dist: Distributed) -> ContextRanks:
    """This rank's place in the data × context mesh of ``cfg.train.context_parallel`` ranks, checked first."""
    check_context_parallel(cfg, dist.world_size)
    return context_ranks(dist, cfg.train.context_parallel)


def mesh_line(cfg: RunConfig, ranks: ContextRanks) -> str | None:
    """The line a run prints about its mesh when rows are split (None when they are not)."""
    if not ranks.split:
        return None
    N, D = ranks.degree, ranks.data_size
    return (
        f"{KEY} {N}: {D * N} processes = {D} data rank{'s' if D > 1 else ''} x {N} context ranks; each rank holds 1/{N} "
        f"of every row (chunks i and {2 * N - 1}-i of {2 * N}), attention exchanged by an all-to-all over heads in every layer"
    )
