"""MosaicML ``streaming``'s MDS shards (``index.json`` + ``shard.NNNNN.mds``), checked and read in place.

The layout ``streaming.MDSWriter`` writes (MDS version 2; ``streaming/base/format/mds/writer.py`` and
``encodings.py``), little-endian::

    index.json       {"version": 2, "shards": [{"format": "mds", "version": 2, "samples", "column_names"
                     (sorted), "column_encodings", "column_sizes" (bytes; null: each sample stores its own),
                     "compression", "raw_data": {"basename", "bytes"}, "zip_data"}, ...]}
    shard.N.mds      uint32 n, uint32 offsets[n + 1] (each sample's first byte; the last: the file's end),
                     the shard's settings as JSON, then each sample: a uint32 size per column without a
                     fixed size, then every column's bytes, in column order

A sample is a document. Its ids are the token column (``data.fields.input_ids``; at its default
``input_ids``, else llm-foundry's ``tokens``), a 1-D array of integer ids encoded as ``ndarray:DTYPE``
(a byte ``ndim << 2 | log2(shape width)`` and the shape before the ids), ``ndarray`` (a dtype code
byte before those), ``ndarray:DTYPE:N`` (N ids, no header) or ``bytes`` (the raw ids, their dtype
``data.bytes_dtype``). Every sample's ids are located by vectorised reads of the offsets and headers,
a block of samples at a time; a shard is mapped once per (dtype, byte alignment) its documents need,
as litdata's chunks are. Other columns are ignored. Compressed shards (they cannot be mapped), a
shard missing or cut short, anything that disagrees with itself or the index, and non-integer ids
are refused in one ``DataError`` naming the file.
"""

from __future__ import annotations

import functools
import glob
import json
from pathlib import Path

import numpy as np

from densebatch.data.store.formats.mapped import MappedFile, place
from densebatch.errors import DataError

INDEX = "index.json"
DEFAULT_COLUMNS = ("input_ids", "tokens")  # data.fields.input_ids at its default: the first present is read
# streaming's NDArray dtype codes (``NDArray._int2value_dtype``)
_CODES = {8: "u1", 9: "i1", 16: "u2", 17: "i2", 32: "u4", 33: "i4", 64: "u8", 65: "i8"}
_DTYPES = {code: np.dtype("<" + d) for code, d in _CODES.items()}  # a sample's ids by its code (``ndarray`` columns)
_FLOAT_CODES = {18: "float16", 34: "float32", 66: "float64"}
_INTS = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"}
_BLOCK = 1 << 20  # samples whose headers are gathered at once
_ITEMSIZE = np.zeros(256, np.int64)  # dtype code -> bytes an id
_ITEMSIZE[list(_CODES)] = [np.dtype(d).itemsize for d in _CODES.values()]


def shards_of(path: str) -> list[Path]:
    """The shard files that ``path`` names (a dataset folder, its ``index.json``, or a glob pattern of
    either), in each index's order; a listed shard that is compressed or missing is a ``DataError`` naming it."""
    matches = sorted(glob.glob(path, recursive=True)) if glob.has_magic(path) else [path]
    if not matches:
        raise DataError(f"{path}: the pattern matches no file")
    out: dict[Path, None] = {}
    for m in map(Path, matches):
        index = m if m.name == INDEX else m / INDEX
        if glob.has_magic(path) and not index.is_file():
            continue  # a pattern's other matches (shards, logs): its datasets are the folders with an index
        if not m.is_dir() and m.name != INDEX:
            raise DataError(f"{m}: not an MDS dataset (data.format mds reads the folder with the index.json streaming wrote)")
        for entry in _shards(index):
            f = index.parent / entry["raw_data"]["basename"]
            _uncompressed(index, entry)
            if not f.is_file():
                raise DataError(f"{f}: missing (listed by {index})")
            out[f] = None
    if not out:
        raise DataError(f"{path}: no MDS shard (no index.json there, or one that lists no shard)")
    return list(out)


def _uncompressed(index: Path, entry: dict) -> None:
    zipped = entry.get("zip_data")
    if entry.get("compression") or zipped:
        name = index.parent / (zipped or entry["raw_data"])["basename"]
        raise DataError(
            f"{name}: compressed ({entry.get('compression')}): a compressed MDS shard cannot be memory-mapped; write "
            "the dataset with MDSWriter(compression=None), or decompress its shards with streaming"
        )


@functools.lru_cache(maxsize=64)
def _index_cached(path: str, mtime: int) -> tuple[dict, ...]:
    try:
        index = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable MDS index ({(str(e).splitlines() or [type(e).__name__])[0]})") from None
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list) or any(not isinstance(s, dict) for s in shards):
        raise DataError(f"{path}: not a streaming index (no list of shards)")
    for s in shards:
        if s.get("format") != "mds" or s.get("version") != 2:
            raise DataError(f"{path}: a shard of format {s.get('format')} version {s.get('version')}: only MDS version 2 is read")
        names, encodings, sizes = (s.get(k) for k in ("column_names", "column_encodings", "column_sizes"))
        raw = s.get("raw_data")
        if (
            not isinstance(names, list)
            or not isinstance(encodings, list)
            or not isinstance(sizes, list)
            or not len(names) == len(encodings) == len(sizes)
            or not isinstance(raw, dict)
            or not isinstance(raw.get("basename"), str)
            or not isinstance(s.get("samples"), int)
        ):
            raise DataError(f"{path}: a shard entry without its columns, samples or raw_data")
    return tuple(shards)


def _shards(index: Path) -> tuple[dict, ...]:
    if not index.is_file():
        raise DataError(f"{index}: missing (data.format mds reads the folder with the index.json streaming wrote)")
    return _index_cached(str(index), index.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _listing(path: str, mtime: int) -> dict[str, dict]:
    """An index's entries by their shard's path relative to the index's folder."""
    return {Path(e["raw_data"]["basename"]).as_posix(): e for e in _index_cached(path, mtime)}


def index_of(shard: Path) -> tuple[Path, dict]:
    """The ``index.json`` that lists ``shard`` (in its folder or one above: merged indexes name sub-folders) and its entry."""
    for folder in shard.parents:
        index = folder / INDEX
        if index.is_file():
            entry = _listing(str(index), index.stat().st_mtime_ns).get(shard.relative_to(folder).as_posix())
            if entry is not None:
                return index, entry
    raise DataError(f"{shard}: no index.json beside or above it lists this shard")


def token_column(index: Path, entry: dict, column: str) -> int:
    """Which column of ``entry`` holds the ids: ``column`` (``data.fields.input_ids``), or at its default
    the first of ``DEFAULT_COLUMNS`` present."""
    names = entry["column_names"]
    for name in DEFAULT_COLUMNS if column == DEFAULT_COLUMNS[0] else (column,):
        if name in names:
            return names.index(name)
    want = " or ".join(DEFAULT_COLUMNS) if column == DEFAULT_COLUMNS[0] else column
    raise DataError(
        f"{index}: no column {want} (its columns: {', '.join(names)}): set data.fields.input_ids to the column of token ids"
    )


def _encoding(index: Path, *, name: str, encoding: str, bytes_dtype: str | None) -> tuple[str, np.dtype | None]:
    """(kind, dtype) of the token column: kind ``fixed`` (ndarray:D:N), ``shape`` (ndarray:D), ``dynamic``
    (ndarray: a dtype byte per sample, dtype None) or ``bytes``."""
    kind, _, rest = encoding.partition(":")
    if kind == "bytes" and not rest:
        if bytes_dtype is None:
            raise DataError(
                f"{index}: column {name} holds raw bytes (encoding bytes, no dtype recorded): set data.bytes_dtype to the "
                "dtype its ids were written in (llm-foundry's tokens columns: int64)"
            )
        if bytes_dtype not in _INTS:
            raise DataError(f"data.bytes_dtype {bytes_dtype}: one of {', '.join(sorted(_INTS))}")
        return "bytes", np.dtype(bytes_dtype).newbyteorder("<")
    if kind != "ndarray":
        raise DataError(f"{index}: column {name} is encoded as {encoding}: token ids are read from ndarray or bytes columns")
    if not rest:
        return "dynamic", None
    dtype, _, shape = rest.partition(":")
    if dtype not in _INTS:
        raise DataError(f"{index}: column {name} holds {dtype} values ({encoding}), not integer token ids")
    if not shape:
        return "shape", np.dtype(dtype).newbyteorder("<")
    if not shape.isdigit():
        raise DataError(
            f"{index}: column {name} holds arrays of shape ({shape}) ({encoding}): one 1-D array of ids a sample is read"
        )
    return "fixed", np.dtype(dtype).newbyteorder("<")


def _header(shard: Path, entry: dict, size: int) -> np.ndarray:
    """The shard's sample offsets (int64, n + 1), checked against its size, its settings and the index."""
    n = int(entry["samples"])
    want = int(entry["raw_data"].get("bytes", size))
    if size != want:
        what = "cut short" if size < want else "longer than the index says"
        raise DataError(f"{shard}: {size} bytes, the index says {want}: {what}")
    with open(shard, "rb") as f:
        head = f.read(4)
        count = int(np.frombuffer(head, "<u4")[0]) if len(head) == 4 else -1
        raw = f.read(4 * (count + 1)) if count == n else b""
    if count != n or len(raw) != 4 * (n + 1):
        raise DataError(f"{shard}: its header's sample count ({count}) disagrees with the index's {n} (or is cut short)")
    offsets = np.frombuffer(raw, "<u4").astype(np.int64)
    if offsets[0] < 4 * (n + 2) or (np.diff(offsets) < 0).any() or offsets[-1] != size:
        raise DataError(
            f"{shard}: {size} bytes, its header's {n} samples end at byte {int(offsets[-1])}: its offsets disagree with its size"
        )
    with open(shard, "rb") as f:
        f.seek(4 * (n + 2))
        settings = f.read(int(offsets[0]) - 4 * (n + 2))
    try:
        written = json.loads(settings)
    except ValueError:
        written = None
    keys = ("column_names", "column_encodings", "column_sizes")
    if not isinstance(written, dict) or any(written.get(k) != entry[k] for k in keys):
        raise DataError(f"{shard}: the columns its header records disagree with its index.json entry")
    return offsets


def read_shard(shard: Path, *, column: str, bytes_dtype: str | None) -> MappedFile:
    """Check ``shard`` against its header and its index and map it (module docstring); ``DataError`` naming the file."""
    index, entry = index_of(shard)
    _uncompressed(index, entry)
    c = token_column(index, entry, column)
    name = entry["column_names"][c]
    kind, dtype = _encoding(index, name=name, encoding=entry["column_encodings"][c], bytes_dtype=bytes_dtype)
    size = shard.stat().st_size
    offsets = _header(shard, entry, size)
    n = len(offsets) - 1
    sizes = entry["column_sizes"]
    variable = [i for i, s in enumerate(sizes) if s is None]
    raw = np.memmap(shard, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    value_at, lengths, codes = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.uint8)
    for a in range(0, n, _BLOCK):
        b = min(n, a + _BLOCK)
        at = offsets[a:b]
        col = np.zeros((b - a, len(sizes)), np.int64)  # (samples, columns) each column's bytes
        col[:, [i for i in range(len(sizes)) if i not in variable]] = [s for s in sizes if s is not None]
        if variable:
            col[:, variable] = _gather(raw, at, 4 * len(variable)).view("<u4").reshape(b - a, -1)
        if (4 * len(variable) + col.sum(1) != np.diff(offsets[a : b + 1])).any():
            k = a + int(np.argmax(4 * len(variable) + col.sum(1) != np.diff(offsets[a : b + 1])))
            raise DataError(f"{shard}: sample {k}'s column sizes disagree with its offsets")
        start = at + 4 * len(variable) + col[:, :c].sum(1)  # (samples,) the token column's first byte
        value_at[a:b], lengths[a:b], codes[a:b] = _values(
            shard, raw=raw, start=start, nbytes=col[:, c], kind=kind, dtype=dtype, first=a
        )
    if dtype is not None:  # one dtype for every sample's ids
        return place(shard, size=size, byte_starts=value_at, lengths=lengths, codes=np.zeros(n, np.int64), dtypes={0: dtype})
    return place(shard, size=size, byte_starts=value_at, lengths=lengths, codes=codes, dtypes=_DTYPES)


def _gather(raw: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """(len(at), width) uint8: the ``width`` bytes from each of ``at`` (bytes past the file's end read as 0)."""
    idx = at[:, None] + np.arange(width)
    out = np.asarray(raw[np.minimum(idx, max(len(raw) - 1, 0))]) if len(raw) else np.zeros(idx.shape, np.uint8)
    out[idx >= len(raw)] = 0
    return np.ascontiguousarray(out)


def _values(shard: Path, *, raw, start, nbytes, kind: str, dtype, first: int):
    """Each sample's ids: (first byte, count, dtype code) of the token column's values at ``start`` (``nbytes`` long)."""
    codes = np.zeros(len(start), np.uint8)
    if kind == "dynamic":
        codes = _gather(raw, start, 1)[:, 0]
        floats = np.isin(codes, list(_FLOAT_CODES))
        if floats.any() or not np.isin(codes, list(_CODES)).all():
            k = int(np.argmax(~np.isin(codes, list(_CODES))))
            code = int(codes[k])
            what = f"{_FLOAT_CODES[code]} values, not integer token ids" if code in _FLOAT_CODES else f"unknown dtype code {code}"
            raise DataError(f"{shard}: sample {first + k}'s token ids are {what}")
        start, nbytes = start + 1, nbytes - 1
    if kind in ("bytes", "fixed"):
        count = nbytes // dtype.itemsize
        if (nbytes % dtype.itemsize).any():
            k = int(np.argmax(nbytes % dtype.itemsize))
            raise DataError(f"{shard}: sample {first + k}'s {int(nbytes[k])} bytes of ids are not whole {dtype.name} ids")
        return start, count, codes
    head = _gather(raw, start, 9)  # (samples, 9) the shape byte and up to 8 bytes of shape
    ndim, width = head[:, 0] >> 2, 1 << (head[:, 0] & 3).astype(np.int64)
    if (ndim != 1).any():
        k = int(np.argmax(ndim != 1))
        raise DataError(f"{shard}: sample {first + k} holds a {int(ndim[k])}-D array: one 1-D array of ids a sample is read")
    shape = np.where(np.arange(8) < width[:, None], head[:, 1:], 0).astype(np.uint8).view("<u8").reshape(-1).astype(np.int64)
    itemsize = _ITEMSIZE[codes] if kind == "dynamic" else dtype.itemsize
    if (1 + width + shape * itemsize != nbytes).any():
        k = int(np.argmax(1 + width + shape * itemsize != nbytes))
        raise DataError(f"{shard}: sample {first + k}'s array shape disagrees with its size")
    return start + 1 + width, shape, codes
