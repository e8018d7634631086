"""`densebatch analyze`: compare the batching strategies on a set of document lengths.

``analyze_main`` plans one epoch with each strategy and returns a table (or JSON) of fill rate,
batches, mean / max real tokens per batch, max token slots per batch and planning seconds; it can
also write one strategy's plan as JSON and a PNG histogram of the lengths. ``read_lengths`` reads a
lengths file (one integer per line, or ``.npy``). The CLI parses arguments and prints the result.
For prepared documents (``analyze_prepared``), each strategy also reports, per source, the records,
documents and tokens prepared and the documents, tokens and share of the tokens its epoch-0 plan
holds (a mixture's weights applied: ``data/plan/store_epochs.py``), and (text) what each source's loss tokens
weigh in random batches (``data/plan/source_balance.py``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from densebatch.data.plan.homogeneity import homogeneity
from densebatch.data.plan.mixture import Selection, plan_source_stats
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.shards import plan_epoch_sharded
from densebatch.data.plan.source_balance import balance_line, batch_balance
from densebatch.data.plan.store_epochs import materialise, select
from densebatch.data.plan.strategies import STRATEGIES
from densebatch.errors import ConfigError, DataError, UserError


def read_lengths(path: str | Path) -> np.ndarray:
    """Document lengths from ``.npy`` or text with one positive integer per line (blank lines skipped)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"lengths file '{path}' not found")
    if p.suffix == ".npy":
        try:
            x = np.load(p, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataError(f"{path}: not a readable .npy array ({e})") from None
        if x.ndim != 1 or not np.issubdtype(x.dtype, np.integer):
            raise DataError(f"{path}: expected a one-dimensional integer array; got {x.dtype} with shape {x.shape}")
        x = x.astype(np.int64, copy=False)  # an int64 file is used as loaded: no second copy of every length
        if len(x) and x.min() < 1:
            raise DataError(f"{path}: entry {int(np.argmin(x))} is {int(x.min())}; lengths must be positive")
        return x
    try:  # fast path: 10M lines in ~2 s; the loop below only runs to name a bad line
        x = np.array(p.read_bytes().split()).astype(np.int64)
        if not len(x) or x.min() >= 1:
            return x
    except ValueError:
        pass
    out = []
    with p.open(encoding="utf-8", errors="replace") as f:  # a byte that is not UTF-8 shows as a bad line
        for line_no, line in enumerate(f, 1):
            s = line.strip()
            if not s:
                continue
            try:
                v = int(s)
            except ValueError:
                raise DataError(f"{path}:{line_no}: expected one integer per line; got {s[:40]!r}") from None
            if v < 1:
                raise DataError(f"{path}:{line_no}: lengths must be positive; got {v}")
            out.append(v)
    return np.array(out, np.int64)


def analyze(
    lengths: np.ndarray,
    *,
    settings: PlanSettings,
    strategies=tuple(STRATEGIES),
    seed: int = 0,
    selection: Selection | None = None,
    source_facts: list[dict] | None = None,
) -> dict[str, dict]:
    """{strategy: stats} for one epoch of each strategy (see ``Plan.stats``), with ``plan_seconds``; with a
    ``selection`` (a store's epoch 0), ``sources``: {name: prepared facts + the plan's documents, tokens, share}."""
    results = {}
    for name in strategies:
        if name not in STRATEGIES:
            raise ConfigError(f"--strategy: expected one of {', '.join(STRATEGIES)}; got {name!r}")
        s = dataclasses.replace(settings, strategy=name)
        t0 = time.perf_counter()
        plan = plan_epoch_sharded(
            lengths, settings=s, seed=seed, epoch=0, selection=selection
        )  # bounded memory: shard by shard past shard_docs
        stats = plan.stats()
        stats["plan_seconds"] = time.perf_counter() - t0
        many = selection is not None and selection.num_sources > 1
        stats["homogeneity"] = homogeneity(  # on the first shard (a sample of the epoch): no second planning pass
            plan,
            lengths=lengths,
            source_of=selection.source_of if many else None,
            num_sources=selection.num_sources if many else 1,
            max_shards=1,
        )
        if selection is not None:
            facts = {x["name"]: x for x in source_facts or []}
            stats["sources"] = {
                name: {
                    **_prepared(facts.get(name)),
                    "planned_documents": x["documents"],
                    "planned_tokens": x["tokens"],
                    "share": x["share"],
                }
                for name, x in plan_source_stats(plan, selection).items()
            }
        results[name] = stats
        del plan  # before the next strategy plans: two plans' indexes and cached shards never coexist
    return results


def _prepared(facts: dict | None) -> dict:
    keys = ("records_read", "documents", "tokens")
    return {k: facts[k] for k in keys if k in facts} if facts else {}


def format_table(results: dict[str, dict]) -> str:
    head = ("strategy", "fill", "batches", "mean real/batch", "max real/batch", "max slots/batch", "alike", "plan s")
    rows = [
        (
            k,
            f"{r['fill_rate']:.4f}",
            str(r["batches"]),
            f"{r['mean_real_tokens']:.1f}",
            str(r["max_real_tokens"]),
            str(r["max_slots"]),
            _alike(r.get("homogeneity")),
            f"{r['plan_seconds']:.3f}",
        )
        for k, r in results.items()
    ]
    w = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    line = lambda x: "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(x))
    notes = [
        f"{k}: {r['split']} split, {r['truncated']} truncated, {r['dropped']} dropped"
        for k, r in results.items()
        if r["split"] or r["truncated"] or r["dropped"]
    ]
    notes += [
        f"{k}: token share " + ", ".join(f"{n} {x['share']:.4f}" for n, x in r["sources"].items())
        for k, r in results.items()
        if len(r.get("sources") or ()) > 1
    ]
    notes.append(
        "alike: how much more alike a batch's documents are than a random sample of the epoch, in length "
        "(and source, with several), on the first shard of a sharded plan: 0 = as random, 1 = all alike "
        "(data/plan/homogeneity.py); length-sorted "
        "batches teach one task or source at a time"
    )
    return "\n".join([line(head), *map(line, rows), *notes])


def _alike(h: dict | None) -> str:
    if not h or h.get("length") is None:
        return "-"
    return f"{max(0.0, h['length']):.2f}" + ("" if h.get("source") is None else f"/{max(0.0, h['source']):.2f}")


def write_plot(lengths: np.ndarray, results: dict[str, dict], path: str | Path, settings: PlanSettings) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.hist(lengths, bins=min(100, max(10, len(np.unique(lengths)))), color="#4c72b0")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(f"{len(lengths):,} documents, {int(lengths.sum()):,} tokens")
    text = "\n".join(f"{k}: fill {r['fill_rate']:.3f}, {r['batches']} batches" for k, r in results.items())
    text += f"\nseq_len {settings.seq_len}, max_tokens_per_batch {settings.max_tokens_per_batch}, rows_per_batch {settings.rows_per_batch}"
    ax.text(
        0.98,
        0.95,
        text,
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=8,
        bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "#999"},
    )
    fig.tight_layout()
    with _written(path, "--plot") as f:
        fig.savefig(f, dpi=120, format="png")  # the file named, whatever its suffix (not PATH.png)
    plt.close(fig)


def _written(path: str | Path, option: str):
    """``path`` opened for writing, or one line saying why it cannot be (a directory, a missing parent)."""
    try:
        return open(path, "wb")  # noqa: SIM115  (the caller's with closes it)
    except OSError as e:
        raise UserError(f"{option} {path}: cannot be written ({e.strerror or e})") from None


def analyze_main(
    lengths: np.ndarray,
    *,
    settings: PlanSettings,
    strategies=tuple(STRATEGIES),
    json_out: bool = False,
    dump_plan: str | Path | None = None,
    strategy: str | None = None,
    plot: str | Path | None = None,
    seed: int = 0,
    selection: Selection | None = None,
    source_facts: list[dict] | None = None,
) -> str:
    """Run the analysis; return the text to print (table, or one JSON object keyed by strategy).

    ``dump_plan``: write the plan of ``strategy`` (default ``settings.strategy``) as JSON: a list of
    batches, each a list of rows, each a list of 0-based document indices (a split document appears
    once per piece). ``plot``: write a PNG histogram of lengths with each strategy's fill rate.
    Each file written is named in a line after the table ("wrote plan.json: ..."); with ``json_out``
    those lines go to stderr, so that stdout stays one JSON object.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        raise DataError("no document lengths to analyze")
    strategies = list(strategies or STRATEGIES)
    results = analyze(
        lengths, settings=settings, strategies=strategies, seed=seed, selection=selection, source_facts=source_facts
    )
    wrote: list[str] = []
    if dump_plan is not None:
        name = strategy or settings.strategy
        if name not in STRATEGIES:
            raise ConfigError(f"--strategy: expected one of {', '.join(STRATEGIES)}; got {name!r}")
        s = dataclasses.replace(settings, strategy=name)
        plan = (
            plan_epoch(lengths, settings=s, seed=seed, epoch=0)
            if selection is None
            else materialise(plan_epoch_sharded(lengths, settings=s, seed=seed, epoch=0, selection=selection))
        )
        with _written(dump_plan, "--dump-plan") as f:
            f.write(json.dumps(plan.doc_lists(), separators=(",", ":")).encode("utf-8"))
        wrote.append(f"wrote {dump_plan}: the {name} plan, {plan.num_batches} batches → rows → document indices")
    if plot is not None:
        write_plot(lengths, results, plot, settings)
        wrote.append(f"wrote {plot}: histogram of {len(lengths)} document lengths with each strategy's fill rate")
    if json_out:
        for line in wrote:
            print(line, file=sys.stderr)
        return json.dumps(results, indent=2)
    return "\n".join([format_table(results), *wrote])


def analyze_prepared(prepared, settings: PlanSettings, seed: int = 0, **kw) -> str:
    """``analyze_main`` on prepared documents (``prepare``'s result), reporting per source: what was
    prepared and what epoch 0's plan of each strategy holds with the run's weights."""
    lengths = np.asarray(prepared.train.lengths, dtype=np.int64)
    selection = select(prepared.train, weights=prepared.weights, seed=seed, epoch=0, lengths=lengths)
    text = analyze_main(lengths, settings=settings, seed=seed, selection=selection, source_facts=prepared.summary.sources, **kw)
    factors = (
        None
        if kw.get("json_out")
        else batch_balance(prepared.train, weights=prepared.weights, seed=seed, rows=settings.rows_per_batch, selection=selection)
    )
    if factors is None:
        return text
    return text + (
        f"\nrandom batches of {settings.rows_per_batch} documents weigh each source's loss tokens "
        f"{balance_line(prepared.train.source_names, factors)} (x its share of them); packed and token_budget runs "
        "weigh them so too under train.source_balance: batches (the default), alike under tokens"
    )
