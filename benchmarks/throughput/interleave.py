"""Step-interleaved timing: several training runs in one process take turns, one optimizer step each.

On a machine shared with other jobs the load changes from minute to minute, so runs timed one after
the other see different machines. Here every method runs in its own thread, but a baton lets only
one compute at a time: method A's step 1, then B's step 1, then C's, then A's step 2, ... A step's
time counts from the moment its method got the baton to the end of that step, so all methods sample
the load at the same moments, seconds apart. ``StepTimer`` is what a runner calls at each step end;
without a baton it is a plain timer (time between consecutive step ends).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Baton:
    """Round-robin turns among named runners; ``done`` takes a runner out of the rotation."""

    def __init__(self, names: list[str]):
        self.active = list(names)
        self.current = names[0] if names else None
        self.cond = threading.Condition()

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.current == name)

    def _advance(self, name: str) -> None:
        i = self.active.index(name)
        self.current = self.active[(i + 1) % len(self.active)]

    def pass_and_wait(self, name: str) -> None:
        with self.cond:
            self._advance(name)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.current == name)

    def done(self, name: str) -> None:
        with self.cond:
            if name in self.active:
                if self.current == name and len(self.active) > 1:
                    self._advance(name)
                self.active.remove(name)
                if not self.active:
                    self.current = None
            self.cond.notify_all()


class StepTimer:
    """Wall and process-CPU time of each step, counted only while this runner holds the baton."""

    def __init__(self, baton: Baton | None = None, name: str = ""):
        self.baton, self.name = baton, name
        self.resumes: list[tuple[float, float]] = []  # when each step began (the baton came back)
        self.ends: list[tuple[float, float]] = []

    @staticmethod
    def _now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def start(self) -> None:
        if self.baton is not None:
            self.baton.wait(self.name)
        self.resumes.append(self._now())

    def step_end(self) -> None:
        self.ends.append(self._now())
        if self.baton is not None:
            self.baton.pass_and_wait(self.name)
        self.resumes.append(self._now())

    def finish(self) -> None:
        if self.baton is not None:
            self.baton.done(self.name)

    def seconds(self, warmup: int) -> tuple[list[float], list[float]]:
        """(wall, CPU) seconds of every step after the first ``warmup``."""
        steps = range(warmup, len(self.ends))
        wall = [self.ends[k][0] - self.resumes[k][0] for k in steps]
        cpu = [self.ends[k][1] - self.resumes[k][1] for k in steps]
        return wall, cpu


def run_interleaved(jobs: dict[str, Callable[[StepTimer], object]]) -> dict[str, object]:
    """Run ``jobs[name](timer)`` for every name, step-interleaved; their results by name."""
    baton = Baton(list(jobs))
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def work(name: str, job) -> None:
        timer = StepTimer(baton, name)
        try:
            timer.start()
            results[name] = job(timer)
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
        finally:
            timer.finish()

    threads = [threading.Thread(target=work, args=(n, j), name=f"bench-{n}", daemon=True) for n, j in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def run_alone(job: Callable[[StepTimer], object]) -> object:
    """``job(timer)`` with a plain timer (no other runner to take turns with)."""
    timer = StepTimer()
    timer.start()
    return job(timer)
