"""Homogeneity of batches (data/plan/homogeneity.py): about 0 for random batches whatever their size,
about 1 for length-sorted ones; bundled plans near 0; sources measured like lengths; sharded plans read
shard by shard; the run warns once when its batches are far from random samples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cli_args import TINY

from densebatch.cli import main
from densebatch.data.plan.homogeneity import HOMOGENEOUS, homogeneity, warning
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.shards import plan_epoch_sharded

RNG = np.random.default_rng(0)
LENGTHS = np.clip(RNG.lognormal(np.log(120), 0.8, 6000).astype(np.int64), 2, 1000)


@pytest.mark.parametrize("rows", [2, 8, 32])
def test_random_batches_score_about_zero_whatever_their_size(rows):
    p = plan_epoch(LENGTHS, settings=PlanSettings(strategy="random", rows_per_batch=rows), seed=0, epoch=0)
    assert abs(homogeneity(p, lengths=LENGTHS)["length"]) < 0.05


def test_length_sorted_batches_score_about_one_and_bundled_ones_near_zero():
    sorted_ = {
        "length_grouped": PlanSettings(strategy="length_grouped", bundle_tokens=0),
        "token_budget": PlanSettings(strategy="token_budget", max_tokens_per_batch=2048, bundle_tokens=0),
    }
    for name, s in sorted_.items():
        assert homogeneity(plan_epoch(LENGTHS, settings=s, seed=0, epoch=0), lengths=LENGTHS)["length"] > 0.9, name
    for name, s in {
        "length_grouped": PlanSettings(strategy="length_grouped"),
        "token_budget": PlanSettings(strategy="token_budget", max_tokens_per_batch=2048),
        "packed": PlanSettings(strategy="packed", seq_len=1024, max_tokens_per_batch=1024),
    }.items():
        bundled = homogeneity(plan_epoch(LENGTHS, settings=s, seed=0, epoch=0), lengths=LENGTHS)["length"]
        alone = homogeneity(
            plan_epoch(LENGTHS, settings=dataclasses.replace(s, bundle_tokens=0), seed=0, epoch=0), lengths=LENGTHS
        )["length"]
        # measured: token_budget 0.01 (1.00 unbundled), packed one row a batch 0.20 (0.80 unbundled)
        assert bundled < 0.3 * alone and bundled < HOMOGENEOUS, (name, bundled, alone)


def test_sources_of_different_lengths_make_sorted_batches_one_source():
    lengths = np.concatenate([RNG.integers(20, 60, 3000), RNG.integers(200, 400, 3000)]).astype(np.int64)
    source = (np.arange(len(lengths)) >= 3000).astype(np.int64)
    of = lambda d: source[d]  # noqa: E731
    hf = PlanSettings(strategy="length_grouped", bundle_tokens=0)
    grouped = homogeneity(plan_epoch(lengths, settings=hf, seed=0, epoch=0), lengths=lengths, source_of=of, num_sources=2)
    rand = homogeneity(
        plan_epoch(lengths, settings=PlanSettings(strategy="random"), seed=0, epoch=0),
        lengths=lengths,
        source_of=of,
        num_sources=2,
    )
    assert grouped["source"] > 0.9 and abs(rand["source"]) < 0.05
    # bundles of the short source are as long as the long source's documents, so batches hold both, but
    # a bundle is ~7 short documents in one row: by document counts a batch's share swings with its number
    # of bundles (measured 0.73, against 1.0 with one document per row)
    bundled = homogeneity(
        plan_epoch(lengths, settings=PlanSettings(strategy="length_grouped"), seed=0, epoch=0),
        lengths=lengths,
        source_of=of,
        num_sources=2,
    )
    assert bundled["source"] < 0.8 * grouped["source"], bundled
    assert (
        homogeneity(plan_epoch(lengths, settings=PlanSettings(strategy="random"), seed=0, epoch=0), lengths=lengths)["source"]
        is None
    )


def test_a_sharded_plan_is_read_shard_by_shard():
    s = PlanSettings(strategy="length_grouped", bundle_tokens=0, shard_docs=1000)
    sharded = plan_epoch_sharded(LENGTHS, settings=s, seed=0, epoch=0)
    assert sharded.num_shards > 1
    whole, first = homogeneity(sharded, lengths=LENGTHS), homogeneity(sharded, lengths=LENGTHS, max_shards=1)
    assert whole["length"] > 0.9 and first["length"] > 0.9
    one = plan_epoch_sharded(LENGTHS, settings=dataclasses.replace(s, shard_docs=1 << 20), seed=0, epoch=0)
    assert homogeneity(one, lengths=LENGTHS) == homogeneity(one.shard(0), lengths=LENGTHS)


def test_the_warning_names_what_is_alike_only_above_the_threshold():
    assert warning({"length": HOMOGENEOUS - 0.01, "source": None}, "packed") is None
    line = warning({"length": 0.99, "source": 0.1}, "length_grouped")
    assert line.startswith("warning: length_grouped batches are far more alike than random ones in length (homogeneity 0.99")
    assert "source" not in line.split("quality")[0].split("in length")[1].split(":")[0]
    # the advice fits the setting: bundling on when it is off, more bundling when it is already auto
    assert warning({"length": 0.99}, "length_grouped", 0).endswith("set batching.bundle_tokens: auto (or more tokens)")
    auto = warning({"length": 0.99}, "token_budget", "auto")
    assert "raise batching.bundle_tokens (auto now)" in auto and "with batching.bundle_tokens auto" not in auto


@pytest.mark.slow
def test_a_run_warns_once_when_its_batches_are_length_sorted(tmp_path, capsys):
    args = [*TINY, f"--data.cache_dir={tmp_path / 'cache'}", "--train.max_steps=1", "--eval.every_steps=0"]
    hf = ["--batching.strategy=length_grouped", "--batching.bundle_tokens=0"]
    assert main(["train", *args, f"--output_dir={tmp_path / 'a'}", *hf]) == 0
    assert capsys.readouterr().out.count("warning: length_grouped batches are far more alike") == 1
    for name, extra in (("b", []), ("c", ["--batching.strategy=length_grouped"])):  # bundled: no warning
        assert main(["train", *args, f"--output_dir={tmp_path / name}", *extra]) == 0
        assert "far more alike" not in capsys.readouterr().out, extra
