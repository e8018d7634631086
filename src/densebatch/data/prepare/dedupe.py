"""Duplicate removal: exact (the rendered text) or near (MinHash over word shingles), in input order, the
first copy kept; a mixture's later source against its earlier sources too.

``data.clean.dedupe``: ``off`` (or false); ``exact`` (or true): a record whose rendered text repeats an
earlier record's is dropped (counted as ``dropped["dedupe"]``); ``near``: those, and a record whose
content is a near copy of an earlier *kept* record (``dropped["dedupe_near"]``). Greedy, in input order:
a dropped record never removes another, so every dropped record is a copy of one that is kept, and the
result does not depend on how the records were cut into chunks or shared among processes.

Near copies. A record's content is its cleaned field values (those its template reads; not the
template's own words, which every record of a source shares and would make short records alike),
lowercased and cut into words (runs of letters, digits and underscores: whitespace, case and
punctuation differences vanish), shingled into every run of ``SHINGLE_WORDS`` (5) consecutive words (a
text of fewer words is one shingle; one without any word takes no part). Its MinHash signature
(datasketch: ``NUM_PERM`` = 128 permutations, seed 1, scheme affine32; each shingle hashed with CRC-32,
which datasketch mixes with murmur3's finaliser: cheaper than its default SHA-1) estimates the
Jaccard similarity of two records' shingle sets as the fraction of equal values. Two records are near
copies when it is at least ``data.clean.near_threshold`` (0.8: one word changed in a 100-word answer is
about 0.9). Candidates come from LSH: the first b·r values cut into b bands of r, each band hashed to
64 bits (``band_hashes``), a pair being a candidate when a band agrees. (b, r) is the largest r (fewest bands) that finds
a pair at the threshold with a chance of at least 99% (``1 - (1 - t^r)^b``): (21, 6) at 0.8. Each
candidate, in input order, is then compared with the kept records it shares a band with.

Memory. The workers compute the signatures and band hashes with the documents and write them in the
chunk files (a signature kept as its values' low 16 bits: 256 bytes; two different values agree by
chance once in 65,536). The end holds per record its text hash (16 bytes) and its band hashes (8·b
bytes: 168 at 0.8), and per *candidate* (a record sharing a band with another) its signature and its
place in each band's order (256 + 12·b bytes): few records in most corpora, all of them in one made of
many variants of a few texts.

Why the cross-source rule lives in the source's entry: the mixture's stores point at its sources' shards
without copying them (``joined.py``), so a later source's copies cannot be left out afterwards without
rewriting its store; deduping while it is built, under a key that names the sources before it, keeps every
entry valid for exactly what it holds.

Across sources. A mixture's source is deduped against the records its earlier sources kept (both
splits), with the same setting: a copy is dropped and counted as ``dropped["dedupe_cross_source"]``. For
that, each entry prepared with dedupe on keeps the keys of its kept records in ``dedupe/`` (``write_index``:
16 bytes a record; near adds 8·b + 256), and a later source's cache key names its earlier sources' keys
(``cache.source_keys``): its store is valid for exactly those sources before it, so adding a source at the
end prepares only that one, and reordering or changing an earlier one prepares the later ones again.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from densebatch.config import CleanConfig
from densebatch.errors import ConfigError, DataError

SHINGLE_WORDS = 5
NUM_PERM = 128
MINHASH_SEED = 1
INDEX_VERSION = 1  # the layout of an entry's dedupe/ files
_WORD = re.compile(r"\w+")
_EMPTY_KEY = bytes(16)


def dedupe_mode(clean: CleanConfig) -> str:
    """``off``, ``exact`` or ``near`` (``data.clean.dedupe`` also takes false and true)."""
    d = clean.dedupe
    return ("exact" if d else "off") if isinstance(d, bool) else d


@functools.lru_cache(maxsize=8)
def lsh_shape(threshold: float) -> tuple[int, int]:
    """(bands, rows per band): the largest r whose b = NUM_PERM // r bands find a pair of similarity
    ``threshold`` with a chance of at least 99%."""
    for r in range(NUM_PERM, 0, -1):
        b = NUM_PERM // r
        if 1 - (1 - threshold**r) ** b >= 0.99:
            return b, r
    return NUM_PERM, 1


def key_material(clean: CleanConfig) -> dict | None:
    """What the dedupe setting adds to a cache key (None when off)."""
    mode = dedupe_mode(clean)
    if mode == "off":
        return None
    if mode == "exact":
        return {"index": INDEX_VERSION}
    b, r = lsh_shape(clean.near_threshold)
    return {
        "index": INDEX_VERSION, "threshold": clean.near_threshold, "shingle_words": SHINGLE_WORDS, "num_perm": NUM_PERM,
        "seed": MINHASH_SEED, "bands": [b, r], "hash": "crc32/affine32", "band_hash": "mult-sum/splitmix64",
    }  # fmt: skip


def text_key(text: str) -> bytes:
    """The exact-dedupe hash of a rendered text."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class Signer:
    """MinHash signatures and band hashes of record contents (one per process: the permutations are made once)."""

    def __init__(self, threshold: float) -> None:
        try:
            import datasketch  # an optional extra: imported only when near dedupe is asked for
        except ImportError:
            raise ConfigError("data.clean.dedupe near needs the datasketch package: pip install 'densebatch[dedupe]'") from None
        self.bands, self.rows = lsh_shape(threshold)
        self._m = datasketch.MinHash(num_perm=NUM_PERM, seed=MINHASH_SEED, hashfunc=zlib.crc32, scheme="affine32")

    def sign(self, text: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(signature: NUM_PERM uint16, band hashes: bands uint64) of ``text``; None when it has no word."""
        words = _WORD.findall(text.lower())
        if not words:
            return None
        k = SHINGLE_WORDS
        self._m.clear()
        self._m.update_batch(
            [" ".join(words[i : i + k]).encode("utf-8", "surrogatepass") for i in range(max(1, len(words) - k + 1))]
        )
        hv = np.asarray(self._m.hashvalues, np.uint32)
        return (hv & 0xFFFF).astype(np.uint16), band_hashes(hv, self.bands, self.rows)


# odd 64-bit multipliers, one per signature position, from a fixed hash (the same on every machine and version)
_MULT = np.array(
    [int.from_bytes(hashlib.blake2b(b"band%d" % i, digest_size=8).digest(), "little") | 1 for i in range(NUM_PERM)], np.uint64
)


def band_hashes(hv: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """The 64-bit hash of each band of ``rows`` values of the signature ``hv`` (uint32): a weighted sum modulo
    2^64, then mixed (splitmix64's finaliser). Two different bands agree by chance about once in 2^64;
    an agreement only makes a candidate, which the signatures then check."""
    n = bands * rows
    h = (hv[:n].astype(np.uint64) * _MULT[:n]).reshape(bands, rows).sum(axis=1, dtype=np.uint64)
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


@dataclass
class Keys:
    """The dedupe keys of n documents, in order. ``has_text``: a rendered record (pre-tokenised ones and text
    chunks take no part); ``has_sig``/``bands``: near mode only; ``sigs(indices)``: the signatures of those
    documents (ascending indices), read when asked for."""

    text: np.ndarray  # (n,) V16
    has_text: np.ndarray  # (n,) bool
    has_sig: np.ndarray | None = None  # (n,) bool
    bands: np.ndarray | None = None  # (n, b) uint64
    sigs: Callable[[np.ndarray], np.ndarray] | None = None  # -> (k, NUM_PERM) uint16

    @classmethod
    def of_docs(cls, docs: list, bands: int | None) -> Keys:
        """The keys of in-memory documents (``documents.Doc``); ``bands``: near dedupe's (None: exact only)."""
        text = np.array([d.text_key or _EMPTY_KEY for d in docs], "V16")
        has_text = np.array([d.text_key is not None for d in docs], bool)
        if bands is None:
            return cls(text, has_text)
        has_sig = np.array([d.sig is not None for d in docs], bool)
        sig = np.zeros((len(docs), NUM_PERM), np.uint16)
        band = np.zeros((len(docs), bands), np.uint64)
        for i in np.flatnonzero(has_sig):
            sig[i], band[i] = docs[i].sig, docs[i].bands
        return cls(text, has_text, has_sig, band, lambda idx: sig[idx])


def dedupe(keys: Keys, mode: str, threshold: float, prior: Keys | None = None) -> tuple[np.ndarray, dict[str, int]]:
    """(keep mask, drops by kind) of the documents ``keys`` under ``mode`` (exact or near), the first copy
    kept; ``prior``: the kept records of the sources before this one (every one of them kept)."""
    n = len(keys.text)
    keep = np.ones(n, bool)
    counts: dict[str, int] = {}
    if mode == "off" or not n:
        return keep, counts
    idx = np.flatnonzero(keys.has_text)
    if prior is not None and len(prior.text):
        cross = idx[np.isin(keys.text[idx], prior.text)]
        keep[cross] = False
        counts["dedupe_cross_source"] = len(cross)
        idx = idx[keep[idx]]
    _, first = np.unique(keys.text[idx], return_index=True)
    keep[idx] = False
    keep[idx[first]] = True
    counts["dedupe"] = len(idx) - len(first)
    if mode == "near":
        near, cross = _near(keys, keep, threshold, prior)
        counts["dedupe_near"] = near
        counts["dedupe_cross_source"] = counts.get("dedupe_cross_source", 0) + cross
    return keep, {k: v for k, v in counts.items() if v}


def _near(keys: Keys, keep: np.ndarray, threshold: float, prior: Keys | None) -> tuple[int, int]:
    """Drop (in ``keep``) the near copies of kept records, greedily in input order; (within, across sources)."""
    assert keys.has_sig is not None and keys.bands is not None and keys.sigs is not None
    live = np.flatnonzero(keep & keys.has_sig)
    has_prior = prior is not None and prior.has_sig is not None and bool(prior.has_sig.any())
    p_live = np.flatnonzero(prior.has_sig) if has_prior else np.zeros(0, np.int64)
    p_bands = prior.bands[p_live] if has_prior else np.zeros((0, keys.bands.shape[1]), np.uint64)
    m = len(p_live)
    cand, p_cand = np.zeros(len(live), bool), np.zeros(m, bool)
    for k in range(keys.bands.shape[1]):  # a record is a candidate when one of its bands is another's
        _, inv, cnt = np.unique(np.concatenate([p_bands[:, k], keys.bands[live, k]]), return_inverse=True, return_counts=True)
        cand |= cnt[inv[m:]] > 1
        if m:
            mine = np.zeros(len(cnt), bool)
            mine[inv[m:]] = True
            p_cand |= mine[inv[:m]]
    if not cand.any():
        return 0, 0
    c_idx, p_idx = live[cand], p_live[p_cand]
    # nodes: the earlier sources' candidates (always kept), then this source's, in input order
    p, nodes = len(p_idx), len(p_idx) + len(c_idx)
    sig = np.concatenate([prior.sigs(p_idx) if p else np.zeros((0, NUM_PERM), np.uint16), keys.sigs(c_idx)])
    # per band, the nodes sorted by (band hash, node): a node's earlier group-mates lie just before it
    order, first, pos = (np.empty((keys.bands.shape[1], nodes), np.int32) for _ in range(3))
    for k in range(keys.bands.shape[1]):
        vals = np.concatenate([prior.bands[p_idx, k] if p else np.zeros(0, np.uint64), keys.bands[c_idx, k]])
        order[k] = np.argsort(vals, kind="stable")
        ranked = vals[order[k]]
        first[k] = np.searchsorted(ranked, ranked, side="left")
        pos[k, order[k]] = np.arange(nodes, dtype=np.int32)
    kept = np.ones(nodes, bool)
    need = math.ceil(threshold * NUM_PERM - 1e-9)  # equal values for an estimate >= threshold
    near = cross = 0
    for j in range(p, nodes):
        mates = np.concatenate([order[k, first[k, pos[k, j]] : pos[k, j]] for k in range(len(order))])
        mates = mates[kept[mates]]
        if not len(mates):
            continue
        copies = mates[np.count_nonzero(sig[mates] == sig[j], axis=1) >= need]
        if len(copies):
            kept[j] = keep[c_idx[j - p]] = False
            if copies.min() < p:
                cross += 1
            else:
                near += 1
    return near, cross


def repeats(keys: Keys, train: np.ndarray, held: np.ndarray) -> int:
    """Held-out documents whose rendered text is a training document's (``train``/``held``: masks)."""
    return count_in(keys.text[keys.has_text & held], keys.text[keys.has_text & train])


def count_in(held: np.ndarray, train: np.ndarray) -> int:
    """How many of the ``held`` text keys are among the ``train`` ones."""
    return int(np.isin(held, train).sum()) if len(held) and len(train) else 0


# ----------------------------------------------------------------------------------------- an entry's index
INDEX_DIR = "dedupe"
_BATCH = 1 << 16


SPLIT_KEYS = "split_keys.npz"


def write_split_keys(entry: Path, train: np.ndarray, held: np.ndarray) -> None:
    """The rendered-text keys of an entry's train and eval documents (staged at ``entry``), for the leakage
    count across a mixture's parts (``leakage_across``)."""
    with open(entry / SPLIT_KEYS, "wb") as f:
        np.savez(f, train=train, eval=held)


def leakage_across(entries: list[Path]) -> int:
    """Held-out documents of any of ``entries`` whose rendered text is a training document of any of them
    (the mixture's ``eval_repeats_train``: within each part and across parts)."""
    try:
        loaded = [np.load(e / SPLIT_KEYS) for e in entries]
        train = np.concatenate([x["train"] for x in loaded])
        held = np.concatenate([x["eval"] for x in loaded])
    except (OSError, ValueError, KeyError) as e:
        raise DataError(
            f"{entries[0].parent}: a part's document keys cannot be read ({type(e).__name__}: {e}); delete that "
            "cache directory and run again"
        ) from None
    return count_in(held, train)


def write_index(entry: Path, keys: Keys, keep: np.ndarray) -> None:
    """The keys of the kept rendered records of an entry (staged at ``entry``), in order, for a later source."""
    d = entry / INDEX_DIR
    d.mkdir()
    rows = np.flatnonzero(keep & keys.has_text)
    np.save(d / "text.npy", keys.text[rows])
    if keys.bands is None or keys.has_sig is None or keys.sigs is None:
        return
    np.save(d / "has_sig.npy", keys.has_sig[rows])
    np.save(d / "bands.npy", keys.bands[rows])
    out = np.lib.format.open_memmap(d / "sig.npy", mode="w+", dtype=np.uint16, shape=(len(rows), NUM_PERM))
    for a in range(0, len(rows), _BATCH):  # a batch of signatures in memory at a time
        out[a : a + _BATCH] = keys.sigs(rows[a : a + _BATCH])
    out.flush()
    del out


def read_prior(entries: list[Path], near: bool) -> Keys | None:
    """The kept records' keys of the entries of a mixture's earlier sources, end to end (None: none)."""
    if not entries:
        return None
    try:
        text = np.concatenate([np.load(e / INDEX_DIR / "text.npy") for e in entries])
        if not near:
            return Keys(text, np.ones(len(text), bool))
        has_sig = np.concatenate([np.load(e / INDEX_DIR / "has_sig.npy") for e in entries])
        bands = np.concatenate([np.load(e / INDEX_DIR / "bands.npy") for e in entries])
        parts = [np.load(e / INDEX_DIR / "sig.npy", mmap_mode="r") for e in entries]
    except (OSError, ValueError) as e:
        raise DataError(
            f"{entries[-1].parent}: an earlier source's dedupe keys cannot be read ({type(e).__name__}: {e}); "
            "delete that cache directory and run again"
        ) from None
    starts = np.cumsum([0] + [len(p) for p in parts])

    def sigs(idx: np.ndarray) -> np.ndarray:
        out = np.empty((len(idx), NUM_PERM), np.uint16)
        part = np.searchsorted(starts, idx, side="right") - 1
        for j in np.unique(part):
            sel = part == j
            out[sel] = parts[j][idx[sel] - starts[j]]
        return out

    return Keys(text, np.ones(len(text), bool), has_sig, bands, sigs)
