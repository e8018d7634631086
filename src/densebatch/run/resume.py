"""What a resume continues: the saved run, its configuration, and only the changes that keep it exact.

``resolve_run`` decides where a ``train`` command starts: a fresh run refuses an ``output_dir`` that
already holds one unless ``--overwrite`` (which deletes it); ``--resume`` (or ``checkpoint.resume:
auto``) continues the newest verified checkpoint with the configuration it carries. Of what the
command asks for (``plan_resume``):

- a key **named on the command line** (``--section.key=value``) that is in ``RESUMABLE`` (step
  limits, logging, checkpoint cadence, prefetch, sinks) changes the resumed run, reported as
  ``changed``: these keys decide when the run stops or what it records, never the updates it
  computes up to there. Evaluation cadence and size (``EVALUATION_KEYS``) are resumable only while
  nothing acts on evaluations: a batch-size back-off or early stopping reads every eval loss, so
  moving or resizing evaluations would move their decisions and the updates after them;
- any other key named on the command line that differs (data, batching, model, seed, optimizer,
  schedule, precision, ...) is refused, listing every one;
- differences that only the config file carries are ignored, reported as ``ignored``, resumable keys
  included: ``densebatch train CONFIG --resume`` after ``densebatch train CONFIG --train.max_steps=40
  --batching.strategy=packed`` continues the packed run and stops at 40, whatever CONFIG says.

``output_dir`` is where the run is found, so it is always the one asked for. A resume on another
number of processes keeps the global batch by changing ``train.grad_accum_batches`` (reported).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from densebatch.atomic import remove_dir, write_file
from densebatch.config import RunConfig, config_from_dict, parse_override, to_dict
from densebatch.errors import ConfigError, UserError
from densebatch.run.auto import keep_resolved
from densebatch.run.layout import CHECKPOINT_DIR, MIRROR_MARK, RUN_OUTPUTS, foreign_outputs, holds_a_run, mirror_owner
from densebatch.train.checkpoint.manager import CheckpointError, latest_valid, list_checkpoints, load_checkpoint
from densebatch.train.distributed import Distributed
from densebatch.train.parallel.mesh import check_world

RESUMABLE = frozenset(
    {
        "train.max_steps",
        "train.max_epochs",
        "train.max_tokens",
        "train.log_every",
        "train.progress",
        "train.report_to",
        "eval.every_steps",
        "eval.max_batches",
        "eval.max_tokens",
        "eval.patience",
        "eval.accuracy_samples",
        "eval.max_new_tokens",
        "checkpoint.every_steps",
        "checkpoint.keep_last",
        "checkpoint.mirror_dir",
        "checkpoint.resume",
        "checkpoint.async",  # when a checkpoint is written, not what it holds
        "batching.prefetch",
        "train.distributed",  # ddp and fsdp compute the same updates (≤ 1e-5): a resume may switch
        "train.context_parallel",  # the mesh: rows split over more or fewer ranks, the same updates (float tolerance)
    }
)
EVALUATION_KEYS = frozenset(
    {"eval.every_steps", "eval.max_batches", "eval.max_tokens"}
)  # move what back-offs / early stopping see


@dataclass
class ResumePlan:
    config: RunConfig
    changed: list[str] = field(default_factory=list)  # "key: saved → new", applied
    ignored: list[str] = field(default_factory=list)  # "key: file value (kept saved value)"


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _set(d: dict, key: str, value: Any) -> None:
    *path, last = key.split(".")
    for k in path:
        d = d.setdefault(k, {})
    d[last] = value


def explicit_keys(overrides: list[str]) -> set[str]:
    return {".".join(parse_override(o)[0]) for o in overrides}


def evaluations_steer(cfg: RunConfig) -> str | None:
    """What acts on the evaluations' losses (a key), or None when they are only recorded."""
    if cfg.train.batch_schedule.backoff_patience:
        return "train.batch_schedule.backoff_patience"
    if cfg.eval.patience:
        return "eval.patience"
    return None


def plan_resume(saved: dict, requested: RunConfig, overrides: list[str]) -> ResumePlan:
    """The configuration a resume runs with (see the module docstring); ``ConfigError`` listing every
    change named on the command line that would make the resumed run differ from the saved one."""
    base = config_from_dict(saved, saved=True)  # validates, fills keys a newer version added, reads moved ones
    old, new = flatten(to_dict(base)), flatten(to_dict(requested))
    named = explicit_keys(overrides)
    merged = to_dict(base)
    _set(merged, "output_dir", requested.output_dir)  # where the run was found
    plan = ResumePlan(base)
    refused, applied = [], []
    for key in sorted(k for k in new if k != "output_dir" and old.get(k) != new[k]):
        if key not in named:
            plan.ignored.append(f"{key}: {new[key]!r} (the saved run has {old.get(key)!r})")
        elif key in RESUMABLE:
            _set(merged, key, new[key])
            applied.append(key)
            plan.changed.append(f"{key}: {old.get(key)!r} → {new[key]!r}")
        else:
            refused.append(f"{key} (saved {old.get(key)!r}, asked {new[key]!r})")
    plan.config = config_from_dict(merged, saved=True)  # the saved run (a newer rule for a fresh config aside)
    steer = evaluations_steer(plan.config)
    if steer is not None:
        refused += [
            f"{key} (saved {old.get(key)!r}, asked {new[key]!r}: {steer} acts on every evaluation)"
            for key in applied
            if key in EVALUATION_KEYS
        ]
    if refused:
        raise ConfigError(
            "--resume continues the saved run and cannot change what it computes: "
            + "; ".join(refused)
            + ". Drop these overrides, or start a new run in another output_dir (or with --overwrite)"
        )
    return plan


def resolve_run(requested: RunConfig, *, overrides: list[str], resume: bool, overwrite: bool, dist: Distributed):
    """(configuration to run, checkpoint to resume from or None, what ``--overwrite`` deletes or None), after the
    resume / overwrite rules. The deletion is the caller's to call once the new run is set up: a typo in the new
    run's data or model then leaves the old run as it was."""
    out = Path(requested.output_dir)
    ck = requested.checkpoint
    mirror = own_mirror(out, ck.mirror_dir, dist)  # before anything reads or prunes it
    path = None
    skipped: list[str] = []
    if resume or ck.resume == "auto":

        def skip(p, why):
            skipped.append(f"{p}: {why}")
            _warn(dist, f"checkpoint {p}: {why} — skipped")

        path = latest_valid(out / CHECKPOINT_DIR, ck.mirror_dir, on_skip=skip, dist=dist)
    found = holds_a_run(out)  # after latest_valid removed the leftovers of dead saves
    mirrored = list_checkpoints(mirror) if mirror is not None else []
    found += [f"checkpoint.mirror_dir {mirror}: {len(mirrored)} checkpoints"] if mirrored else []
    strays = [] if found else foreign_outputs(out)
    if path is None:
        if found and not overwrite and resume:
            # Starting afresh would replace the run's final model and metrics: its checkpoints may be
            # repairable (a damaged one often holds intact weights), so nothing is touched.
            raise UserError(
                f"--resume: {out} holds a run ({', '.join(found)}) but no checkpoint that verifies"
                + (f" ({'; '.join(skipped)})" if skipped else " (none was saved)")
                + "; nothing was changed. Start over with --overwrite (deletes the run), or set --output_dir"
            )
        if found and not overwrite:
            raise UserError(
                f"{out} already holds a run ({', '.join(found)}); continue it with --resume, "
                f"or start over with --overwrite (deletes it), or set --output_dir"
            )
        if strays and not overwrite:
            raise UserError(
                f"{out} holds no run, but files a run writes ({', '.join(strays)}), which it would replace; move them, "
                "set --output_dir, or --overwrite (deletes them)"
            )
        if resume:
            _warn(dist, f"no checkpoint in {out / CHECKPOINT_DIR} to resume from: starting fresh")

        def start_over() -> None:  # --overwrite: called once the new run is set up (data, model), before it writes
            if dist.is_main:
                for name in RUN_OUTPUTS:
                    target = out / name
                    shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
                for _, p in mirrored:  # the deleted run's copies: a resume must never jump onto them
                    remove_dir(p)
            dist.barrier()

        return requested, None, (start_over if found or strays else None)
    extra = load_checkpoint(path, parts=("extra",), verified=True).extra_state  # hashed once, just above
    requested = keep_resolved(requested, extra["config"])  # `auto` asked again: the value the run found
    plan = plan_resume(extra["config"], requested, overrides)
    cfg = plan.config
    # data ranks: processes / context ranks (the context ranks of a data rank read the same batches)
    saved_cp, cp = int(extra["config"].get("train", {}).get("context_parallel", 1)), cfg.train.context_parallel
    check_world(dist.world_size, cp)
    saved_world, world = int(extra.get("world_size", 1)) // saved_cp, dist.world_size // cp
    ranks = "processes" if saved_cp == cp == 1 else "data ranks"
    if saved_world != world:  # elastic: keep the global batch by changing the accumulation
        total = saved_world * cfg.train.grad_accum_batches
        if cfg.train.loss_tokens_per_step is None and total % world:
            raise UserError(
                f"--resume: the run took {total} batches per step over {saved_world} {ranks}; "
                f"{world} {ranks} cannot split that evenly: use a number of {ranks} that divides {total}"
            )
        k = max(1, total // world)
        plan.changed.append(
            f"train.grad_accum_batches: {cfg.train.grad_accum_batches} → {k} ({saved_world} → {world} {ranks}, same batches per step)"
        )
        cfg = replace(cfg, train=replace(cfg.train, grad_accum_batches=k))
    if dist.is_main:
        print(f"resuming the run saved in {path} with its configuration", flush=True)
        for line in plan.changed:
            print(f"  changed: {line}", flush=True)
        for line in plan.ignored:
            print(f"  ignored: {line}", flush=True)
    return cfg, path, None


def own_mirror(out: Path, mirror_dir: str | None, dist: Distributed) -> Path | None:
    """``checkpoint.mirror_dir``, marked as this run's (``layout.MIRROR_MARK``). A mirror is one run's: its
    pruning keeps only that run's last checkpoints, and a resume reads the newest there; so one marked for
    another run, or one holding files without a mark, is refused (before, a second run sharing it deleted the
    first's checkpoints, and with ``checkpoint.resume: auto`` resumed from them). The main rank decides."""
    if mirror_dir is None or Path(mirror_dir).resolve() == (out / CHECKPOINT_DIR).resolve():
        return None  # none, or the checkpoints themselves (nothing is copied there)
    mirror, me = Path(mirror_dir), str(out.resolve())
    problem = None
    if dist.is_main:
        owner = mirror_owner(mirror)
        if owner is not None and owner != me:
            problem = (
                f"checkpoint.mirror_dir {mirror}: the checkpoint mirror of another run ({owner or 'its mark does not read'})"
            )
        elif owner is None and mirror.is_dir() and any(mirror.iterdir()) and not _unmarked_mirror_of(mirror, me):
            problem = f"checkpoint.mirror_dir {mirror}: holds files, but is no run's checkpoint mirror"
        elif owner is None:
            write_file(mirror / MIRROR_MARK, json.dumps({"output_dir": me}) + "\n")
    problem = dist.broadcast_object(problem)
    if problem is not None:
        raise UserError(
            f"{problem}; a run keeps only its own last checkpoints there and resumes from them: give this run a "
            "new or empty directory"
        )
    return mirror


def _unmarked_mirror_of(mirror: Path, me: str) -> bool:
    """``mirror`` holds only checkpoints (and leftovers of saves), each saved by the run in ``me``: a mirror
    written before mirrors were marked, which its own run takes over."""
    found = list_checkpoints(mirror)
    ours = {p.name for _, p in found}
    if not found or any(
        e.name not in ours and not e.name.startswith(".tmp-") and ".damaged" not in e.name for e in mirror.iterdir()
    ):
        return False
    try:
        saved = [load_checkpoint(p, parts=("extra",), verified=True).extra_state["config"]["output_dir"] for _, p in found]
    except (CheckpointError, OSError, KeyError, TypeError):
        return False
    return all(str(Path(d).resolve()) == me for d in saved)


def _warn(dist: Distributed, text: str) -> None:
    if dist.is_main:
        print(f"warning: {text}", file=sys.stderr, flush=True)
