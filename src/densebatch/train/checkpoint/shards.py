"""How a checkpoint's tensors are shared out over the ranks that write them, and read back on any number.

A tensor of a state is one of:

- **row-sharded**: a ``DTensor`` placed ``Shard(0)`` (FSDP2's parameters and their optimizer state;
  ``Replicate`` on other mesh dimensions, as with HSDP, is allowed): each rank writes its own rows, once
  per replica group, under the tensor's key in its own file (``model-00002-of-00004.safetensors``);
- **whole**: a plain tensor (the model and optimizer of one process or of DDP replicas, step counters,
  buffers), written by rank 0 alone, into ``model.safetensors`` when nothing is sharded.

``state.json`` records, for every key, its dtype, global shape and the shards that hold it (file, first
row, rows), so that a reader on M ranks reads exactly the rows each of its tensors needs (a rank of an
FSDP model: its own rows; one process, or DDP: all of them) from whichever files hold them, through
memory-mapped slices: no rank reads another rank's whole file, none holds the whole state unless its
own model is whole.
"""

from __future__ import annotations

from typing import Any

import torch

from densebatch.tensor_files import DTYPE_NAMES, RowReader
from densebatch.train.checkpoint.format import CheckpointError, dedupe_tensors
from densebatch.train.dtensors import first_row, is_dtensor

_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def file_name(part: str, rank: int, writers: int) -> str:
    """``model.safetensors`` when one rank writes the part, ``model-00002-of-00004.safetensors`` otherwise."""
    return f"{part}.safetensors" if writers == 1 else f"{part}-{rank + 1:05d}-of-{writers:05d}.safetensors"


def _row_share(t) -> tuple[torch.Tensor | None, int]:
    """(the rows of DTensor ``t`` this rank writes, or None; the global index of its first row)."""
    from torch.distributed.tensor import Replicate, Shard

    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:  # not a member of the mesh: holds nothing
        return None, 0
    sharded = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    if any(not isinstance(p, (Shard, Replicate)) for p in t.placements) or any(t.placements[i].dim != 0 for i in sharded):
        raise CheckpointError(f"cannot save a tensor placed {t.placements}: only row-sharded (Shard(0)) or replicated ones")
    if any(coordinate[i] for i, p in enumerate(t.placements) if isinstance(p, Replicate)):
        return None, 0  # another replica of the same rows writes them
    return t.to_local(), first_row(t)


def split_for_rank(tensors: dict[str, Any], rank: int) -> tuple[dict[str, tuple[torch.Tensor, int, tuple]], dict[str, str]]:
    """This rank's share of a state's ``tensors`` (key -> tensor or DTensor): ``{key: (local rows, first row,
    global shape)}`` and the aliases (tied tensors stored once). Every rank computes the same aliases: a
    DTensor by the storage its local shard lives in (tied parameters share one, on every rank, even where
    a shard is empty), a plain tensor by its view, as one process does."""
    sharded = {k: v for k, v in tensors.items() if is_dtensor(v)}
    first_of: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    share: dict[str, tuple[torch.Tensor, int, tuple]] = {}
    for key, t in sharded.items():
        local = t.to_local()
        view = (local.untyped_storage()._cdata, local.storage_offset(), tuple(local.shape), local.stride(), tuple(t.shape))
        if view in first_of:
            aliases[key] = first_of[view]
            continue
        first_of[view] = key
        rows, start = _row_share(t)
        if rows is not None:
            share[key] = (rows.detach(), start, tuple(t.shape))
    plain = {k: v for k, v in tensors.items() if k not in sharded}
    unique, plain_aliases = dedupe_tensors(plain)
    aliases |= plain_aliases
    if rank == 0:
        share |= {k: (t, 0, tuple(t.shape)) for k, t in unique.items()}
    return share, aliases


def shard_entries(share: dict[str, tuple[torch.Tensor, int, tuple]], file: str) -> dict[str, dict]:
    """What one rank's file holds of each key, for the index: dtype, global shape, first row and rows."""
    return {
        key: {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(shape),
            "file": file,
            "start": start,
            "rows": t.shape[0] if t.dim() else None,
        }
        for key, (t, start, shape) in share.items()
    }


def merge_entries(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """The index of a part from every rank's ``shard_entries``: per key its dtype, shape and shards in row order."""
    index: dict[str, dict] = {}
    for entries in per_rank:
        for key, e in entries.items():
            slot = index.setdefault(key, {"dtype": e["dtype"], "shape": e["shape"], "shards": []})
            slot["shards"].append({"file": e["file"], "start": e["start"], "rows": e["rows"]})
    for slot in index.values():
        slot["shards"].sort(key=lambda s: s["start"])
    return index


def index_of_file(name: str, keys: dict[str, dict]) -> dict[str, dict]:
    """The index of a whole-tensor file (a format-1 checkpoint) from its header: every key whole in ``name``."""
    return {
        key: {
            "dtype": h["dtype"],
            "shape": h["shape"],
            "shards": [{"file": name, "start": 0, "rows": h["shape"][0] if h["shape"] else None}],
        }
        for key, h in keys.items()
    }


def read_rows(reader: RowReader, entry: dict, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of the tensor ``entry`` describes, from the shards that overlap them."""
    shape, shards = entry["shape"], entry["shards"]
    if not shape:  # 0-dimensional: whole, in its one shard
        return reader.rows(shards[0]["file"], _key(entry), None, None)
    pieces = []
    for s in shards:
        lo, hi = max(start, s["start"]), min(stop, s["start"] + s["rows"])
        if lo < hi:
            pieces.append(reader.rows(s["file"], _key(entry), lo - s["start"], hi - s["start"]))
    got = sum(p.shape[0] for p in pieces)
    if got != stop - start:
        raise CheckpointError(f"tensor {_key(entry)}: its shards hold {got} of rows {start}..{stop}")
    if not pieces:
        return torch.empty((0, *shape[1:]), dtype=_DTYPES[entry["dtype"]])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _key(entry: dict) -> str:
    return entry["key"]


def read_part(reader: RowReader, index: dict[str, dict], targets: dict[str, Any] | None, device) -> dict[str, Any]:
    """Every tensor of a part: for a key whose target is a row-sharded DTensor, only that target's rows,
    returned as a DTensor like it; for a whole target of the same shape and dtype on ``device``, read into
    it (no second copy of the model while it loads); every other key whole, on ``device``."""
    out: dict[str, Any] = {}
    for key, entry in index.items():
        entry = dict(entry, key=key)
        target = (targets or {}).get(key)
        if is_dtensor(target) and list(target.shape) == entry["shape"]:
            out[key] = _as_target(reader, entry, target)
            continue
        if _fits(target, entry, device):
            out[key] = _into(reader, entry, target)
            continue
        rows = entry["shape"][0] if entry["shape"] else 0
        out[key] = read_rows(reader, entry, 0, rows).to(device)
    return out


def _fits(target, entry: dict, device) -> bool:
    return (
        isinstance(target, torch.Tensor)
        and not is_dtensor(target)
        and list(target.shape) == entry["shape"]
        and target.dtype == _DTYPES[entry["dtype"]]
        and target.device == torch.device(device)
        and target.is_contiguous()
    )


def _into(reader: RowReader, entry: dict, target: torch.Tensor) -> torch.Tensor:
    """The tensor ``entry`` describes, read shard by shard straight into ``target`` (in place)."""
    if not entry["shape"]:
        with torch.no_grad():
            return reader.rows(entry["shards"][0]["file"], _key(entry), None, None, out=target)
    _rows_into(reader, entry, 0, target)
    return target


def _rows_into(reader: RowReader, entry: dict, start: int, out: torch.Tensor) -> None:
    """Rows ``[start, start + len(out))`` of the tensor ``entry`` describes into ``out``, from every shard
    that holds some of them."""
    stop, got = start + out.shape[0], 0
    with torch.no_grad():
        for s in entry["shards"]:
            lo, hi = max(start, s["start"]), min(stop, s["start"] + s["rows"])
            if lo < hi:
                reader.rows(s["file"], _key(entry), lo - s["start"], hi - s["start"], out=out[lo - start : hi - start])
                got += hi - lo
    if got != stop - start:
        raise CheckpointError(f"tensor {_key(entry)}: its shards hold {got} of rows {start}..{stop}")


def _as_target(reader: RowReader, entry: dict, target) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if any(not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and p.dim != 0) for p in target.placements):
        raise CheckpointError(f"tensor {entry['key']}: cannot load into a tensor placed {target.placements}")
    start = first_row(target)
    own = target.to_local()
    if target.dim() and _fits(own, dict(entry, shape=list(own.shape)), own.device) and own.device.type == "cpu":
        _rows_into(reader, entry, start, own)  # this rank's rows straight into its shard
        return target
    local = read_rows(reader, entry, start, start + own.shape[0]) if target.dim() else read_rows(reader, entry, 0, 0)
    local = local.to(device=own.device, dtype=target.dtype)
    return DTensor.from_local(
        local, target.device_mesh, target.placements, run_check=False, shape=target.shape, stride=target.stride()
    )
