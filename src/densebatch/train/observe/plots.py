"""Pictures of a run: PNGs of loss, learning rate, gradient norm, throughput, memory and step time from metrics.jsonl.

``plot_run(run_dir) -> list[Path]`` reads ``run_dir/metrics.jsonl`` and writes ``run_dir/plots/*.png``:

- ``loss.png``: train loss per step (thin), its smoothed curve, eval loss (points); skipped steps
  (``x`` along the top) and rollbacks (dashed vertical lines) marked; log scale when the loss spans
  more than a decade.
- ``lr.png``: learning rate (linear: warm-up and decay read best on a linear axis).
- ``grad_norm.png``: gradient norm before clipping (log scale) and the clip limit (``clip_limit``).
- ``throughput.png``: real tokens/s (raw and smoothed) over the fill rate.
- ``memory.png``: whichever memory figures the step records carry (GB), and the run record's whole-run peak
  (the summary's "peak memory", which also counts the final evaluation) as a dashed line.
- ``step_time.png``: seconds per step split into data wait, forward+backward and optimizer.

A file is written only when its data exist (a run with eval only gets ``loss.png`` alone).
Smoothing is an exponential moving average made two-sided (the plots are drawn after the fact, so
the smoothed curve need not lag behind a falling loss): point ``i`` is the average of the points
``j`` weighted by ``w^|i-j|``, ``w = 1 - 1/span``, ``span = clamp(points / 25, 1, 50)``, normalised by
the weights present (so the ends are not pulled towards zero, as TensorBoard's bias correction);
missing values (NaN, null) weigh nothing.
Replayed steps after a rollback supersede the records they replace (metrics.jsonl keeps both), so
curves never double back. matplotlib is imported lazily, through its object API (no pyplot, no
global backend change): the Agg renderer writes the files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from densebatch.errors import ConfigError, UserError
from densebatch.train.observe.monitor import METRICS_FILE, read_metrics

PLOTS_DIR = "plots"
MEMORY_KEYS = {  # record field -> legend
    "mem_rss_gb": "process resident memory (RSS)",
    "mem_peak_rss_gb": "peak RSS up to the step",
    "cuda_max_allocated_gb": "CUDA peak allocated in the step",
    "cuda_max_reserved_gb": "CUDA peak reserved in the step",
}
RUN_PEAK_KEYS = {  # the run record's (rank 0's) whole-run peaks -> legend: the summary's "peak memory" line
    "mem_peak_rss_gb": "peak RSS of the whole run (final evaluation included; the summary's)",
    "cuda_peak_allocated_gb": "CUDA peak allocated, whole run (the summary's)",
    "cuda_peak_reserved_gb": "CUDA peak reserved, whole run (the summary's)",
}
TIME_KEYS = {"data_wait_s": "data wait", "fwd_bwd_s": "forward + backward", "optimizer_s": "optimizer"}  # field -> legend
APPLIED = ("ok", "applied", None)  # outcomes of a step whose update was applied


def _value(v) -> float:
    """A plottable float: NaN for a missing, null, boolean or non-numeric value."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


@dataclass
class Series:
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, step: int, value) -> None:
        self.steps.append(step)
        self.values.append(_value(value))

    def finite(self) -> list[float]:
        return [v for v in self.values if math.isfinite(v)]

    def __bool__(self) -> bool:
        return bool(self.finite())


@dataclass
class RunData:
    """What the plots draw, extracted from metrics records (kept apart from drawing, to be tested)."""

    name: str
    train: dict[str, Series] = field(default_factory=dict)  # key -> series over train records
    eval_loss: Series = field(default_factory=Series)
    skipped: list[tuple[int, str, float]] = field(default_factory=list)  # (step, why, loss or NaN)
    rollbacks: list[int] = field(default_factory=list)  # steps at which a rollback happened
    run_peak: dict[str, float] = field(default_factory=dict)  # the run record's peaks of rank 0 (after its last step)

    def series(self, key: str) -> Series:
        return self.train.get(key, Series())


def _outcome(rec: dict) -> str | None:
    """Why a train record's update was not applied (None when it was)."""
    for key in ("skipped", "outcome"):
        value = rec.get(key)
        if value not in APPLIED:
            return str(value)
    return None


def extract(records: list[dict], name: str = "run") -> RunData:
    """Train series per numeric key, eval loss, skipped steps and rollbacks, in step order."""
    kept: list[dict] = []
    last_train = -math.inf
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        if rec.get("kind") == "train":
            if step <= last_train:  # a rollback replays from an earlier step: the new records supersede
                kept = [r for r in kept if r.get("kind") not in ("train", "eval") or r["step"] < step]
            last_train = step
        kept.append(rec)
    data = RunData(name=name)
    for rec in kept:
        kind, step = rec.get("kind"), rec["step"]
        if kind == "train":
            for key, value in rec.items():
                if key not in ("kind", "step") and isinstance(value, (int, float, type(None))) and not isinstance(value, bool):
                    data.train.setdefault(key, Series()).add(step, value)
            why = _outcome(rec)
            if why is not None:
                data.skipped.append((step, why, _value(rec.get("loss"))))
                if why == "rollback" and step not in data.rollbacks:
                    data.rollbacks.append(step)
        elif kind == "eval" and "loss" in rec:
            data.eval_loss.add(step, rec["loss"])
        elif kind == "rollback" and step not in data.rollbacks:
            data.rollbacks.append(step)
        elif kind == "run" and rec.get("memory_peak"):
            data.run_peak = {
                k: float(v) for k, v in rec["memory_peak"][0].items() if k in RUN_PEAK_KEYS and math.isfinite(_value(v))
            }
    return data


def _decayed_sums(values: list[float], w: float) -> tuple[list[float], list[float]]:
    """For each i: sum over j <= i of w^(i-j) * v_j, and of w^(i-j) (non-finite values weigh 0)."""
    sums, weights, s, t = [], [], 0.0, 0.0
    for v in values:
        ok = math.isfinite(v)
        s, t = w * s + (v if ok else 0.0), w * t + (1.0 if ok else 0.0)
        sums.append(s)
        weights.append(t)
    return sums, weights


def smooth(values: list[float], span: float | None = None) -> list[float]:
    """Symmetric exponential smoothing (see the module docstring); NaN inputs are skipped, not averaged in."""
    n = sum(math.isfinite(v) for v in values)
    span = span if span is not None else min(50.0, max(1.0, n / 25))
    w = 1.0 - 1.0 / span
    fs, fw = _decayed_sums(values, w)  # j <= i
    bs, bw = (x[::-1] for x in _decayed_sums(values[::-1], w))  # j >= i
    out = []
    for i, v in enumerate(values):
        own = v if math.isfinite(v) else 0.0  # counted in both directions: take it out once
        total = fw[i] + bw[i] - (1.0 if math.isfinite(v) else 0.0)
        out.append((fs[i] + bs[i] - own) / total if total > 0 else math.nan)
    return out


def smooth_on(values: list[float], log: bool) -> list[float]:
    """``smooth`` on the axis the values are drawn on: on a log axis, of their logarithms (a geometric
    mean; an arithmetic one sits above a loss falling by decades, where the larger values dominate)."""
    if not log:
        return smooth(values)
    logs = [math.log(v) if math.isfinite(v) and v > 0 else math.nan for v in values]
    return [math.exp(v) if math.isfinite(v) else math.nan for v in smooth(logs)]


def _wide_range(values: list[float], decades: float = 1.0) -> bool:
    """Positive values spanning more than ``decades`` powers of ten: a log axis shows them better."""
    pos = [v for v in values if v > 0]
    return len(pos) == len([v for v in values if math.isfinite(v)]) and bool(pos) and max(pos) / min(pos) > 10**decades


# ----------------------------------------------------------------------------------- drawing
STEP_LABEL = "step (optimizer updates)"


def _figure(rows: int = 1):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 3.6 * rows), dpi=100, layout="constrained")
    axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, even in a 3-step run
    return fig, axes


def _save(fig, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def _loss(data: RunData, path: Path) -> Path:
    fig, (ax,) = _figure()
    train = data.series("loss")
    log = _wide_range(train.finite() + data.eval_loss.finite())
    if train:
        ax.plot(train.steps, train.values, color="tab:blue", alpha=0.3, linewidth=0.8, label="train (per step)")
        ax.plot(train.steps, smooth_on(train.values, log), color="tab:blue", linewidth=1.8, label="train (smoothed)")
    if data.eval_loss:
        ax.plot(data.eval_loss.steps, data.eval_loss.values, "o", color="tab:orange", markersize=6, label="eval")
    if log:
        ax.set_yscale("log")
    top = ax.get_xaxis_transform()  # x in steps, y in axes fraction: markers sit along the top edge
    if data.skipped:
        ax.plot(
            [s for s, _, _ in data.skipped], [0.97] * len(data.skipped), "x", color="tab:red", transform=top, label="skipped step"
        )
    for i, step in enumerate(data.rollbacks):
        ax.axvline(step, color="tab:red", linestyle="--", linewidth=1, label="rollback" if i == 0 else None)
    ax.set(title=f"{data.name}: loss", xlabel=STEP_LABEL, ylabel="cross-entropy (nats per loss token)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right")
    return _save(fig, path)


def _lr(data: RunData, path: Path) -> Path:
    fig, (ax,) = _figure()
    lr = data.series("lr")
    ax.plot(lr.steps, lr.values, color="tab:green")
    ax.set(title=f"{data.name}: learning rate", xlabel=STEP_LABEL, ylabel="learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def _grad_norm(data: RunData, path: Path) -> Path:
    fig, (ax,) = _figure()
    norm, limit = data.series("grad_norm"), data.series("clip_limit")
    ax.plot(norm.steps, norm.values, color="tab:purple", linewidth=0.8, label="gradient norm (before clipping)")
    if limit:
        ax.plot(limit.steps, limit.values, color="black", linestyle="--", linewidth=1.2, label="clip limit")
        over = [(s, v) for s, v, c in zip(norm.steps, norm.values, limit.values) if math.isfinite(c) and v > c]
        if over:
            ax.plot(*zip(*over), ".", color="tab:red", markersize=3, label=f"clipped ({len(over)} steps)")
    if _wide_range(norm.finite() + limit.finite(), decades=0.5):
        ax.set_yscale("log")
    ax.set(title=f"{data.name}: gradient norm", xlabel=STEP_LABEL, ylabel="global L2 norm")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best")
    return _save(fig, path)


def _throughput(data: RunData, path: Path) -> Path:
    fig, (top, bottom) = _figure(rows=2)
    tps, fill = data.series("tokens_per_s"), data.series("fill_rate")
    if tps:
        top.plot(tps.steps, tps.values, color="tab:cyan", alpha=0.35, linewidth=0.8, label="per step")
        top.plot(tps.steps, smooth(tps.values), color="tab:blue", linewidth=1.6, label="smoothed")
        top.legend(loc="lower right")
    top.set(title=f"{data.name}: throughput", ylabel="real tokens / s")
    top.set_ylim(bottom=0)
    bottom.plot(fill.steps, fill.values, color="tab:olive", linewidth=0.8)
    bottom.set(xlabel=STEP_LABEL, ylabel="fill rate (real / slot tokens)", ylim=(0, 1.02))
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    return _save(fig, path)


def _memory(data: RunData, path: Path) -> Path:
    fig, (ax,) = _figure()
    for key, label in MEMORY_KEYS.items():
        if s := data.series(key):
            ax.plot(s.steps, s.values, label=label)
    for key, gb in data.run_peak.items():  # the summary's figure: it also counts what came after the last step
        ax.axhline(gb, color="black", linestyle="--", linewidth=1, label=f"{RUN_PEAK_KEYS[key]}: {gb:.2f} GB")
    ax.set(title=f"{data.name}: memory", xlabel=STEP_LABEL, ylabel="GB")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def _step_time(data: RunData, path: Path) -> Path:
    fig, (ax,) = _figure()
    parts = [(k, data.series(k)) for k in TIME_KEYS if data.series(k)]
    steps = sorted({s for _, series in parts for s in series.steps})  # a key missing from a record counts 0 there
    ys = []
    for _, series in parts:
        by_step = dict(zip(series.steps, series.values))
        ys.append([v if math.isfinite(v) else 0.0 for v in smooth([by_step.get(s, math.nan) for s in steps])])
    ax.stackplot(steps, ys, labels=[TIME_KEYS[k] for k, _ in parts], alpha=0.8)
    if total := data.series("step_s"):
        ax.plot(total.steps, smooth(total.values), color="black", linewidth=1, label="whole step")
    ax.set(title=f"{data.name}: time per step (smoothed)", xlabel=STEP_LABEL, ylabel="seconds")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right")
    return _save(fig, path)


def plot_lr_finder(result, path: Path, others: tuple[str, ...]) -> Path:
    """The range test (an ``LRFinderResult``): the train loss per step and smoothed, the held-out loss
    when measured, against the rate (log axis); the suggestion and the ``others`` rules' rates marked."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.2), dpi=100, layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(result.lrs, result.losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss (per step)")
    ax.plot(result.lrs, result.smoothed, color="tab:blue", linewidth=1.8, label="train loss (smoothed)")
    held = result.heldout_losses
    if held:
        ax.plot(result.lrs[: len(held)], held, color="tab:orange", linewidth=1.4, label="held-out loss (after each step)")
    ax.axvline(result.suggested_lr, color="tab:red", linestyle="--", label=f"suggested {result.suggested_lr:.2g} ({result.used})")
    styles = {"fall": (0, (5, 2, 1, 2)), "steepest": (0, (5, 2, 1, 2)), "min/10": ":", "valley": "-."}
    for name in (k for k in others if k in result.candidates):
        rate = result.candidates[name]
        ax.axvline(rate, color="gray", linestyle=styles.get(name, ":"), linewidth=1, label=f"{name} {rate:.2g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("loss")
    finite = [v for v in result.smoothed + result.losses + held if math.isfinite(v)]
    if finite:  # the blow-up at the end would squash the curve: show up to a little above the start,
        # and above the losses at the suggestion (near its task the climb begins there)
        at = int(np.argmin(np.abs(np.log(np.asarray(result.lrs) / result.suggested_lr))))
        near = [v for v in (result.smoothed[at], held[at] if at < len(held) else math.nan) if math.isfinite(v)]
        top = max([result.smoothed[0], min(finite), *near]) * 1.3
        ax.set_ylim(min(finite) * 0.9, top)
    ax.set_title("learning-rate range test")
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, path)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'densebatch[plot]'") from None


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the PNGs for ``run_dir/metrics.jsonl`` into ``run_dir/plots/``; returns their paths
    (empty when the file holds no plottable record)."""
    _require_matplotlib()
    run_dir = Path(run_dir)
    data = extract(read_metrics(run_dir / METRICS_FILE), name=run_dir.resolve().name)
    out = run_dir / PLOTS_DIR
    drawn = []
    todo = [
        ("loss", bool(data.series("loss") or data.eval_loss), _loss),
        ("lr", bool(data.series("lr")), _lr),
        ("grad_norm", bool(data.series("grad_norm")), _grad_norm),
        ("throughput", bool(data.series("tokens_per_s") or data.series("fill_rate")), _throughput),
        ("memory", any(data.series(k) for k in MEMORY_KEYS), _memory),
        ("step_time", any(data.series(k) for k in TIME_KEYS), _step_time),
    ]
    for name, has_data, draw in todo:
        if has_data:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a file of that name, no permission
                raise UserError(f"{out}: the plots cannot be written there ({e.strerror or e})") from None
            drawn.append(draw(data, out / f"{name}.png"))
    return drawn
