"""Mixtures: which documents of several weighted sources one epoch plans, drawn from the seed.

Sources lie end to end in one global document space: source s owns ids ``offsets[s] ..
offsets[s+1] - 1`` (the order a multi-source store concatenates them in). A weight is a relative
share of one epoch's *tokens*; the epoch holds ``epoch_tokens`` tokens (default: every source once,
so the epoch is as long as the natural one and only the shares move). Source s contributes
``target_s = epoch_tokens * w_s / sum(w)`` tokens per epoch, drawn from its *stream*: pass 0, pass 1,
... of its documents, each pass a seeded pseudo-random permutation (seed, source, pass; not the
epoch). Epoch e takes the documents whose first token falls in ``[e * target_s, (e+1) * target_s)``
of that stream. Hence:

- weight at the natural share: every epoch is exactly one pass: each document once.
- above it (ratio r = target_s / tokens_s > 1): whole passes (each document once per pass, repeated
  passes hold the same documents) plus part of the next pass, a seeded sample *without repetition*;
  the next epoch continues that pass where this one stopped, so over epochs every document is used
  once per pass and counts never differ by more than one pass.
- below it (r < 1): a seeded subset without repetition; later epochs continue the same pass, so a
  source at r = 1/2 shows every document exactly once over two epochs before any repeats.

A source's token share per epoch is exact up to one document at each end of its window. Nothing is
materialised per document: a ``Selection`` is a few segments (source, pass, range of the pass's
permutation, repeats); ``docs(v)`` maps virtual positions to global ids on demand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from densebatch.data.plan.bijection import Bijection

_PASS_TAG = 0x504153  # keeps pass permutations apart from other seeded streams of the same seed
_SCAN = 1 << 20  # documents per step when walking a pass to find where a token window starts / ends


@dataclass(frozen=True)
class Selection:
    """One epoch's documents: segments laid end to end in a virtual order (positions 0 .. num_docs - 1).

    Segment g holds positions ``lo[g] .. hi[g] - 1`` of pass ``passno[g]`` of source ``source[g]``,
    ``reps[g]`` times over (reps > 1 only for whole passes, which need no permutation: the planner
    shuffles). ``start`` (segments + 1) is the virtual position where each segment begins."""

    offsets: np.ndarray  # (sources + 1,) first global document id of each source
    source: np.ndarray
    passno: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    reps: np.ndarray
    tokens: np.ndarray  # tokens of one repeat of each segment
    start: np.ndarray
    seed: int
    names: tuple[str, ...]

    @property
    def num_docs(self) -> int:
        return int(self.start[-1])

    @property
    def num_sources(self) -> int:
        return len(self.offsets) - 1

    def _is_full(self, g: int) -> bool:
        s = self.source[g]
        return self.lo[g] == 0 and self.hi[g] == self.offsets[s + 1] - self.offsets[s]

    def docs(self, v) -> np.ndarray:
        """Global document ids at virtual positions ``v`` (int64, same order)."""
        v = np.asarray(v, dtype=np.int64)
        seg = np.searchsorted(self.start, v, side="right") - 1
        width = (self.hi - self.lo)[seg]
        j = self.lo[seg] + (v - self.start[seg]) % np.maximum(width, 1)  # position inside the pass
        out = j + self.offsets[self.source[seg]]
        for g in range(len(self.source)):
            if self._is_full(g):
                continue
            m = seg == g  # part of a pass: which documents it holds is the pass's permutation's business
            if m.any():
                s = int(self.source[g])
                perm = Bijection(int(self.offsets[s + 1] - self.offsets[s]), [self.seed, _PASS_TAG, s, int(self.passno[g])])
                out[m] = perm(j[m]) + self.offsets[s]
        return out

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(global document ids, source id per document) of the whole selection: small inputs only."""
        docs = self.docs(np.arange(self.num_docs, dtype=np.int64))
        return docs, self.source_of(docs)

    def source_of(self, docs) -> np.ndarray:
        return (np.searchsorted(self.offsets, np.asarray(docs, np.int64), side="right") - 1).astype(np.int64)

    def source_documents(self) -> np.ndarray:
        """Documents selected per source, counting repeats."""
        return np.bincount(self.source, weights=(self.hi - self.lo) * self.reps, minlength=self.num_sources).astype(np.int64)

    def source_tokens(self) -> np.ndarray:
        """Tokens selected per source (before any truncation by the planner)."""
        return np.bincount(self.source, weights=self.tokens * self.reps, minlength=self.num_sources).astype(np.int64)

    def stats(self) -> dict[str, dict]:
        """{source name: documents, tokens, share of the epoch's tokens} of this selection."""
        return _per_source(self.names, self.source_documents(), self.source_tokens())


def select_mixture(
    source_lengths: Sequence[np.ndarray],
    *,
    weights: Sequence[float] | None,
    seed: int,
    epoch: int,
    names: Sequence[str] | None = None,
    epoch_tokens: int | None = None,
) -> Selection:
    """The documents epoch ``epoch`` plans from sources with ``weights`` (None: natural shares)."""
    sizes = [len(x) for x in source_lengths]
    names = tuple(names) if names is not None else tuple(f"source{i}" for i in range(len(sizes)))
    if len(names) != len(sizes):
        raise ValueError(f"names: expected {len(sizes)} names, one per source; got {len(names)}")
    tokens = []
    for name, x in zip(names, source_lengths):  # one read of each source's lengths: their sum and their least
        total, least = 0, 1
        for c in _blocks(x):
            total, least = total + int(np.sum(c, dtype=np.int64)), min(least, int(np.min(c)))
        if least < 1:
            raise ValueError(f"source {name}: every document needs at least one token")
        tokens.append(total)
    total = sum(tokens) if epoch_tokens is None else int(epoch_tokens)
    targets = _targets(tokens, weights, total, names)
    for name, n, t in zip(names, sizes, targets):
        if t and not n:
            raise ValueError(f"source {name}: weight > 0 but the source has no documents; set its weight to 0 or add data")
    if epoch < 0:
        raise ValueError(f"epoch: expected a non-negative integer; got {epoch}")
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
    rows = []  # (source, pass, lo, hi, reps, tokens)
    for s, (x, n, t, target) in enumerate(zip(source_lengths, sizes, tokens, targets)):
        if target:
            rows += _window(x, s=s, n=n, t=t, a=epoch * target, b=(epoch + 1) * target, seed=seed)
    cols = np.array(rows, np.int64).reshape(-1, 6).T
    start = np.concatenate([[0], np.cumsum((cols[3] - cols[2]) * cols[4])]).astype(np.int64)
    return Selection(offsets, *cols, start, int(seed), names)


def _blocks(x, size: int = 1 << 20):
    """``x`` a million entries at a time (a store's lengths are read from disk, not held)."""
    for i in range(0, len(x), size):
        yield np.asarray(x[i : i + size])


def mixture_epoch(source_lengths, weights, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(global document ids, source id per document) of one epoch of a mixture: ``select_mixture`` materialised."""
    return select_mixture(source_lengths, weights=weights, seed=seed, epoch=epoch).arrays()


def plan_source_stats(plan, selection: Selection) -> dict[str, dict]:
    """{source name: documents, tokens, share} of the tokens a plan actually holds (after truncation).

    ``plan`` is a ``Plan`` (pieces summed here) or a ``ShardedPlan`` (its index already summed them)."""
    if getattr(plan, "source_tokens", None) is not None:
        return _per_source(selection.names, plan.source_documents, plan.source_tokens)
    src = selection.source_of(plan.doc)
    k = selection.num_sources
    tokens = np.bincount(src, weights=plan.stop - plan.start, minlength=k).astype(np.int64)
    docs = np.bincount(src[plan.start == 0], minlength=k).astype(np.int64)
    return _per_source(selection.names, docs, tokens)


# ---------------------------------------------------------------------------------- helpers
def _per_source(names, docs: np.ndarray, tokens: np.ndarray) -> dict[str, dict]:
    total = max(1, int(tokens.sum()))
    return {
        n: {"documents": int(d), "tokens": int(t), "share": int(t) / total}
        for n, d, t in zip(names, docs.tolist(), tokens.tolist())
    }


def _targets(tokens: list[int], weights, total: int, names) -> list[int]:
    """Tokens per source per epoch, exact rational arithmetic (weights equal to the natural token
    counts give every source exactly one pass, with no off-by-one token drifting across epochs)."""
    if weights is None:
        weights = tokens
    if len(weights) != len(tokens):
        raise ValueError(f"weights: expected {len(tokens)} weights, one per source; got {len(weights)}")
    w = []
    for name, x in zip(names, weights):
        if not np.isfinite(float(x)) or float(x) < 0:
            raise ValueError(f"source {name}: weight must be a finite number >= 0; got {x!r}")
        w.append(Fraction(x))
    if sum(w) <= 0:
        raise ValueError("weights: at least one source needs a weight > 0")
    return [round(Fraction(total) * wi / sum(w)) for wi in w]


def _window(lengths, *, s: int, n: int, t: int, a: int, b: int, seed: int) -> list[tuple]:
    """Segments of source s's stream whose documents start in tokens [a, b): whole passes become
    one repeated segment, partial passes a range of that pass's permutation."""
    out = []
    p = a // t
    while p * t < b:
        x0, x1 = max(a - p * t, 0), min(b - p * t, t)
        if x0 == 0 and x1 == t:
            full = (b - p * t) // t  # this and the following whole passes
            out.append((s, p, 0, n, full, t))
            p += full
            continue
        perm = Bijection(n, [seed, _PASS_TAG, s, p])
        inner = [x for x in (x0, x1) if 0 < x < t]  # window ends inside the pass: found by walking it
        cut = dict(zip(inner, _first_start_at_least(lengths, perm=perm, targets=inner, n=n, t=t)))
        cut[0], cut[t] = (0, 0), (n, t)
        (j0, c0), (j1, c1) = cut[x0], cut[x1]
        if j1 > j0:
            out.append((s, p, j0, j1, 1, c1 - c0))
        p += 1
    return out


def _first_start_at_least(lengths, *, perm: Bijection, targets: list[int], n: int, t: int) -> list[tuple[int, int]]:
    """For each target x (ascending): the first position j of the permuted pass whose document starts at
    token >= x, and that start (n and t when none does). Walks the pass in steps: memory O(step)."""
    found, base, i = [], 0, 0
    for a in range(0, n, _SCAN):
        if i == len(targets):
            break
        lens = np.asarray(lengths[perm.arange(a, min(n, a + _SCAN))], np.int64)
        starts = base + np.cumsum(lens) - lens
        while i < len(targets) and targets[i] <= starts[-1]:
            j = int(np.searchsorted(starts, targets[i], side="left"))
            found.append((a + j, int(starts[j])))
            i += 1
        base += int(lens.sum())
    found += [(n, t)] * (len(targets) - len(found))
    return found
