"""Your own pre-tokenised data without a config file (issue 8, item 5): ``densebatch train
--data.path=docs.jsonl --model.kind=hf --model.path=DIR`` trains, with the model directory's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from densebatch.cli import main

TEXTS = [f"the {w} sat on the mat and the {w} ate the {v} today" for w in ("cat", "dog", "fox", "owl") for v in "abcdefghij"]


def tiny_hf_model_with_tokenizer(d: Path) -> tuple[int, object]:
    """A random 1-layer GPT-2 in ``d`` with a learned 300-id BPE beside it (tokenizer.json +
    tokenizer_config.json, as a Hugging Face model directory holds them). Returns (vocab, tokenizer)."""
    transformers = pytest.importorskip("transformers")
    from densebatch.data.prepare.learned_bpe import train_bpe

    tok = train_bpe(TEXTS, vocab_size=300)
    d.mkdir(parents=True)
    tok._tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    cfg = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_positions=1024,
        vocab_size=tok.vocab_size,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
    )
    cfg.save_pretrained(d)
    return tok.vocab_size, tok


def write_pretokenized(path: Path, tok) -> list[list[int]]:
    ids = [tok.encode(t) + [tok.eos_id] for t in TEXTS]
    assert max(max(x) for x in ids) >= 259, "ids the byte-level default cannot hold: proves which tokenizer was used"
    path.write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in ids), encoding="utf-8")
    return ids


def _run(tmp_path, monkeypatch, capsys, extra: list[str]) -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)  # runs/ and .densebatch-cache/ go here, as for a user in their own directory
    _, tok = tiny_hf_model_with_tokenizer(tmp_path / "model")
    write_pretokenized(tmp_path / "docs.jsonl", tok)
    rc = main(["train", "--data.path=docs.jsonl", "--model.kind=hf", "--model.path=model", "--train.max_steps=2", *extra])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.slow
def test_pretokenized_data_and_hf_model_with_the_tokenizer_named(tmp_path, monkeypatch, capsys):
    rc, out = _run(tmp_path, monkeypatch, capsys, ["--data.tokenizer=model"])
    assert rc == 0, out
    assert "Traceback" not in out and "bpe:1024" not in out  # no demo setting leaks into one's own data
    steps = [json.loads(x) for x in (tmp_path / "runs/default/metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in steps) == 2
    assert (tmp_path / "runs/default/final/tokenizer.json").is_file()


@pytest.mark.slow
def test_pretokenized_data_and_hf_model_without_a_config_file(tmp_path, monkeypatch, capsys):
    """The issue's command as written: data.tokenizer defaults to auto = the model directory's tokenizer."""
    rc, out = _run(tmp_path, monkeypatch, capsys, [])
    assert rc == 0, out
    assert "Traceback" not in out and "bpe:1024" not in out
    steps = [json.loads(x) for x in (tmp_path / "runs/default/metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in steps) == 2


def test_ids_of_another_tokenizer_are_one_line_naming_data_tokenizer(tmp_path, monkeypatch, capsys):
    """The same data read with the byte-level default: exit 2, one line, says what to set."""
    monkeypatch.chdir(tmp_path)
    _, tok = tiny_hf_model_with_tokenizer(tmp_path / "model")
    write_pretokenized(tmp_path / "docs.jsonl", tok)
    rc = main(["prepare", "--data.path=docs.jsonl", "--data.tokenizer=default"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "data.tokenizer 'default'" in err and "set data.tokenizer" in err
