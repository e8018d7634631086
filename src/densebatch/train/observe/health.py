"""The run tells you what is wrong: warnings from the per-step train records, once per cause, with the figure.

``HealthMonitor.observe(record) -> list[HealthWarning]`` is fed every ``"kind": "train"`` record and
returns the warnings that record raised (usually none); each cause warns at most once per run.
``summary()`` lists every warning given, for the end-of-run summary. Causes (``key``):

==============  =================================================================================
``data_wait``   over the last ``window`` steps, the step waited for its batches more than
                ``data_wait_share`` of its time (``sum data_wait_s / sum step_s``)
``memory``      the step's peak memory came within ``memory_headroom`` of ``memory_limit_gb``
                (CUDA records: the largest ``cuda_*_gb``; CPU: ``mem_peak_rss_gb`` / ``mem_rss_gb``)
``throughput``  the median ``tokens_per_s`` of the last ``recent`` steps fell below
                ``slow_ratio`` x the median of the last ``window`` steps before them
``fill_rate``   the same for ``fill_rate``, below ``fill_ratio`` x its median
``clipping``    ``grad_norm`` exceeded the clip limit (the record's ``clip_limit``, else
                ``clip_limit`` given here) on more than ``clip_share`` of the last ``window`` steps,
                judged from step ``clip_warmup_steps`` on
==============  =================================================================================

The first ``warmup_steps`` records are not judged (allocator, compilation and the early large
gradients make them unrepresentative), except for memory, which is a hard limit from the first step.
Clipping waits longer (``clip_warmup_steps``): a model trained from scratch has large gradients for
its first hundred or so steps, and cutting them is what the limit is for (the demo clips 70-100% of
its steps 1-100, ~40% up to step 200, then almost none); a limit that still cuts most steps after
that is set too low for the run, or the learning rate too high.
Missing or non-finite fields are ignored, so a record without memory or timing figures raises nothing.
Cost per step: O(window) on small fixed windows (a sorted list of at most ``window`` floats), i.e.
constant in the length of the run; microseconds.
"""

from __future__ import annotations

import bisect
import math
import os
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

CUDA_MEMORY_KEYS = ("cuda_max_reserved_gb", "cuda_max_allocated_gb")
CPU_MEMORY_KEYS = ("mem_peak_rss_gb", "mem_rss_gb")


@dataclass(frozen=True)
class HealthWarning:
    """One cause, at the step that revealed it: ``key`` (short, stable), ``message`` (with the figure)."""

    key: str
    step: int
    message: str
    value: float  # the figure that crossed the threshold
    threshold: float

    def __str__(self) -> str:
        return f"step {self.step}: {self.message}"

    def as_record(self) -> dict:
        """For metrics.jsonl: ``{"kind": "warning", "step", "key", "message", "value", "threshold"}``."""
        return {"kind": "warning"} | asdict(self)


def _num(record: dict, key: str) -> float | None:
    v = record.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


class _Window:
    """The last ``size`` values in arrival order and sorted (for the median), plus their sum."""

    def __init__(self, size: int):
        self.items: deque[float] = deque()
        self.sorted: list[float] = []
        self.size, self.total = size, 0.0

    def push(self, value: float) -> float | None:
        """Add ``value``; return the value it pushed out (None while not full)."""
        self.items.append(value)
        bisect.insort(self.sorted, value)
        self.total += value
        if len(self.items) <= self.size:
            return None
        old = self.items.popleft()
        del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.total -= old
        return old

    def __len__(self) -> int:
        return len(self.items)

    def median(self) -> float:
        s, n = self.sorted, len(self.sorted)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class _Drop:
    """Median of the last ``recent`` values against the median of the ``reference`` values before them."""

    def __init__(self, recent: int, reference: int):
        self.recent, self.reference = _Window(recent), _Window(reference)

    def push(self, value: float) -> tuple[float, float] | None:
        """``(recent median, reference median)`` once both windows are full enough to compare."""
        old = self.recent.push(value)
        if old is not None:
            self.reference.push(old)
        if len(self.recent) < self.recent.size or len(self.reference) < self.recent.size:
            return None
        return self.recent.median(), self.reference.median()


class HealthMonitor:
    """Watch train records for the causes above; thresholds are the constructor's (defaults documented)."""

    def __init__(
        self,
        *,
        memory_limit_gb: float | None = None,  # see default_memory_limit_gb; None: unchecked
        clip_limit: float | None = None,  # fixed clip limit when records carry no ``clip_limit`` (0 / inf / None: off)
        warmup_steps: int = 20,
        window: int = 50,  # steps of data-wait and clipping history; reference window of the medians
        recent: int = 20,  # steps whose median is compared with the reference median
        data_wait_share: float = 0.2,  # waiting on data for more than 20% of the step time
        memory_headroom: float = 0.1,  # peak memory above 90% of the limit
        slow_ratio: float = 0.5,  # tokens/s at half its median
        fill_ratio: float = 0.7,  # fill rate at 70% of its median (per-step fill varies a lot with random batching)
        clip_share: float = 0.5,  # clipped on more than half of the last ``window`` steps
        clip_warmup_steps: int = 200,  # steps before the clipping check starts
    ):
        self.memory_limit_gb, self.clip_limit = memory_limit_gb, clip_limit
        self.warmup_steps, self.window = warmup_steps, window
        self.data_wait_share, self.memory_headroom = data_wait_share, memory_headroom
        self.slow_ratio, self.fill_ratio, self.clip_share = slow_ratio, fill_ratio, clip_share
        self.clip_warmup_steps = clip_warmup_steps
        self.warnings: list[HealthWarning] = []
        self._given: set[str] = set()
        self._seen = 0
        self._wait, self._time = deque(maxlen=window), deque(maxlen=window)  # (data_wait_s), (step_s)
        self._wait_sum = self._time_sum = 0.0
        self._clipped: deque[bool] = deque(maxlen=window)
        self._clipped_sum = 0
        self._tps, self._fill = _Drop(recent, window), _Drop(recent, window)

    # --------------------------------------------------------------------------------- checks
    def observe(self, record: dict) -> list[HealthWarning]:
        """The warnings this train record raises (each cause once per run)."""
        if record.get("kind", "train") != "train":
            return []
        step = int(record.get("step", 0))
        out: list[HealthWarning] = []
        self._memory(record, step, out)
        self._seen += 1
        if self._seen > self.warmup_steps:
            self._data_wait(record, step, out)
            self._drop("throughput", self._tps, _num(record, "tokens_per_s"), self.slow_ratio, "real tokens/s", step, out)
            self._drop("fill_rate", self._fill, _num(record, "fill_rate"), self.fill_ratio, "fill rate", step, out)
            if self._seen > self.clip_warmup_steps:
                self._clipping(record, step, out)
        return out

    def _warn(self, out: list, key: str, step: int, message: str, value: float, threshold: float) -> None:
        if key in self._given:
            return
        self._given.add(key)
        w = HealthWarning(key, step, message, value, threshold)
        self.warnings.append(w)
        out.append(w)

    def _memory(self, record: dict, step: int, out: list) -> None:
        limit = self.memory_limit_gb
        if not limit or "memory" in self._given:
            return
        keys = CUDA_MEMORY_KEYS if any(k in record for k in CUDA_MEMORY_KEYS) else CPU_MEMORY_KEYS
        figures = [(v, k) for k in keys if (v := _num(record, k)) is not None]
        if not figures:
            return
        used, key = max(figures)
        if used >= (1 - self.memory_headroom) * limit:
            self._warn(
                out,
                "memory",
                step,
                f"memory {used:.2f} GB ({key}) is {used / limit:.0%} of the {limit:.2f} GB limit "
                f"(warning above {1 - self.memory_headroom:.0%}): lower the batch's token budget or the model size",
                used,
                (1 - self.memory_headroom) * limit,
            )

    def _data_wait(self, record: dict, step: int, out: list) -> None:
        wait, total = _num(record, "data_wait_s"), _num(record, "step_s")
        if wait is None or total is None:
            return
        if len(self._wait) == self.window:
            self._wait_sum -= self._wait[0]
            self._time_sum -= self._time[0]
        self._wait.append(wait)
        self._time.append(total)
        self._wait_sum += wait
        self._time_sum += total
        if len(self._wait) < min(self.window, 10) or self._time_sum <= 0:
            return
        share = self._wait_sum / self._time_sum
        if share > self.data_wait_share:
            self._warn(
                out,
                "data_wait",
                step,
                f"steps wait on data for {share:.0%} of their time over the last {len(self._wait)} steps "
                f"(warning above {self.data_wait_share:.0%}): raise batching.prefetch or make preparation cheaper",
                share,
                self.data_wait_share,
            )

    def _drop(self, key: str, drop: _Drop, value: float | None, ratio: float, what: str, step: int, out: list) -> None:
        if value is None or key in self._given:
            return
        medians = drop.push(value)
        if medians is None:
            return
        recent, reference = medians
        if reference > 0 and recent < ratio * reference:
            self._warn(
                out,
                key,
                step,
                f"{what} fell to {recent:.4g} (median of the last {drop.recent.size} steps), {recent / reference:.0%} of "
                f"the median {reference:.4g} of the {len(drop.reference)} steps before them (warning below {ratio:.0%})",
                recent,
                ratio * reference,
            )

    def _clipping(self, record: dict, step: int, out: list) -> None:
        norm = _num(record, "grad_norm")
        limit = _num(record, "clip_limit")
        limit = limit if limit is not None else self.clip_limit
        if norm is None or not limit or not math.isfinite(limit):
            return
        if len(self._clipped) == self.window:
            self._clipped_sum -= self._clipped[0]
        clipped = norm > limit
        self._clipped.append(clipped)
        self._clipped_sum += clipped
        if len(self._clipped) < self.window:
            return
        share = self._clipped_sum / self.window
        if share > self.clip_share:
            self._warn(
                out,
                "clipping",
                step,
                f"gradient norm above the clip limit ({limit:.3g}) on {share:.0%} of the last {self.window} steps "
                f"(warning above {self.clip_share:.0%}): the learning rate may be too high",
                share,
                self.clip_share,
            )

    # ---------------------------------------------------------------------------------- report
    def summary(self) -> list[HealthWarning]:
        """Every warning given in this run, in order."""
        return list(self.warnings)

    def format_summary(self) -> str:
        """Lines for the end-of-run summary ('' when the run was healthy)."""
        return "\n".join(f"warning          {w}" for w in self.warnings)

    def state_dict(self) -> dict:
        """The warnings already given, so that a resumed run does not give them again."""
        return {"warnings": [asdict(w) for w in self.warnings]}

    def load_state_dict(self, state: dict) -> None:
        self.warnings = [HealthWarning(**w) for w in state.get("warnings", [])]
        self._given = {w.key for w in self.warnings}


def default_memory_limit_gb(device) -> float | None:
    """The memory a run cannot exceed, in GB, when no limit is set: the CUDA device's total memory, or on
    CPU the machine's physical memory, lowered to the cgroup's limit when a container sets one (cgroup v2
    ``memory.max``). None when it cannot be read (the memory check is then off)."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory / 1e9
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        cgroup = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cgroup.isdigit():
            limit = min(limit, int(cgroup))
    except OSError:
        pass
    return limit / 1e9
