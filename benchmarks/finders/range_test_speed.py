"""Time per step of the learning-rate range test (``densebatch find-lr``), for source trees and CPU thread settings side by side.

Each arm is one ``densebatch find-lr`` run in a child process (the CLI's own ``main``, as a user runs it),
with ``_step`` of ``train/finders/lr_finder.py`` wrapped to read the clock: a step's time runs from the
start of its update to the start of the next (the update, the held-out evaluation after it and the
divergence check), in wall and CPU seconds. What it compares:

- ``--src``: source trees (``NAME=PATH/src``), e.g. this checkout against an older release checked out in a
  throwaway worktree (``git worktree add --detach /tmp/old COMMIT``); each child imports densebatch from its
  tree (``PYTHONPATH``).
- ``--arms``: the CPU thread settings, each ``NAME=VAR=VALUE,VAR=VALUE`` (``OMP_NUM_THREADS``,
  ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``), given to every tree. ``GOMP_SPINCOUNT=300000`` is what libgomp
  (torch's OpenMP on Linux) does when neither it nor ``OMP_WAIT_POLICY`` is set: a waiting thread spins that
  long before it sleeps.

On a shared machine the load changes from minute to minute, more than many differences between arms, so
the arms of a round run one after the other, in an order that alternates from round to round, and rounds
repeat; the table gives each arm's median over all its steps, the load average before and after each round,
and each arm's ratio to the first arm (the median over rounds of the ratio of their medians). ``--together``
runs a round's arms at the same time instead; then they also load each other (a spinning arm takes CPU from
the others). The steps after ``--skip`` (the first ones read caches in) count.

    .venv/bin/python -m benchmarks.finders.range_test_speed --src now=src,old=/tmp/old/src --arms libgomp=GOMP_SPINCOUNT=300000 --rounds 3
    .venv/bin/python -m benchmarks.finders.range_test_speed --arms libgomp=GOMP_SPINCOUNT=300000,passive=OMP_WAIT_POLICY=PASSIVE --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child(out: str, args: list[str]) -> None:
    """In the child: run ``densebatch find-lr ARGS`` with each step's start timed; write the times to ``out``."""
    import densebatch.train.finders.lr_finder as lr_finder
    from densebatch.cli import main

    marks: list[tuple[float, float]] = []
    step = lr_finder._step

    def timed(trainer, it, lr):
        marks.append((time.perf_counter(), time.process_time()))
        return step(trainer, it, lr)

    lr_finder._step = timed
    code = main(["find-lr", *args])
    marks.append((time.perf_counter(), time.process_time()))  # the end of the last step (the report is cheap)
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    Path(out).write_text(json.dumps({"code": code, "wall": wall, "cpu": cpu, "module": lr_finder.__file__}), encoding="utf-8")


def parse_pairs(text: str, what: str) -> dict[str, str]:
    """``a=x,b=y`` → {a: x, b: y} (a value may hold ``=``; an arm's own ``,`` separates its variables, so arms are
    given as separate ``NAME=...`` items only when their names come first)."""
    out: dict[str, str] = {}
    name = None
    for item in text.split(","):
        head, _, rest = item.partition("=")
        if head and head.isidentifier() and not head.isupper() and rest:
            name = head
            out[name] = rest
        elif name is not None and "=" in item:
            out[name] += "," + item
        else:
            sys.exit(f"--{what}: expected NAME=VALUE items, got {item!r}")
    return out


def env_of(spec: str) -> dict[str, str]:
    """``VAR=VALUE,VAR=VALUE`` (an arm) → {VAR: VALUE}; ``-`` or empty = no variable."""
    return {} if spec in ("", "-") else dict(p.split("=", 1) for p in spec.split(","))


def run_round(
    jobs: list[tuple[str, str, dict]], *, args: list[str], work: Path, together: bool, check: bool = True
) -> dict[str, dict]:
    """Run every (label, tree, env) job once, side by side when ``together``; {label: the child's times}
    (``check``: exit when a run failed)."""
    procs = []
    for label, tree, env in jobs:
        out = work / f"{label}.json"
        out.unlink(missing_ok=True)
        full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
        full |= {"PYTHONPATH": os.pathsep.join([tree, str(REPO)]), "OMP_NUM_THREADS": "2"} | env
        cmd = [sys.executable, "-m", "benchmarks.finders.range_test_speed", "--child", str(out), "--"]
        cmd += [*args, f"--output_dir={work / label}"]
        log = open(work / f"{label}.log", "w")  # noqa: SIM115  (closed once the child ended)
        procs.append((label, subprocess.Popen(cmd, cwd=work, env=full, stdout=log, stderr=subprocess.STDOUT), log, out))
        if not together:
            procs[-1][1].wait()
    results = {}
    for label, proc, log, out in procs:
        proc.wait()
        log.close()
        if check and (proc.returncode or not out.is_file()):
            sys.exit(f"{label}: find-lr failed ({proc.returncode}); see {work / (label + '.log')}")
        results[label] = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--src", default="now=src", help="NAME=PATH,... source trees (PATH: a tree's src folder)")
    p.add_argument("--arms", default="libgomp=GOMP_SPINCOUNT=300000", help="NAME=VAR=VALUE,... CPU thread settings")
    p.add_argument("--steps", type=int, default=40, help="finder.lr_steps")
    p.add_argument("--skip", type=int, default=3, help="first steps left out of the medians")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--together", action="store_true", help="run a round's arms at the same time, not one after the other")
    p.add_argument("--work", default=None, help="working folder (default: a temporary one); the data cache is kept there")
    p.add_argument("finder_args", nargs="*", help="after --: find-lr's arguments (default: the embedded default task)")
    a = p.parse_args()
    if a.child:
        child(a.child, a.finder_args)
        return
    trees = {k: str((REPO / v).resolve()) for k, v in parse_pairs(a.src, "src").items()}
    arms = {k: env_of(v) for k, v in parse_pairs(a.arms, "arms").items()}
    jobs = [(f"{t}/{m}".replace("/", "-"), path, env) for t, path in trees.items() for m, env in arms.items()]
    work = Path(a.work or tempfile.mkdtemp(prefix="range-test-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    args = [*a.finder_args, f"--finder.lr_steps={a.steps}"]
    print(f"jobs: {', '.join(j[0] for j in jobs)}; find-lr {' '.join(args)}; {os.cpu_count()} CPUs; work {work}", flush=True)
    run_round(jobs[:1], args=[*args, "--finder.lr_steps=5"], work=work, together=False, check=False)  # the data, prepared once
    walls: dict[str, list[float]] = {j[0]: [] for j in jobs}
    cpus: dict[str, list[float]] = {j[0]: [] for j in jobs}
    ratios: dict[str, list[float]] = {j[0]: [] for j in jobs}
    for r in range(a.rounds):
        before = os.getloadavg()[0]
        order = jobs if r % 2 == 0 else jobs[::-1]
        res = run_round(order, args=args, work=work, together=a.together)
        after = os.getloadavg()[0]
        line = []
        for label, x in sorted(res.items(), key=lambda kv: [j[0] for j in jobs].index(kv[0])):
            w, c = statistics.median(x["wall"][a.skip :]), statistics.median(x["cpu"][a.skip :])
            walls[label] += x["wall"][a.skip :]
            cpus[label] += x["cpu"][a.skip :]
            ratios[label].append(w / statistics.median(res[jobs[0][0]]["wall"][a.skip :]))
            line.append(f"{label} {w:.3f} s ({c:.3f} CPU)")
        print(f"round {r + 1}: load {before:.1f} -> {after:.1f} | " + " | ".join(line), flush=True)
    print("\n| arm | steps | median wall s/step | median CPU s/step | wall ÷ first arm (median of rounds) |")
    print("|---|---|---|---|---|")
    for label, _, env in jobs:
        ratio = statistics.median(ratios[label])
        print(
            f"| {label} ({','.join(f'{k}={v}' for k, v in env.items()) or 'nothing set'}) | {len(walls[label])} | "
            f"{statistics.median(walls[label]):.3f} | {statistics.median(cpus[label]):.3f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
