"""Mixtures from the command line: data.sources in a config, per-source reports from prepare and
analyze --json, overrides of one source's keys, and one-line errors for bad mixtures."""

from __future__ import annotations

import json

import pytest

from densebatch.cli import main
from densebatch.config import load_config
from densebatch.errors import ConfigError


@pytest.fixture
def mixture(tmp_path):
    """Two raw-text sources of equal size (200 documents of 20..120 characters each) and a config mixing them 3:1."""
    for name, letter in (("web", "w"), ("code", "c")):
        lines = [json.dumps({"text": letter * (20 + (7 * i) % 100)}) for i in range(200)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(
        f"""data:
  template: raw
  eval_fraction: 0
  cache_dir: {tmp_path / "cache"}
  sources:
    - path: {tmp_path / "web.jsonl"}
      weight: 3
    - path: {tmp_path / "code.jsonl"}
      name: code-v2
      weight: 1
batching:
  seq_len: 256
  max_tokens_per_batch: 1024
""",
        encoding="utf-8",
    )
    return cfg


def test_prepare_reports_each_source(mixture, capsys):
    assert main(["prepare", str(mixture)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["web"], ["code-v2"])}
    assert rows["web"][1:4] == ["200", "200", str(sum(21 + (7 * i) % 100 for i in range(200)))]  # records, documents, tokens
    assert abs(float(rows["web"][4]) - 0.75) <= 0.02 and abs(float(rows["code-v2"][4]) - 0.25) <= 0.02


def test_analyze_json_reports_each_sources_share_of_every_strategys_plan(mixture, capsys):
    assert main(["analyze", str(mixture), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    for strategy, r in results.items():
        src = r["sources"]
        assert set(src) == {"web", "code-v2"}, strategy
        assert src["web"]["records_read"] == src["code-v2"]["records_read"] == 200
        assert src["web"]["documents"] == 200 and src["web"]["tokens"] == src["code-v2"]["tokens"]
        assert abs(src["web"]["share"] - 0.75) <= 0.02 and abs(src["code-v2"]["share"] - 0.25) <= 0.02, strategy
        assert src["web"]["planned_documents"] > 200 > src["code-v2"]["planned_documents"]  # up- and down-sampled
    # the weights are the configuration's, not the prepared data's: a new weight re-plans, prepares nothing
    assert main(["analyze", str(mixture), "--json", "--data.sources.1.weight=3"]) == 0
    even = json.loads(capsys.readouterr().out)["packed"]["sources"]
    assert abs(even["web"]["share"] - 0.5) <= 0.02


def test_overrides_reach_one_source_and_errors_name_the_key(mixture, capsys):
    cfg = load_config(mixture, ["--data.sources.0.weight=5", "--data.sources.1.template=chatml"])
    assert [s.weight for s in cfg.data.sources] == [5.0, 1.0] and cfg.data.sources[1].template == "chatml"
    bad = {
        "--data.sources.2.weight=1": "not an index of 'sources'",
        "--data.sources.0.weight=-1": "data.sources[0].weight: expected a value >= 0",
        "--data.sources.1.weight=null": "data.sources[1].weight: set a weight on every source, or on none",
        "--data.sources.1.name=web": "data.sources[1].name: 'web' already names data.sources[0]",
        "--data.sources.0.fields.outptu=x": "unknown key 'data.sources[0].fields.outptu'",
        "--data.path=x.jsonl": "data.path: unset it when data.sources is set",
        "--data.sources.1.template=custom": "data.sources[1].prompt_format: required",
    }
    for arg, message in bad.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(mixture, [arg])
        assert main(["prepare", str(mixture), arg]) == 2
        err = capsys.readouterr().err
        assert message.split(":")[0] in err and "Traceback" not in err and err.count("\n") == 1, arg


def test_training_records_the_loss_of_each_source_and_their_token_weighted_mean_is_the_loss(mixture, tmp_path, capsys):
    """The issue's check: weights 3 and 1, metrics.jsonl has loss_by_source with both names; the mean of the
    per-source losses weighted by their loss tokens equals the step's loss (1e-6); eval reports per source."""
    out = tmp_path / "run"
    args = ["train", str(mixture), f"--output_dir={out}", "--train.max_steps=3", "--train.progress=false"]
    args += ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=256", "--data.eval_fraction=0.1"]
    assert main(args) == 0
    assert "source web" in capsys.readouterr().out  # the console summary shows eval per source
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 3
    for r in train:
        losses, shares = r["loss_by_source"], r["loss_tokens_share_by_source"]
        assert set(losses) == set(shares) == {"web", "code-v2"}
        assert sum(shares.values()) == pytest.approx(1.0)
        mean = sum(losses[n] * shares[n] for n in losses if losses[n] is not None)
        assert mean == pytest.approx(r["loss"], rel=1e-6)
    ev = [r for r in records if r["kind"] == "eval"][-1]
    assert set(ev["loss_by_source"]) == {"web", "code-v2"}
    weighted = sum(ev["loss_by_source"][n] * ev["tokens_by_source"][n] for n in ev["loss_by_source"]) / ev["tokens"]
    assert weighted == pytest.approx(ev["loss"], rel=1e-6)


def test_packed_runs_weigh_a_source_of_short_documents_as_random_batches_do(tmp_path, capsys):
    """train.source_balance (default batches): a packed run says each source's weight, the short source's
    above 1; tokens, and random batches (which weigh sources so themselves), say none."""
    for name, n, size in (("short", 300, 6), ("long", 60, 200)):
        lines = [json.dumps({"text": "ab" * (size // 2 + i % 3)}) for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    sources = json.dumps([{"path": str(tmp_path / f"{n}.jsonl")} for n in ("short", "long")])
    base = ["train", f"--data.sources={sources}", "--data.template=raw", "--data.eval_fraction=0", "--train.max_steps=2"]
    base += ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=256", "--batching.seq_len=256"]
    base += ["--batching.max_tokens_per_batch=1024", "--train.progress=false", "--train.plots=false"]
    base += [f"--data.cache_dir={tmp_path / 'cache'}"]

    def said(*extra) -> str | None:
        assert main([*base, f"--output_dir={tmp_path / str(len(extra))}", "--overwrite", *extra]) == 0
        lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("train.source_balance")]
        return lines[0] if lines else None

    line = said()
    weights = dict(part.rsplit(" ", 1) for part in line.rsplit(": ", 1)[1].split(", "))
    assert float(weights["short"]) > 1.5 > 1.0 > float(weights["long"])
    assert said("--train.source_balance=tokens") is None
    assert said("--batching.strategy=random", "--batching.rows_per_batch=4") is None
    # analyze says what random batches give each source, as the run does
    assert main(["analyze", *base[1:5], f"--data.cache_dir={tmp_path / 'cache'}", "--batching.seq_len=256"]) == 0
    said_by_analyze = [x for x in capsys.readouterr().out.splitlines() if x.startswith("random batches of 8 documents")]
    assert said_by_analyze and f"short {float(weights['short']):.2f}" in said_by_analyze[0]
