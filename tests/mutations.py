"""``python tests/mutations.py [--only NAME ...] [--list]``: plants bugs that once passed every test, one at a time, and checks that a test now fails.

A review planted bugs in the code one at a time and ran the relevant test files; some passed them all (issue 51).
Each ``Mutation`` below is such a bug, or the plausible bug of a rule added with its tests: a text replaced in one
module. The script copies ``src/`` into a temporary folder (the real tree is never written), checks that the
guarding test files pass on the unchanged copy, then for each mutation changes the copy's module, runs those test
files against it (``PYTHONPATH`` points at the copy; pytest runs in the checkout, so its configuration and
``tests/`` are the real ones), puts the module back, and reports which test caught it. It exits 1 when a
mutation passes every test or when the baseline fails.

Not collected by pytest (its name is not ``test_*.py``) and not part of CI: run it after changing one of these
rules or its tests (a few minutes on two cores). Hypothesis runs without shrinking here (the ``mutations``
profile in conftest.py): a failure is reported, not minimised.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    module: str  # path under src/
    edits: tuple[tuple[str, str], ...]  # (text, its replacement): each text occurs exactly once in the module
    tests: tuple[str, ...]  # pytest arguments: the test files (or node ids) that guard it
    why: str


_FORWARD_PUT_BACK = """    lm.forward = types.MethodType(_fused_forward, lm)
    try:
        yield
    finally:
        if own is _ABSENT:
            del lm.forward
        else:
            lm.forward = own
"""
_FORWARD_LEFT_ON = """    plain = lm.forward
    lm.forward = lambda *a, densebatch_head=None, **k: (
        plain(*a, **k) if densebatch_head is None else _fused_forward(lm, *a, densebatch_head=densebatch_head, **k)
    )
    yield
"""
_SOURCE_CHECK = """    if source_column is not None and path.head is None:
        if loss == "hf":
            raise ValueError("dense_batches: source_column weighs sources in densebatch's loss path: drop loss='hf'")
        raise ValueError(f"dense_batches: source_column needs densebatch's loss path, which this trainer cannot use: {path.line}")
"""
_LOADER_SET = """    state.bind(trainer, "get_train_dataloader", _get_train_dataloader)
"""
_TRAINER = "tests/integrations/test_hf_trainer_traces.py"

MUTATIONS = (
    Mutation(
        "deepcopy",
        "densebatch/integrations/fused_forward.py",
        ((_FORWARD_PUT_BACK, _FORWARD_LEFT_ON),),
        (f"{_TRAINER}::test_the_model_copies_pickles_and_saves_as_its_own_before_and_after_training",),
        "the review's issue 1: a closure over the original model left on it as its forward (copies run the original)",
    ),
    Mutation(
        "foreign_loss_count",
        "densebatch/data/prepare/foreign.py",
        (
            (
                "got = read_ranges(mask, starts[d:e] + 1, starts[d:e] + lengths[d:e]) != 0",
                "got = read_ranges(mask, starts[d:e], starts[d:e] + lengths[d:e] - 1) != 0",
            ),
        ),
        ("tests/data/prepare/test_foreign_counts.py", "tests/data/store/test_datatrove.py"),
        "the review's issue 3: a foreign corpus's loss tokens counted over [start, start + len - 1), not its targets",
    ),
    Mutation(
        "token_budget_cap",
        "densebatch/data/plan/strategies.py",
        (
            (
                "        return s.max_tokens_per_batch // s.pad_to_multiple_of * s.pad_to_multiple_of\n",
                "        return s.max_tokens_per_batch\n",
            ),
        ),
        ("tests/data/plan/test_plan.py",),
        "the review's issue 4: token_budget's row cap not rounded down to pad_to_multiple_of (a 208-slot batch at 100)",
    ),
    Mutation(
        "bidirectional_window",
        "densebatch/torch_features.py",
        (('kw["window_size"] = (left, 0 if causal else left)', 'kw["window_size"] = (left, 0 if causal else -1)'),),
        ("tests/model/test_torch_releases.py", "tests/model/test_attention.py"),
        "the review's issue 5: an encoder layer's sliding window on varlen open on the right",
    ),
    Mutation(
        "weights_outside_the_head",
        "densebatch/integrations/hf_loss.py",
        (
            (
                "losses = token_losses(model, _causal_lm(self.model), head, given, targets, per)  # (rows, T)",
                "losses = token_losses(model, _causal_lm(self.model), head, given, targets) * (1 if per is None else per)",
            ),
        ),
        ("tests/integrations/test_hf_loss.py::test_sources_weigh_the_loss_as_densebatch_loop_does",),
        "issue 51's item 2: source weights multiplied outside the fused head (its backward projects the head again)",
    ),
    Mutation(
        "autocast_dropped",
        "densebatch/integrations/hf_loss.py",
        (("    with self.accelerator.autocast():  # what", "    with __import__('contextlib').nullcontext():  # what"),),
        (f"{_TRAINER}::test_the_fused_forward_runs_under_the_trainers_mixed_precision",),
        "the fused forward standing in for accelerate's mixed-precision wrapper without its autocast",
    ),
    Mutation(
        "source_column_refused_late",
        "densebatch/integrations/hf_trainer.py",
        ((_SOURCE_CHECK, ""), (_LOADER_SET, _LOADER_SET + _SOURCE_CHECK)),
        (f"{_TRAINER}::test_a_refused_call_changes_nothing",),
        "the review's item 6: an unservable source_column refused after the trainer's loader was replaced",
    ),
    # issue 53: rows split over context ranks
    Mutation(
        "context_loss_tokens",
        "densebatch/train/parallel/shards.py",
        (("num_loss_tokens=int((labels != IGNORE_INDEX).sum()),", "num_loss_tokens=batch.num_loss_tokens,"),),
        ("tests/train/parallel/test_data_by_context.py",),
        "each context rank counting the whole rows' loss tokens: the step's denominator N times too large",
    ),
    Mutation(
        "context_real_share",
        "densebatch/train/parallel/shards.py",
        (("return total * (index + 1) // degree - total * index // degree", "return total // degree"),),
        ("tests/train/parallel/test_context_shards.py",),
        "real tokens split by floor division: the step's real tokens over the context ranks short of the rows'",
    ),
    Mutation(
        "context_contiguous_chunks",
        "densebatch/batch.py",
        (("    head, tail = index, 2 * degree - 1 - index", "    head, tail = 2 * index, 2 * index + 1"),),
        ("tests/train/parallel/test_context_shards.py",),
        "contiguous halves instead of a head and a tail chunk: a rank's queries' causal work no longer even",
    ),
    Mutation(
        "context_chunk_order",
        "densebatch/model/context_attention.py",
        (
            (
                "got.reshape(2 * N, c, rows, hq + 2 * hk, D), to_rows, to_ranks)",
                "got.reshape(2 * N, c, rows, hq + 2 * hk, D), to_ranks, to_rows)",
            ),
        ),
        ("tests/model/test_context_attention.py::test_reference_gpt_split_over_context_ranks_equals_the_whole_rows",),
        "the exchanged chunks left in the ranks' order, not the row's: attention over the wrong keys",
    ),
    Mutation(
        "context_kv_heads_tiled",
        "densebatch/model/context_attention.py",
        (
            (
                "k, v = (x.repeat_interleave(N // Hkv, dim=1) for x in (k, v))",
                "k, v = (x.repeat(1, N // Hkv, 1, 1) for x in (k, v))",
            ),
        ),
        ("tests/model/test_context_attention.py::test_hugging_face_families_split_over_context_ranks_equal_the_whole_rows",),
        "fewer key/value heads than ranks tiled, not repeated in place: a rank's query heads read another group's",
    ),
    Mutation(
        "context_data_ranks",
        "densebatch/run/build.py",
        (
            (
                "steps = StepSettings(t.grad_accum_batches, t.loss_tokens_per_step, ranks.data_size, ranks.data_rank)",
                "steps = StepSettings(t.grad_accum_batches, t.loss_tokens_per_step, dist.world_size, dist.rank)",
            ),
        ),
        ("tests/cli/test_context_parallel.py::test_rows_split_over_two_ranks_train_like_one_process",),
        "steps dealt over every process: the context ranks of a data rank read different rows",
    ),
)


def _pytest(args: tuple[str, ...], src: Path) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "HYPOTHESIS_PROFILE": "mutations", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", *args]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - t0


def _first_failure(output: str) -> str:
    found = re.search(r"^(FAILED|ERROR) (\S+)", output, re.M)
    return found.group(2) if found else "(no FAILED line)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=[m.name for m in MUTATIONS], help="these mutations only")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    a = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not a.only or m.name in a.only]
    if a.list:
        for m in chosen:
            print(f"{m.name:28} {m.module}: {m.why}")
        return 0
    with tempfile.TemporaryDirectory(prefix="densebatch-mutations-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        imported = subprocess.run(
            [sys.executable, "-c", "import densebatch; print(densebatch.__file__)"],
            env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True, cwd=REPO,
        ).stdout.strip()  # fmt: skip
        if not imported.startswith(str(src)):
            print(f"densebatch is imported from {imported!r}, not the copy under {src}: nothing checked")
            return 1
        for m in chosen:  # every text to replace is there once, before any test runs
            text = (src / m.module).read_text(encoding="utf-8")
            for old, _ in m.edits:
                if text.count(old) != 1:
                    print(f"{m.name}: a text to replace occurs {text.count(old)} times in {m.module}: update this script")
                    return 1
        files = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        rc, out, secs = _pytest(files, src)
        print(f"baseline (no mutation): {'pass' if rc == 0 else 'FAIL'} in {secs:.0f} s: {' '.join(files)}")
        if rc != 0:
            print(out[-3000:])
            return 1
        missed = []
        for m in chosen:
            path = src / m.module
            original = path.read_text(encoding="utf-8")
            mutated = original
            for old, new in m.edits:
                mutated = mutated.replace(old, new)
            path.write_text(mutated, encoding="utf-8")
            try:
                rc, out, secs = _pytest(m.tests, src)
            finally:
                path.write_text(original, encoding="utf-8")
            caught = rc == 1  # 1: tests failed (2-5: interrupted, usage, collection: not a catch)
            if not caught:
                missed.append(m.name)
            verdict = f"caught by {_first_failure(out)}" if caught else f"MISSED (pytest exit {rc})"
            print(f"{m.name:28} {verdict} in {secs:.0f} s  [{m.why}]", flush=True)
        print(
            f"{len(chosen) - len(missed)} of {len(chosen)} mutations fail a test"
            + (f"; missed: {', '.join(missed)}" if missed else "")
        )
        return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
