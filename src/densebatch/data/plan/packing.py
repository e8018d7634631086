"""Packing algorithms on sorted lengths and length histograms (numpy only), used by ``plan``.

``best_fit_decreasing`` + ``layout_rows`` pack pieces into rows (``bundle`` first groups short pieces at
random, so rows mix lengths); ``greedy_cuts`` / ``exact_cuts``
cut a length-sorted sequence into token-budget batches; ``cut_long`` cuts documents longer than a
row into pieces; ``desc_random_ties`` / ``sorted_desc`` order lengths without comparison sorts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Groups:
    """Rows built by best-fit decreasing, as groups of identical rows. Group g's rows hold the
    items of its parent plus ``mult[g]`` items of ``length[g]``; ``count[g]`` rows end as exactly
    that (its other rows received more items and live on in child groups). Group 0 is the empty row."""

    parent: list[int]
    length: list[int]
    mult: list[int]
    count: list[int]


def best_fit_decreasing(hist: np.ndarray, S: int) -> Groups:
    """Best-fit decreasing of items with ``hist[L]`` items of length L (L <= S) into rows of S.

    Exact BFD (ties between rows of equal remaining capacity do not change the row count), run over
    groups of identical rows: all open rows of one remaining capacity that receive the same items
    move together, so the loop is over (distinct lengths x capacity levels), never over items:
    ~6k groups and ~0.05 s for 10M lognormal lengths at S = 2048.
    """
    # groups: parent, (length, multiplicity) added, live count; a group's row contents are its chain.
    parent, glen, gmul, gcount = [-1], [0], [0], [0]
    levels: dict[int, list[int]] = {}  # remaining capacity -> live groups
    level_n = np.zeros(S + 1, np.int64)  # rows per remaining capacity (for the best-fit search)

    def add(g, *, L, m, cnt, rem):
        parent.append(g), glen.append(L), gmul.append(m), gcount.append(cnt)
        levels.setdefault(rem, []).append(len(parent) - 1)
        level_n[rem] += cnt

    for L in np.flatnonzero(hist)[::-1].tolist():
        c = int(hist[L])
        while c:
            nz = np.flatnonzero(level_n[L:])
            if len(nz) == 0:  # open new rows: each takes q = S // L items
                q = S // L
                if c >= q:
                    add(0, L=L, m=q, cnt=c // q, rem=S - q * L)
                    c -= c // q * q
                if c:
                    add(0, L=L, m=c, cnt=1, rem=S - c * L)
                    c = 0
                continue
            rem = L + int(nz[0])  # best fit: the smallest remaining capacity that holds L
            q = rem // L
            groups = levels[rem]
            while c and groups:
                g = groups[-1]
                full = min(gcount[g], c // q)
                if full:
                    gcount[g] -= full
                    level_n[rem] -= full
                    add(g, L=L, m=q, cnt=full, rem=rem - q * L)
                    c -= full * q
                if c and c < q and gcount[g]:  # the rest all fit in one more row of this level
                    gcount[g] -= 1
                    level_n[rem] -= 1
                    add(g, L=L, m=c, cnt=1, rem=rem - c * L)
                    c = 0
                if gcount[g] == 0:
                    groups.pop()
    return Groups(parent, glen, gmul, gcount)


def layout_rows(groups: Groups, *, order: np.ndarray, seq_len: int, rows_per_batch: int, rng):
    """Turn live groups (count x chain of (length, multiplicity)) into shuffled CSR rows.

    ``order`` lists pieces longest first; returns (src: plan position -> piece, its length, row_ptr, batch_ptr).
    One vectorised scatter per (group, entry) block: a few thousand blocks for 10M pieces.

    Rows at most half full (best-fit leaves at most one) are batched apart, so that their padding
    costs their own length, not seq_len: on oasst-threads this is fill 0.998 instead of 0.988."""
    parent, glen, gmul, gcount = groups.parent, groups.length, groups.mult, groups.count
    live = [g for g in range(1, len(parent)) if gcount[g]]
    blocks = []  # (length, multiplicity, group rank, offset of this entry inside the row)
    row_size, row_tokens = [], []
    for gi, g in enumerate(live):
        chain = []
        while g > 0:
            chain.append((glen[g], gmul[g]))
            g = parent[g]
        off = 0
        for L, m in reversed(chain):
            blocks.append((L, m, gi, off))
            off += m
        row_size.append(off)
        row_tokens.append(sum(L * m for L, m in chain))
    counts = np.array([gcount[g] for g in live], np.int64)
    blocks.sort(key=lambda b: -b[0])  # stable: pieces are sorted longest first, so blocks consume them in order
    nrows, k = int(counts.sum()), rows_per_batch
    # row order: shuffled, except that the (rare) half-empty rows form batches of their own
    small = np.repeat(2 * np.array(row_tokens, np.int64) <= seq_len, counts)
    nfull, nsmall = nrows - int(small.sum()), int(small.sum())
    newpos = np.empty(nrows, np.int64)
    nfb = -(-nfull // k)
    at = min(int(rng.integers(0, nfb + 1)) * k, nfull)  # where the small rows' batches go among the full ones
    pos = rng.permutation(nfull)
    newpos[~small] = np.where(pos >= at, pos + nsmall, pos)
    newpos[small] = at + rng.permutation(nsmall)
    new_sizes = np.empty(nrows, np.int64)
    new_sizes[newpos] = np.repeat(np.array(row_size, np.int64), counts)
    row_ptr = np.concatenate([[0], np.cumsum(new_sizes)])
    row_base = np.concatenate([[0], np.cumsum(counts)[:-1]])  # first row of each group
    src = np.empty(len(order), np.int64)
    src_len = np.empty(len(order), np.int64)  # known per block: saves a random gather of 10M lengths
    first: dict[int, np.ndarray] = {}  # group -> first plan position of each of its rows
    k0 = 0
    for L, m, gi, off in blocks:
        if gi not in first:
            first[gi] = row_ptr[newpos[row_base[gi] : row_base[gi] + counts[gi]]]
        n = int(counts[gi]) * m
        dest = (first[gi] + off)[:, None] + np.arange(m)  # (rows of the group, m)
        src[dest.reshape(-1)] = order[k0 : k0 + n]
        src_len[dest.reshape(-1)] = L
        k0 += n
    batch_ptr = np.concatenate(
        [np.arange(0, at, k), np.arange(at, at + nsmall, k), np.arange(at + nsmall, nrows, k), [nrows]]
    ).astype(np.int64)  # full batches, the small rows' batches, full batches
    return src, src_len, row_ptr, batch_ptr


@dataclass
class Bundles:
    """Items to pack: item i holds pieces ``members[ptr[i]:ptr[i + 1]]`` (in that order), ``length[i]`` tokens."""

    length: np.ndarray
    members: np.ndarray
    ptr: np.ndarray

    def expand(self, items: np.ndarray) -> np.ndarray:
        """The pieces of ``items``, item after item."""
        return self.members[ranges(self.ptr[items], self.ptr[items + 1])]

    def counts(self, items: np.ndarray) -> np.ndarray:
        return self.ptr[items + 1] - self.ptr[items]


FILLER_SHARE = 0.1  # short pieces left out of bundles, at random: best-fit fills the rows' gaps with them


def bundle(plen: np.ndarray, cap: int, rng, fillers: float = FILLER_SHARE) -> Bundles:
    """Group the pieces of at most ``cap`` tokens, in random order, into bundles of ``cap`` to ``2 * cap``
    tokens; longer pieces, and a random share ``fillers`` of the short ones, stay items of their own.

    Packing bundles instead of pieces gives rows whose documents are a random sample of the epoch:
    best-fit decreasing alone fills each row with pieces of similar length, which in instruction data
    means of one task or source. The fillers keep the fill of best-fit decreasing (measured in
    docs/benchmarks.md; without them, fill fell from 0.994 to 0.939 on the instruction data at 2,048); a
    plan with no gaps to fill (token_budget's batches, whose rows are sorted by length) takes none.
    A bundle is every piece whose start, in the shuffled stream of bundled pieces, falls in one interval
    ``[k cap, (k + 1) cap)``: each piece being at most ``cap`` long, a bundle holds under ``2 cap`` tokens.
    Vectorised: a permutation, a cumulative sum and a bincount."""
    perm = rng.permutation(len(plen))
    lens = plen[perm]
    bundled = lens <= cap
    if fillers > 0:  # every k-th short piece of the shuffled order: a random share 1/k of them
        k = max(1, round(1 / fillers))
        bundled[np.flatnonzero(bundled)[k - 1 :: k]] = False
    sp, alone = perm[bundled], perm[~bundled]
    sl = lens[bundled]
    bid = (np.cumsum(sl) - sl) // cap  # (bundled pieces,) non-decreasing bundle ids, none skipped
    nb = int(bid[-1]) + 1 if len(bid) else 0
    totals = np.bincount(bid, weights=sl, minlength=nb).astype(np.int64)
    sizes = np.bincount(bid, minlength=nb).astype(np.int64)
    return Bundles(
        np.concatenate([totals, lens[~bundled]]),
        np.concatenate([sp, alone]),
        np.concatenate([[0], np.cumsum(sizes), len(sp) + np.arange(1, len(alone) + 1)]).astype(np.int64),
    )


def ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenation of arange(a, b) for each pair, vectorised (one repeat, one arange)."""
    n = stops - starts
    return np.arange(int(n.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(n) - n), n)


def greedy_cuts(run_end: np.ndarray, run_k: np.ndarray) -> np.ndarray:
    """Batch boundaries over descending pieces given as runs of equal rounded length (``run_end``:
    where each run ends, ``run_k``: rows a batch led by that run may hold): each batch takes as many
    as its first allows, which is the fewest batches. The loop is ~2 x runs, not batches."""
    n = int(run_end[-1]) if len(run_end) else 0
    cuts, i, run = [0], 0, 0
    while i < n:
        while run_end[run] <= i:
            run += 1
        e, q = int(run_end[run]), int(run_k[run])
        full = (e - i) // q
        if full:
            cuts.extend(range(i + q, i + full * q + 1, q))
            i += full * q
        if i < e:
            i = min(n, i + q)
            cuts.append(i)
    return np.array(cuts, np.int64)


def exact_cuts(r: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Lexicographic DP (fewest batches, then fewest slots) over descending pieces; O(n x max k) numpy."""
    n = len(r)
    big = int(n * (int(r.max(initial=0)) + 1) + 1)
    f = np.full(n + 1, np.iinfo(np.int64).max, np.int64)
    arg = np.zeros(n + 1, np.int64)
    f[0] = 0
    for i in range(n):
        j = np.arange(i + 1, min(n, i + int(k[i])) + 1)
        c = f[i] + big + (j - i) * int(r[i])
        better = c < f[j]
        f[j[better]] = c[better]
        arg[j[better]] = i
    cuts = [n]
    while cuts[-1]:
        cuts.append(int(arg[cuts[-1]]))
    return np.array(cuts[::-1], np.int64)


def desc_stable(x: np.ndarray) -> np.ndarray:
    """Order by length descending, equal lengths in their current order (items already shuffled)."""
    if len(x) == 0 or x.max() >= 2**16:
        return np.argsort(-x, kind="stable")
    return np.argsort((2**16 - 1 - x).astype(np.uint16), kind="stable")


def desc_random_ties(x: np.ndarray, rng) -> np.ndarray:
    """Order by length descending, equal lengths in random order.

    Two stable 16-bit radix passes (random key, then length) instead of a full permutation plus
    sort: 10M lengths in ~0.5 s instead of ~1 s. Ties among equal random keys fall back to index
    order, which at 65,536 keys is still a well-mixed tie-break."""
    if len(x) == 0 or x.max() >= 2**16:
        perm = rng.permutation(len(x))
        return perm[np.argsort(-x[perm], kind="stable")]
    perm = np.argsort(rng.integers(0, 2**16, len(x), dtype=np.uint16), kind="stable")
    key = (2**16 - 1 - x).astype(np.uint16)[perm]
    return perm[np.argsort(key, kind="stable")]


@dataclass
class Pieces:
    """Pieces of at most ``cap`` tokens. Piece i < n_docs is document i's first piece (start 0);
    piece n_docs + j is a further piece of a split document (``xdoc[j]``, from ``xstart[j]``)."""

    n_docs: int
    plen: np.ndarray
    xdoc: np.ndarray
    xstart: np.ndarray
    split: np.ndarray
    truncated: np.ndarray

    def take(self, src: np.ndarray, length: np.ndarray):
        """(doc, start, stop) of pieces ``src`` whose lengths are known: no gather over all pieces."""
        doc, start = src, np.zeros(len(src), np.int64)
        if len(self.xdoc):
            ix = np.flatnonzero(src >= self.n_docs)
            doc = src.copy()
            doc[ix] = self.xdoc[src[ix] - self.n_docs]
            start[ix] = self.xstart[src[ix] - self.n_docs]
        return doc, start, start + length


def cut_long(lengths, cap: int, policy: str) -> Pieces:
    """Split documents longer than ``cap`` into consecutive pieces that tile them, or truncate them
    to their first ``cap`` tokens. Further pieces are appended after the first pieces (the planners
    sort pieces anyway, so they need not sit beside their first piece)."""
    long_ids = np.flatnonzero(lengths > cap)
    first = np.minimum(lengths, cap) if len(long_ids) else lengths
    none = np.zeros(0, np.int64)
    if policy == "truncate" or not len(long_ids):
        return Pieces(len(lengths), first, none, none, none, long_ids)
    extra = -(-lengths[long_ids] // cap) - 1  # pieces after the first
    xdoc = np.repeat(long_ids, extra)
    xstart = (ranges(np.zeros(len(extra), np.int64), extra) + 1) * cap
    xlen = np.minimum(xstart + cap, lengths[xdoc]) - xstart
    return Pieces(len(lengths), np.concatenate([first, xlen]), xdoc, xstart, long_ids, none)


def sorted_desc(x: np.ndarray) -> np.ndarray:
    """``np.sort(x)[::-1]`` for small non-negative integers, from the histogram (no comparison sort)."""
    h = np.bincount(x)[::-1]
    return np.repeat(np.arange(len(h) - 1, -1, -1, dtype=np.int64), h)
