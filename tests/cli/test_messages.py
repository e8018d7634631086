"""What a user reads: one exact line for a data file that holds nothing or lacks the template's columns,
Hugging Face commands without transformers' progress bars or peft's FutureWarning, the LoRA parameter
count and the added tokens' ids as the lines a run prints.

Data mistakes run ``densebatch.cli.main`` in process (``prepare``, the first thing ``train`` does too):
exit code 2, exactly one line on stderr, no traceback.
"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest
from support import BIN, subprocess_env

from densebatch.cli import main

ALPACA_READS = "template alpaca reads instruction, output and, if present, input"


def refused(capsys, tmp_path: Path, data: Path, *extra: str) -> str:
    """The one line ``densebatch prepare`` prints for ``data`` (after asserting exit code 2, nothing else)."""
    capsys.readouterr()
    assert main(["prepare", f"--data.path={data}", f"--data.cache_dir={tmp_path / 'cache'}", *extra]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("densebatch: error: "), err
    return err.removeprefix("densebatch: error: ").rstrip("\n")


@pytest.mark.parametrize("text", ["[]", " [ ]\n"])
def test_an_empty_json_array_holds_no_records(capsys, tmp_path, text):
    p = tmp_path / "data.json"
    p.write_text(text)
    assert refused(capsys, tmp_path, p) == f"{p}: holds no records (an empty JSON array)"


def test_an_empty_or_blank_file_says_so(capsys, tmp_path):
    for name, content in [("a.jsonl", ""), ("b.jsonl", "\n  \n"), ("c.txt", " \n"), ("d.csv", "  \n\n  ")]:
        p = tmp_path / name
        p.write_text(content)
        why = "the file is empty" if not content else "holds no records (the file is empty or only whitespace)"
        assert refused(capsys, tmp_path, p) == f"{p}: {why}"


def test_a_csv_header_without_rows_names_its_columns(capsys, tmp_path):
    p = tmp_path / "data.csv"
    p.write_text("instruction,input,output\n\n")
    assert (
        refused(capsys, tmp_path, p) == f"{p}: holds no records (a header with columns instruction, input, output, and no rows)"
    )


@pytest.mark.parametrize("extra", [[], ["--data.on_bad_record=skip"]])
def test_a_csv_with_the_wrong_columns_says_which_it_found_and_which_are_expected(capsys, tmp_path, extra):
    p = tmp_path / "data.csv"
    p.write_text("question,answer\nWhy?,Because.\nHow?,So.\n")
    assert refused(capsys, tmp_path, p, *extra) == (
        f"{p}: missing columns 'instruction', 'output' (found columns: question, answer; {ALPACA_READS}): "
        "rename the columns or map yours with --data.fields.instruction=COLUMN --data.fields.output=COLUMN"
    )
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing prepared


def test_a_csv_missing_one_column_and_a_custom_template(capsys, tmp_path):
    p = tmp_path / "data.csv"
    p.write_text("instruction,answer\nWhy?,Because.\n")
    assert refused(capsys, tmp_path, p) == (
        f"{p}: missing column 'output' (found columns: instruction, answer; {ALPACA_READS}): "
        "rename the columns or map yours with --data.fields.output=COLUMN"
    )
    custom = ["--data.template=custom", "--data.prompt_format=Q: {question} ({level})\nA: "]
    assert refused(capsys, tmp_path, p, *custom) == (
        f"{p}: missing columns 'question', 'level', 'output' (found columns: instruction, answer; template custom "
        "reads question, level, output): rename the columns or map yours with --data.fields.output=COLUMN, "
        "or name yours in data.prompt_format"
    )


def test_a_json_record_with_the_wrong_fields_names_them(capsys, tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_text(json.dumps({"instruction": "Why?", "answer": "Because."}) + "\n")
    assert refused(capsys, tmp_path, p) == (
        f"{p}:1: missing field 'output' (found fields: instruction, answer; {ALPACA_READS}): "
        "map yours with --data.fields.output=FIELD (set data.on_bad_record: skip to count and skip such records)"
    )
    # skipped, every record: the line that stops the run says why they went
    line = refused(capsys, tmp_path, p, "--data.on_bad_record=skip")
    assert line.startswith(f"{p}: no usable training documents remain (1 read, 1 skipped as malformed, ")
    assert line.endswith(f"; most skipped as missing_field, first {p}:1: missing field 'output' (found fields: "
                         f"instruction, answer; {ALPACA_READS}): map yours with --data.fields.output=FIELD)")  # fmt: skip


def test_an_empty_parquet_file_names_its_columns(capsys, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "data.parquet"
    pq.write_table(pa.table({"instruction": pa.array([], pa.string()), "output": pa.array([], pa.string())}), p)
    assert refused(capsys, tmp_path, p) == f"{p}: holds no records (a Parquet file with columns instruction, output and no rows)"


# ------------------------------------------------------------------------------- tokens added
def test_added_tokens_are_printed_with_their_ids():
    from densebatch.data.prepare.tokenizers import load_tokenizer
    from densebatch.data.prepare.vocab import added_tokens_line

    tok = load_tokenizer("default", added=[("<|im_start|>", True), ("<|im_end|>", True), ("two words", False)])
    assert added_tokens_line(tok.added) == "added tokens: <|im_start|>=259, <|im_end|>=260, 'two words'=261"
    assert added_tokens_line(load_tokenizer("default").added) is None
    many = load_tokenizer("default", added=[(f"<t{i}>", False) for i in range(25)])
    assert added_tokens_line(many.added, limit=2) == "added tokens: <t0>=259, <t1>=260, ... and 23 more"


# ------------------------------------------------------------------------------ Hugging Face
@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A tiny Llama with weights, the byte tokenizer's 259 ids."""
    transformers = pytest.importorskip("transformers")
    import torch

    from densebatch.testing.models import tiny_config

    root = tmp_path_factory.mktemp("quiet")
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=259, tie_word_embeddings=False, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "base")
    return root / "base"


def _noise(text: str) -> list[str]:
    """What transformers / peft print that is not the user's business."""
    return [
        w for w in ("Loading weights", "Writing model shards", "it/s]", "FutureWarning", "is_gradient_checkpointing") if w in text
    ]


def test_loading_and_saving_a_hf_model_prints_nothing(hf_base, tmp_path, capfd):
    pytest.importorskip("peft")
    import transformers
    from transformers.utils import logging as hf_logging

    from densebatch.config import LoraConfig, ModelConfig
    from densebatch.model import build_model, load_adapter
    from densebatch.model.hf.adapter import HFCausalLM
    from densebatch.testing.models import tiny_config

    transformers.AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(tmp_path / "gpt2")  # Conv1D layers
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = HFCausalLM(hf_base)
        plain.save(tmp_path / "plain")
        for base in (hf_base, tmp_path / "gpt2"):
            cfg = ModelConfig(kind="hf", path=str(base), lora=LoraConfig(r=4, alpha=8.0))
            lora = build_model(cfg, 261, None)
            lora.save(tmp_path / base.name / "adapter")
            load_adapter(tmp_path / base.name / "adapter", cfg, 261).save_merged(tmp_path / base.name / "merged")
    out, err = capfd.readouterr()
    assert not _noise(out + err), err
    assert not [str(w.message) for w in caught if issubclass(w.category, FutureWarning) or "fan_in_fan_out" in str(w.message)]
    assert hf_logging.is_progress_bar_enabled()  # the setting is put back: an application's own bars stay


@pytest.mark.slow
def test_a_hf_lora_run_has_no_progress_bars_or_future_warnings(hf_base, tmp_path):
    pytest.importorskip("peft")
    args = ["train", f"--output_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}", "--model.kind=hf",
            f"--model.path={hf_base}", "--data.tokenizer=default", "--data.add_special_tokens=<|user|>,<|bot|>",
            "--data.default.num_records=60", "--data.max_seq_len=256", "--batching.seq_len=256",
            "--batching.max_tokens_per_batch=1024", "--train.max_steps=1", "--checkpoint.every_steps=1",
            "--train.plots=false", "--eval.accuracy_samples=0", "--eval.max_batches=1", "--model.lora.r=4"]  # fmt: skip
    r = subprocess.run([str(BIN / "densebatch"), *args], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not _noise(r.stderr), r.stderr[-3000:]
    assert "added tokens: <|user|>=259, <|bot|>=260" in r.stdout and "LoRA: " in r.stdout and "trainable of" in r.stdout
    exported = subprocess.run(
        [str(BIN / "densebatch"), "export", str(tmp_path / "run"), str(tmp_path / "merged")],
        env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert not _noise(exported.stderr), exported.stderr[-3000:]


def test_lora_summary_counts_trainable_and_total_parameters(hf_base):
    pytest.importorskip("peft")
    from densebatch.config import LoraConfig, ModelConfig
    from densebatch.model import build_model
    from densebatch.model.hf.adapter import HFCausalLM
    from densebatch.model.hf.lora import lora_summary

    model = build_model(ModelConfig(kind="hf", path=str(hf_base), lora=LoraConfig(r=4, alpha=8.0)), 261, 259)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    assert 0 < trainable < total
    assert lora_summary(model) == f"LoRA: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)"
    assert lora_summary(HFCausalLM(hf_base)) is None
