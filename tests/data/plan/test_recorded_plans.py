"""Plans stay bit-identical across refactors: every strategy's plans (whole, per rank, sharded, mixed) on small
synthetic lengths compared bit for bit with the plans recorded from commit 6b912b1 (before the ``Strategy``
objects), in ``recorded_plans.npz``.

Run this file as a script to record the plans again (only when a change of plans is meant)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from densebatch.data.plan.mixture import select_mixture
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.shards import plan_epoch_sharded
from densebatch.data.plan.store_epochs import materialise

RECORDED = Path(__file__).with_name("recorded_plans.npz")
NAMES = ("random", "length_grouped", "token_budget", "packed")  # the strategies recorded, by their config names
FIELDS = ("doc", "start", "stop", "row_ptr", "batch_ptr", "split", "truncated", "dropped")
SETTINGS = {  # bundles auto / off / fixed; split and truncate; rounding; drop_last
    "a": dict(seq_len=64, max_tokens_per_batch=256, rows_per_batch=4, mega_batch_mult=2),
    "b": dict(
        seq_len=64, max_tokens_per_batch=256, rows_per_batch=3, bundle_tokens=0, long_docs="truncate", pad_to_multiple_of=8
    ),
    "c": dict(seq_len=48, max_tokens_per_batch=192, rows_per_batch=5, bundle_tokens=16, drop_last=True),
}


def lengths() -> np.ndarray:
    """48 documents: mostly short, a few longer than a row or a budget (split or truncated)."""
    rng = np.random.default_rng(2026)
    out = rng.integers(1, 40, 48)
    out[[3, 17, 30]] = [300, 90, 70]
    return out.astype(np.int64)


def cases():
    """(name, Plan) of every recorded case."""
    x = lengths()
    for strategy in NAMES:
        for key, kw in SETTINGS.items():
            s = PlanSettings(strategy=strategy, **kw)
            for seed in (0, 11):
                for epoch in (0, 2):
                    yield f"{strategy}/{key}/s{seed}/e{epoch}", plan_epoch(x, settings=s, seed=seed, epoch=epoch)
            for rank in range(3):
                yield f"{strategy}/{key}/rank{rank}of3", plan_epoch(x, settings=s, seed=5, epoch=1, rank=rank, world_size=3)
        sharded = PlanSettings(strategy=strategy, shard_docs=16, **SETTINGS["a"])
        for epoch in (0, 1):
            yield f"{strategy}/sharded/e{epoch}", materialise(plan_epoch_sharded(x, settings=sharded, seed=3, epoch=epoch))
            sel = select_mixture([x[:20], x[20:]], weights=[3.0, 1.0], seed=3, epoch=epoch, names=["a", "b"])
            yield (
                f"{strategy}/mixture/e{epoch}",
                materialise(plan_epoch_sharded(x, settings=sharded, seed=3, epoch=epoch, selection=sel)),
            )


def arrays() -> dict[str, np.ndarray]:
    return {f"{name}/{f}": np.asarray(getattr(p, f)) for name, p in cases() for f in FIELDS}


def recorded() -> dict[str, np.ndarray]:
    """The recorded arrays: one int16 array of all values, cut by ``offsets`` (a few KB on disk)."""
    with np.load(RECORDED) as f:
        keys, offsets, values = f["keys"].tolist(), f["offsets"], f["values"]
    return {k: values[offsets[i] : offsets[i + 1]].astype(np.int64) for i, k in enumerate(keys)}


def test_plans_are_bit_identical_to_the_recorded_ones():
    before, now = recorded(), arrays()
    assert list(now) == list(before)
    differ = [k for k in now if now[k].tolist() != before[k].tolist()]
    assert not differ, f"{len(differ)} arrays changed, e.g. {differ[:5]}"


def test_the_recording_covers_splits_truncations_and_drops_of_every_strategy():
    before = recorded()
    for what in ("split", "truncated", "dropped"):
        assert any(len(v) for k, v in before.items() if k.endswith(what)), what
    for strategy in NAMES:
        assert sum(len(v) for k, v in before.items() if k.startswith(strategy) and k.endswith("/doc")) > 800


if __name__ == "__main__":
    now = arrays()
    assert all(int(v.min(initial=0)) >= 0 and int(v.max(initial=0)) < 2**15 for v in now.values())
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in now.values()])])
    np.savez_compressed(
        RECORDED, keys=np.array(list(now)), offsets=offsets, values=np.concatenate(list(now.values())).astype(np.int16)
    )
    print(f"{RECORDED}: {RECORDED.stat().st_size} bytes")
