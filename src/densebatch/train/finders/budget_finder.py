"""Token budget fitted to memory: the largest slots per batch whose worst batch runs a whole step, and where throughput levels off.

``find_budget`` probes budgets from the smallest valid one upwards. A probe runs, for the worst
batches at that budget (``worst(budget)``, from ``run/find.py``: the plan's batch with the most slots
and, for token budgets, as many of the longest documents as the budget holds, which bounds every
epoch's batches), a forward pass, a backward pass and an optimizer step, and measures the peak
memory (``MemoryMeter``):

- **CUDA**: ``torch.cuda.max_memory_allocated`` against the memory this process may allocate: what
  it holds plus the device's free memory (``mem_get_info``), less ``margin``, capped by
  ``memory_limit_gb``; a probe that raises ``OutOfMemoryError`` does not fit.
- **CPU**: the whole process's peak resident memory (``VmHWM`` from ``/proc/self/status``, reset
  before each probe through ``/proc/self/clear_refs``; without that, ``ru_maxrss``, which never goes
  down, so probing upwards from small budgets stays correct) against ``memory_limit_gb`` (or resident
  memory now plus ``MemAvailable``), less ``margin``. A CPU allocation rarely fails: the kernel kills
  the process instead. So probes never aim past the memory: the next budget is the smaller of twice
  the largest that fitted and the budget at which a line through the last two measured peaks uses
  3/4 of the memory left (so the search closes in on the limit geometrically), until less than 5%
  of the limit is left (the resident set moves in jumps no line predicts). A CPU probe that does not
  fit ends the search (the memory it took stays with the process, so later peaks would read it); on
  CUDA (``MemoryMeter.exact``) the cache is emptied and the search bisects. It stops when the next
  budget would gain < 3%. Resetting the peak between probes also resets what ``getrusage`` reports
  afterwards: the process's true peak is the larger of every probe's peak (the report lists them)
  and the peak after the finder.

Probes change nothing: the optimizer's rates are 0 during probes (AdamW then leaves every weight
bit for bit as it was, decay included), and its state and rates are put back afterwards, gradients
freed (memory held after the finder is what was held before), RNGs restored. A probe runs the plain
model, never a DDP / FSDP wrapper, so it has no collectives: under torchrun each rank probes alone, then the ranks
agree (a budget fits when it fits on every rank; the next budget is the smallest any rank predicts),
so all settle on one budget without a hang even when one rank has less memory. (Under FSDP this
probes a full replica: a conservative budget.) Throughput: the fastest of two more steps of the worst
batch with the most real tokens, per probe; the report names the smallest budget reaching
``throughput_share`` of the best measured.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from densebatch.batch import Batch
from densebatch.errors import UserError
from densebatch.train.checkpoint.rng import capture_rng_state, restore_rng_state
from densebatch.train.distributed import Distributed
from densebatch.train.passes import free_memory, is_out_of_memory
from densebatch.train.precision import autocast, to_device

GB = 1e9
# Most growth per probe; share of the memory left that the next probe may use by the line's prediction
# (a jump of a third more than predicted still fits: measured mispredictions reached 27%); stop gain.
GROWTH, HEADROOM, CONVERGED = 2.0, 0.75, 1.03
# Memory left (share of the limit) below which no further probe is made, on CPU and on CUDA: the
# resident set moves in jumps of ~0.1 GB (glibc arenas, a new large mapping) that no line predicts.
NOISE = (0.05, 0.02)
TIMED = 2  # timed steps per probe, after the one that measures memory


class MemoryMeter:
    """Peak memory of a probe, in bytes: CUDA allocated, or the process's resident set on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.exact = device.type == "cuda"  # allocated bytes, given back by empty_cache (not a resident set)
        self.resettable = device.type == "cpu" and _reset_hwm()

    def limit(self, limit_gb: float | None, margin: float) -> int:
        """Bytes a probe's peak may reach."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            have = free + torch.cuda.memory_reserved(self.device)  # reserved memory is ours to reuse
            cap = have if limit_gb is None else min(have, limit_gb * GB)
        else:
            cap = limit_gb * GB if limit_gb is not None else self.now() + _meminfo("MemAvailable")
        return int(cap * (1.0 - margin))

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            _reset_hwm()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        hwm = _status("VmHWM")
        return hwm if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def now(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return _status("VmRSS")


def _proc_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` field of a /proc file, in bytes (None where the system does not report it)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _status(key: str) -> int:
    return _proc_bytes("/proc/self/status", key) or 0


def _meminfo(key: str) -> int:
    value = _proc_bytes("/proc/meminfo", key)
    if value is not None:
        return value
    raise UserError("train.memory_limit_gb: set it (in GB): this system does not report its available memory")


def _reset_hwm() -> bool:
    """Reset this process's peak resident set (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class Probe:
    budget: int
    batches: list[str]  # the worst batches probed, "rows x T"
    peak_gb: list[float]  # per rank
    fits: bool
    tokens_per_s: float | None  # the fastest of TIMED steps of the worst batch with the most real tokens (rank 0)


@dataclass
class BudgetResult:
    budget: int
    peak_gb: list[float]  # per rank, at the chosen budget
    limit_gb: list[float]  # per rank: what a probe's peak could reach (margin taken off)
    probes: list[Probe] = field(default_factory=list)
    efficient_budget: int | None = None  # smallest reaching throughput_share of the best throughput
    throughput_share: float = 0.9
    device: str = "cpu"
    stop: str = ""  # why the search ended

    def as_dict(self) -> dict:
        return asdict(self)

    def report(self) -> str:
        unit = "peak resident memory" if self.device == "cpu" else "peak allocated (CUDA)"
        lines = [f"token budget fitted to memory ({unit}; limit per rank {', '.join(f'{x:.3f}' for x in self.limit_gb)} GB):"]
        lines.append("  budget  worst batches            peak GB (per rank)   fits  real tok/s")
        for p in self.probes:
            tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-"
            peaks = ", ".join(f"{x:.3f}" for x in p.peak_gb)
            lines.append(f"  {p.budget:>6}  {' + '.join(p.batches):<23}  {peaks:<19}  {'yes' if p.fits else 'no':<4}  {tps}")
        lines.append(f"chosen: batching.max_tokens_per_batch={self.budget} (peak {max(self.peak_gb):.3f} GB; {self.stop})")
        lines.append(f"highest peak of any probe: {max(max(p.peak_gb) for p in self.probes):.3f} GB")
        if self.efficient_budget is not None:
            lines.append(
                f"throughput: {self.efficient_budget} slots already reach {self.throughput_share:.0%} of the best measured "
                f"real tokens/s; larger batches buy little speed, only fewer updates"
            )
        return "\n".join(lines)


def find_budget(
    model: torch.nn.Module,
    *,
    optimizer: torch.optim.Optimizer,
    worst: Callable[[int], list[Batch]],
    snap: Callable[[int], int],
    low: int,
    high: int,
    limit_gb: float | None,
    margin: float,
    precision: str = "fp32",
    dist: Distributed | None = None,
    max_probes: int = 10,
    throughput_share: float = 0.9,
    log: Callable[[str], None] | None = None,
    forward: Callable[[Batch], torch.Tensor] | None = None,
) -> BudgetResult:
    """The largest budget in ``[low, high]`` (``snap`` rounds a budget down to a valid one) whose
    ``worst(budget)`` batches each run a whole step within the memory; see the module docstring.
    ``forward``: what maps a batch to per-token losses (default ``model.token_losses``; under FSDP the
    sharded root module, whose hooks gather each unit's weights); every rank runs the same probes."""
    dist = dist or Distributed()
    device = next(model.parameters()).device
    meter = MemoryMeter(device)
    limit = meter.limit(limit_gb, margin)
    limits = [x / GB for x in dist.gather_object(limit)]
    saved = {"state": _clone_state(optimizer), "lrs": [g["lr"] for g in optimizer.param_groups], "training": model.training}
    rng = capture_rng_state()  # dropout draws in the probes: the run's random streams must not move
    for g in optimizer.param_groups:
        g["lr"] = 0.0  # AdamW at rate 0 leaves every weight as it was: probes change nothing
    model.train()
    base = meter.now()
    fitted: list[tuple[int, int]] = []  # (budget, this rank's peak) of probes that fit on every rank
    probes: list[Probe] = []
    lo, hi, budget = None, None, snap(low)
    stop = f"finder.max_probes ({max_probes}) reached while the budget still grew: a larger one may fit"
    try:
        while len(probes) < max_probes:
            batches = worst(budget)
            peak, fits, tps = _probe(
                forward or model.token_losses, optimizer=optimizer, batches=batches, precision=precision, meter=meter, limit=limit
            )
            fits, tps = not dist.agree(not fits), dist.broadcast_object(tps)  # rank 0's speed for the report
            probes.append(
                Probe(
                    budget, [f"{b.num_rows}x{b.seq_len}" for b in batches], [x / GB for x in dist.gather_object(peak)], fits, tps
                )
            )
            if log is not None:
                log(f"  probe {budget} slots: peak {max(probes[-1].peak_gb):.3f} GB, {'fits' if fits else 'too large'}")
            if fits:
                lo = budget
                fitted.append((budget, peak))
            else:
                hi = budget
                if lo is None:
                    break
                if not meter.exact:  # the allocator keeps what the overrun took: later peaks would read it
                    stop = "the last probe did not fit; on CPU the memory it took stays with the process, so no bisection"
                    break
            nxt = snap(_next_budget(fitted, lo=lo, hi=hi, limit=limit, base=base, high=high, dist=dist, noise=NOISE[meter.exact]))
            if lo >= high:
                stop = "every document fits in one batch: no larger budget changes anything"
                break
            if nxt <= lo * CONVERGED or nxt >= (hi or math.inf) or nxt in (p.budget for p in probes):
                stop = f"converged: the next budget would gain less than {CONVERGED - 1:.0%}"
                break
            budget = nxt
    finally:
        optimizer.load_state_dict(saved["state"])  # state and rates as before the probes
        for g, lr in zip(optimizer.param_groups, saved["lrs"]):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        model.train(saved["training"])
        restore_rng_state(rng)
        free_memory(device, collect=False)
    if lo is None:
        first = probes[0]
        worst_rank = max(range(len(first.peak_gb)), key=lambda r: first.peak_gb[r] - limits[r])
        raise UserError(
            f"batching.max_tokens_per_batch: auto: even the smallest budget ({first.budget} slots, {' + '.join(first.batches)}) "
            f"needs {first.peak_gb[worst_rank]:.2f} GB on rank {worst_rank}, over its {limits[worst_rank]:.2f} GB "
            f"(train.memory_limit_gb less finder.memory_reserve): raise the limit, or lower data.max_seq_len / batching.seq_len"
        )
    chosen = next(p for p in probes if p.budget == lo)
    best = max((p.tokens_per_s or 0.0) for p in probes if p.fits)
    efficient = min((p.budget for p in probes if p.fits and (p.tokens_per_s or 0.0) >= throughput_share * best), default=None)
    return BudgetResult(lo, chosen.peak_gb, limits, probes, efficient if best > 0 else None, throughput_share, device.type, stop)


def _next_budget(fitted, *, lo: int | None, hi: int | None, limit: int, base: int, high: int, dist, noise: float) -> int:
    """The next budget to probe (the same on every rank): the smallest any rank predicts fits; ``lo``
    (stop) when less than ``noise`` of the limit is left, below what a prediction can resolve."""
    b1, p1 = fitted[-1] if fitted else (0, base)
    # Bytes per slot: the steeper of the last two probes' line and the line from the first probe (a
    # short span can read flat when one peak happened to be high); with one probe, the line from the
    # memory held before probing (which then includes the optimizer state: conservative).
    pairs = [fitted[-2], fitted[0]] if len(fitted) >= 2 else [(0, base)]
    slope = max([(p1 - p0) / max(1, b1 - b0) for b0, p0 in pairs] + [1.0])
    predicted = b1 + HEADROOM * (limit - p1) / slope if p1 < (1.0 - noise) * limit else b1
    want = min(GROWTH * lo, predicted, high) if hi is None else min((lo + hi) / 2, max(lo, predicted))
    return int(dist.all_reduce(torch.tensor([float(want)], dtype=torch.float64), "min").item())


def _probe(
    losses_of, *, optimizer, batches: list[Batch], precision: str, meter: MemoryMeter, limit: int
) -> tuple[int, bool, float | None]:
    """(peak bytes, fits, real tokens/s) of a whole step on each of ``batches``; no collectives."""
    device = meter.device
    free_memory(device, collect=False)  # what earlier probes freed goes back first: the reset peak is then what is live
    meter.reset()
    oom = False
    try:
        for batch in batches:
            _step(losses_of, optimizer=optimizer, batch=batch, device=device, precision=precision)
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        oom = True
    optimizer.zero_grad(set_to_none=True)
    free_memory(device, collect=oom)
    peak = meter.peak()
    fits = not oom and peak <= limit
    if not fits:
        return peak, False, None
    timed = max(batches, key=lambda b: b.num_real_tokens)
    seconds = math.inf
    for _ in range(TIMED):  # the fastest of a few: other processes only ever slow a step down
        t0 = time.perf_counter()
        _step(losses_of, optimizer=optimizer, batch=timed, device=device, precision=precision)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = min(seconds, time.perf_counter() - t0)
    optimizer.zero_grad(set_to_none=True)
    return peak, True, timed.num_real_tokens / seconds if seconds > 0 else None


def _step(losses_of, *, optimizer, batch: Batch, device: torch.device, precision: str) -> None:
    optimizer.zero_grad(set_to_none=True)
    batch = to_device(batch, device)
    with autocast(device, precision):
        losses = losses_of(batch)  # (rows, T)
    (losses.float().sum() / max(1, batch.num_loss_tokens)).backward()
    optimizer.step()


def _clone_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with its tensors copied (its live tensors change in place)."""
    state = optimizer.state_dict()
    return {
        "state": {
            k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()} for k, s in state["state"].items()
        },
        "param_groups": [dict(g) for g in state["param_groups"]],
    }
