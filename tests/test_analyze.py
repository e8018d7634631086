"""`densebatch analyze` logic: table, JSON, plan dump (every document once, budgets held), plot, inputs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from densebatch.analyze import analyze_main, read_lengths
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.strategies import STRATEGIES
from densebatch.errors import UserError

LENGTHS = np.random.default_rng(0).lognormal(np.log(200), 1.0, 800).astype(np.int64).clip(1, 3000)
S = PlanSettings(seq_len=1024, max_tokens_per_batch=4096, rows_per_batch=8)


def test_table_has_one_row_per_strategy():
    out = analyze_main(LENGTHS, settings=S)
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["strategy", "fill"]
    assert [line.split()[0] for line in lines[1:5]] == list(STRATEGIES)


def test_json_keyed_by_strategy():
    res = json.loads(analyze_main(LENGTHS, settings=S, json_out=True))
    assert set(res) == set(STRATEGIES)
    for r in res.values():
        assert {"fill_rate", "batches", "mean_real_tokens", "max_real_tokens", "max_slots", "plan_seconds"} <= set(r)
    assert res["packed"]["max_slots"] <= 4096 and res["token_budget"]["max_slots"] <= 4096
    assert res["packed"]["fill_rate"] > 0.98


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dump_plan_places_every_document_once(tmp_path, strategy, capsys):
    """Exactly once: a document appears once per piece, and its pieces tile it (the plan behind the
    dump is checked piece by piece), so a duplicated or lost piece fails; no batch over its budget."""
    f = tmp_path / "plan.json"
    out = analyze_main(LENGTHS, settings=S, dump_plan=f, strategy=strategy)
    assert f"wrote {f}: the {strategy} plan" in out  # says where it wrote
    batches = json.loads(f.read_text())
    plan = plan_epoch(LENGTHS, settings=dataclasses.replace(S, strategy=strategy), seed=0, epoch=0)
    assert batches == plan.doc_lists()
    docs = np.array([d for b in batches for row in b for d in row])
    cap = S.seq_len if strategy == "packed" else S.max_tokens_per_batch  # token_budget: a row holds one batch at most
    pieces_per_doc = -(-LENGTHS // cap) if strategy in ("packed", "token_budget") else np.ones(len(LENGTHS), np.int64)
    assert np.array_equal(np.bincount(docs, minlength=len(LENGTHS)), pieces_per_doc)
    if strategy == "packed":
        assert pieces_per_doc.max() > 1, "the lengths must exercise splitting"
    order = np.lexsort((plan.start, plan.doc))  # the pieces of each document, in order, tile it
    d, a, b = plan.doc[order], plan.start[order], plan.stop[order]
    first = np.r_[True, d[1:] != d[:-1]]
    last = np.r_[d[1:] != d[:-1], True]
    assert (a[first] == 0).all() and (a[~first] == b[:-1][~first[1:]]).all() and (b[last] == LENGTHS).all()
    if strategy == "packed":
        assert all(1 <= len(b) <= 4 for b in batches)
    if strategy == "token_budget":
        assert all(len(b) * max(LENGTHS[r[0]] for r in b) <= 4096 for b in batches)


def test_json_output_stays_json_and_names_written_files_on_stderr(tmp_path, capsys):
    f = tmp_path / "p.json"
    out = analyze_main(LENGTHS, settings=S, json_out=True, dump_plan=f, strategy="packed")
    assert set(json.loads(out)) == set(STRATEGIES)
    assert f"wrote {f}: the packed plan" in capsys.readouterr().err


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    f = tmp_path / "h.png"
    out = analyze_main(LENGTHS, settings=S, plot=f, strategies=["packed", "random"])
    assert f.read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {f}: histogram" in out
    bare = tmp_path / "hist"  # no suffix: the file named is the file written (matplotlib wrote hist.png)
    assert f"wrote {bare}: histogram" in analyze_main(LENGTHS, settings=S, plot=bare, strategies=["packed"])
    assert bare.read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "hist.png").exists()


@pytest.mark.parametrize("where", ["a_directory", "missing/parent.json"])
def test_an_output_that_cannot_be_written_is_one_line(tmp_path, where):
    (tmp_path / "a_directory").mkdir()
    with pytest.raises(UserError, match=r"--dump-plan .*: cannot be written"):
        analyze_main(LENGTHS, settings=S, dump_plan=tmp_path / where, strategy="packed")


def test_read_lengths_text_and_npy(tmp_path):
    t = tmp_path / "l.txt"
    t.write_text("3\n\n17\n 5 \n")
    assert read_lengths(t).tolist() == [3, 17, 5]
    n = tmp_path / "l.npy"
    np.save(n, np.array([4, 9], np.int32))
    assert read_lengths(n).tolist() == [4, 9]
    t.write_text("3\nabc\n")
    with pytest.raises(UserError, match=r"l.txt:2: expected one integer"):
        read_lengths(t)
    t.write_bytes(b"3\n\xff\xfe\n")  # not UTF-8: the line is named, no UnicodeDecodeError
    with pytest.raises(UserError, match=r"l.txt:2: expected one integer"):
        read_lengths(t)
    t.write_text("3\n0\n")
    with pytest.raises(UserError, match="positive"):
        read_lengths(t)
    with pytest.raises(UserError, match="not found"):
        read_lengths(tmp_path / "nope.txt")
    with pytest.raises(UserError, match="strategy"):
        analyze_main(LENGTHS, settings=S, strategies=["fast"])


def test_strategy_limits_the_output_to_that_strategy(tmp_path, capsys):
    """`densebatch analyze --strategy S --json`: S alone, as the README's command shows (it printed all four)."""
    from densebatch.cli import main

    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(map(str, LENGTHS)))
    assert main(["analyze", "--lengths", str(f), "--json", "--strategy", "packed", f"--dump-plan={tmp_path / 'p.json'}"]) == 0
    assert list(json.loads(capsys.readouterr().out)) == ["packed"]
    assert main(["analyze", "--lengths", str(f), "--strategy", "random"]) == 0
    rows = capsys.readouterr().out.splitlines()
    table = [r.split()[0] for r in rows if r and r.split()[0] in (*STRATEGIES, "strategy")]
    assert table == ["strategy", "random"], rows
