"""Helpers of many test modules: where ../shared/data is, in-memory document stores, and how a child run
(a subprocess, torchrun) is started.

Test modules import it by name (``from support import memory_store``): pytest puts tests/ on the
import path (``pythonpath`` in pyproject.toml). Helpers that benchmarks need as well (packed batches,
tiny models, the book's collate) live in ``densebatch.testing`` instead, since tests and benchmarks
never import each other.
"""

from __future__ import annotations

import ast
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from densebatch.data.store.store import DocumentStore

REPO = Path(__file__).resolve().parents[1]
GPT2_EOS = 50256


# ------------------------------------------------------------------------------ ../shared/data
def shared_data_dir() -> Path | None:
    """../shared/data beside the checkout, or $DENSEBATCH_SHARED/data; None when absent (tests skip)."""
    env = os.environ.get("DENSEBATCH_SHARED")
    for cand in ([Path(env) / "data"] if env else []) + [REPO.parent / "shared" / "data"]:
        if (cand / "README.md").is_file():
            return cand
    return None


# ------------------------------------------------------------------------------ document stores
def memory_store(
    docs: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]] | None = None,
    *,
    eos_id: int = GPT2_EOS,
    pad_id: int = GPT2_EOS,
    vocab_size: int = GPT2_EOS + 1,
    mask_id: int | None = None,
    special_ids: Sequence[int] = (GPT2_EOS,),
) -> DocumentStore:
    """An in-memory ``DocumentStore`` of ``docs`` (token lists); ``masks``: each token's loss flag
    (default: every token carries loss)."""
    masks = masks or [[1] * len(d) for d in docs]
    meta = {"eos_id": eos_id, "pad_id": pad_id, "vocab_size": vocab_size, "mask_id": mask_id, "special_ids": list(special_ids)}
    return DocumentStore.from_documents(zip(docs, masks), meta)


def random_store(n: int, seed: int = 0, vocab: int = 100, lengths: tuple[int, int] = (1, 40)) -> DocumentStore:
    """``n`` documents of random ids in [1, vocab), each ended by id 0 (end-of-text and padding), with
    ``lengths[0]`` to ``lengths[1] - 1`` ids before it; every token carries loss."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, vocab, int(k)).tolist() + [0] for k in rng.integers(*lengths, n)]
    return memory_store(docs, eos_id=0, pad_id=0, vocab_size=vocab, special_ids=(0,))


# ------------------------------------------------------------------------------ child runs
BIN = Path(sys.executable).parent  # the environment's scripts: densebatch, torchrun


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a child run: one intra-op thread (two pytest-xdist workers share two cores,
    and the children then compute with the kernels of the one-thread runs they are compared with),
    unbuffered output (a test reads it while the child runs)."""
    # PYTHONFAULTHANDLER: a child that aborts (SIGABRT, e.g. a thread killed inside a torch op at exit) prints
    # every thread's Python stack, so a rare abort in CI names its thread
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **extra)


def torchrun(args: list[str], nproc: int = 2, script: Path | None = None) -> list[str]:
    """The command of ``densebatch ARGS`` (or ``python SCRIPT ARGS``) under ``torchrun --standalone`` with
    ``nproc`` processes."""
    program = [str(BIN / "densebatch")] if script is None else [sys.executable, str(script)]
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "--no-python", *program, *args]


def torchrun_node(port: int, rdzv_id: str, args: list[str]) -> list[str]:
    """The command of one node of two (one process each) of ``densebatch ARGS``, rendezvous on localhost."""
    launcher = [str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}", "--no-python", str(BIN / "densebatch")]  # fmt: skip
    return [*launcher, *args]


def free_port() -> int:
    """A TCP port free on localhost now (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ import guards
def imported(source: str) -> set[str]:
    """The absolute module names a source imports, anywhere in its body (``from a import b``: ``a``, and
    ``a.b`` in case ``b`` is a module): what the tree and stage guards check."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def documents_of(store) -> list[list[int]]:
    """Every document of ``store`` (any store: ours, foreign, mixed), its ids read through ``doc_spans``."""
    from densebatch.data.store.store_io import read_ranges

    starts, lengths = store.doc_spans(np.arange(len(store)))
    return [read_ranges(store.tokens, np.array([a]), np.array([a + n])).tolist() for a, n in zip(starts, lengths)]


def split_of(docs: list, fraction: float) -> tuple[list, list]:
    """(train, eval) of one file's ``docs`` under a foreign corpus's eval rule (``foreign.held_out``)."""
    from densebatch.data.prepare.foreign import held_out

    ev = held_out(len(docs), fraction)
    return [d for d, e in zip(docs, ev) if not e], [d for d, e in zip(docs, ev) if e]


def served_loss_tokens(store) -> np.ndarray:
    """Each document's targets as the collator serves them (its labels that are not -100, the document alone in
    a row): what ``store.doc_loss_tokens`` must count."""
    from densebatch.data.load.collate import CausalCollator

    _, lengths = store.doc_spans(np.arange(len(store)))
    batch = CausalCollator(pad_id=0)(store, [[(d, 0, int(n))] for d, n in enumerate(lengths)])
    return (batch.labels != -100).sum(dim=1).numpy()
