"""``output_dir/final``: the trained model, its tokenizer and configuration, written atomically by rank 0.

A whole model (one process, DDP) is saved as ``save_model`` saves it. An FSDP model is never gathered
whole into one process: its weights are streamed tensor by tensor (every rank all-gathers one tensor,
rank 0 appends its bytes to the open file and drops it), into the files ``save_pretrained`` writes for
a large model: ``model.safetensors``, or past ``SHARD_BYTES`` ``model-00001-of-0000K.safetensors`` and
``model.safetensors.index.json`` (total size, and which file holds each weight). The header of each file
is written first, from the shapes and dtypes every rank knows without gathering anything. Peak memory of
rank 0 is then one tensor, not one model. A LoRA model's final form is PEFT's adapter: under FSDP only
the adapter's tensors (the trainable ones) are gathered, and rank 0 writes them as PEFT does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from densebatch.atomic import io_reason, make_staging, publish, staged_dir, write_file
from densebatch.config import RunConfig, save_config
from densebatch.errors import UserError
from densebatch.model import save_model
from densebatch.run.layout import CHECKPOINT_DIR, FINAL_STATE
from densebatch.tensor_files import header_bytes, tensor_bytes
from densebatch.train.checkpoint.portable import is_sharded, model_state
from densebatch.train.distributed import Distributed

SHARD_BYTES = 5 * 2**30  # save_pretrained's long-standing default shard size
INDEX = "model.safetensors.index.json"


def write_final(final: Path, *, model, tok, cfg: RunConfig, step: int, dist: Distributed | None = None) -> None:
    """``final`` (model, tokenizer, config, step), atomically; every rank calls. A write that fails (no
    space left) is one line on every rank: nothing half-written is left, and the run's last checkpoint
    holds what training made."""
    dist = dist or Distributed()
    names = model.export_names(list(model_state(model))) if is_sharded(model) else None
    try:
        if is_sharded(model) and names is not None:
            _stream_final(final, model=model, names=names, tok=tok, cfg=cfg, step=step, dist=dist)
            return
        adapter = gathered_adapter(model) if is_sharded(model) else None  # LoRA under FSDP
        if dist.is_main:
            with staged_dir(final) as tmp:
                if adapter is None:
                    save_model(model, tmp)
                else:
                    model.save(tmp, adapter=adapter)
                _write_rest(tmp, tok, cfg, step)
    except (OSError, SafetensorError) as e:  # safetensors reports its I/O errors (ENOSPC too) as SafetensorError
        raise _cannot(final, e) from e


def gathered_adapter(model) -> dict[str, torch.Tensor]:
    """A LoRA model's trainable tensors (the adapter; PEFT saves no other) whole on the CPU, by state-dict
    key; a collective under FSDP, where nothing else of the model is gathered."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _write_rest(tmp: Path, tok, cfg: RunConfig, step: int) -> None:
    tok.save(tmp)
    save_config(cfg, tmp / "config.yaml")
    write_file(tmp / FINAL_STATE, json.dumps({"step": step}))


def _cannot(final: Path, e: BaseException) -> UserError:
    return UserError(
        f"{final}: cannot be written: {io_reason(e)}; the run is complete in its last checkpoint "
        f"({final.parent / CHECKPOINT_DIR}): free some space, then write the model with densebatch export"
    )


def shard_plan(sizes: list[int], limit: int | None = None) -> list[list[int]]:
    """Consecutive tensors (by index) grouped into files of at most ``limit`` bytes (default ``SHARD_BYTES``;
    a larger tensor alone)."""
    limit = SHARD_BYTES if limit is None else limit
    files: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if files[-1] and used + size > limit:
            files.append([])
            used = 0
        files[-1].append(i)
        used += size
    return files


def _stream_final(final: Path, *, model, names: dict[str, str], tok, cfg: RunConfig, step: int, dist: Distributed) -> None:
    state = model_state(model)  # this rank's shards, no copy
    first: dict[int, str] = {}
    items = []  # (saved name, tensor), tied tensors once
    for key, name in names.items():
        if id(state[key]) not in first:
            first[id(state[key])] = key
            items.append((name, state[key]))
    sizes = [t.numel() * t.element_size() for _, t in items]
    plan = shard_plan(sizes)
    files = (
        ["model.safetensors"]
        if len(plan) == 1
        else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    tmp, failure = None, None
    if dist.is_main:
        try:
            tmp = make_staging(final)
        except UserError as e:
            failure = e
    if dist.broadcast_object(failure is None) is False:
        raise failure or UserError(f"{final}: cannot be written (rank 0 says why)")
    for file, members in zip(files, plan):
        out = None
        if dist.is_main and failure is None:
            try:
                out = open(tmp / file, "wb")
                out.write(
                    header_bytes({items[i][0]: (items[i][1].dtype, tuple(items[i][1].shape)) for i in members}, {"format": "pt"})
                )
            except OSError as e:
                failure = e
        for i in members:
            t = items[i][1]
            whole = t.full_tensor() if hasattr(t, "full_tensor") else t  # every rank: the all-gather is collective
            if out is not None and failure is None:
                try:
                    out.write(tensor_bytes(whole))
                except OSError as e:
                    failure = e
            del whole
        if out is not None:
            try:
                out.close()  # flushes: a full disk can show here
            except OSError as e:
                failure = failure or e
    if dist.is_main:
        try:
            if failure is None:
                if len(files) > 1:
                    weight_map = {items[i][0]: file for file, members in zip(files, plan) for i in members}
                    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
                    (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
                model.write_config(tmp)
                _write_rest(tmp, tok, cfg, step)
                publish(tmp, final)
        except OSError as e:
            failure = e
        if failure is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.broadcast_object(failure is None) is False:
        if failure is not None:
            raise _cannot(final, failure) from failure
        raise UserError(f"{final}: cannot be written (rank 0 says why)")
