"""Fine-tuning a Hugging Face model through the CLI: LoRA end to end, added tokens, resume, export.

A tiny Llama with weights (untied head, the byte tokenizer's 259 ids) saved in a temporary directory,
trained by ``densebatch train`` on the embedded dataset with two added special tokens:

- LoRA (``model.lora.r``): final/ is a peft adapter beside the tokenizer; ``eval`` on it reproduces the
  run's own final eval loss (the trained model is rebuilt from the base and the adapter); ``generate``
  reads it; ``export`` merges it into a plain model that ``from_pretrained`` loads with the same logits
  and a vocabulary matching ``AutoTokenizer``'s; stopped at step 2 and resumed to step 4, it logs the
  same losses and saves the same adapter as the run that was not stopped.
- every weight training (no LoRA), and the reference GPT: final/ and export agree with the tokenizer.
- docs/hf-models.md's walkthrough runs as written and prints what the page says.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from densebatch.cli import main
from densebatch.testing.models import tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

BYTE_VOCAB = 259  # the default tokenizer's ids; the tokens below come after them
SPECIALS = "--data.add_special_tokens=<|user|>,<|bot|>"
COMMON = [
    "--data.tokenizer=default",
    SPECIALS,
    "--data.default.num_records=120",
    "--data.max_seq_len=256",
    "--batching.seq_len=256",
    "--batching.max_tokens_per_batch=1024",
    "--train.progress=false",
    "--train.plots=false",
    "--train.lr=1e-2",
    "--train.warmup_steps=0",
    "--train.schedule=constant",
    "--eval.accuracy_samples=0",
    "--eval.max_batches=2",
]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_cli")


@pytest.fixture(scope="module")
def base(root) -> Path:
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=BYTE_VOCAB, tie_word_embeddings=False, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "base")
    return root / "base"


def train(root: Path, base: Path, name: str, *extra: str) -> Path:
    out = root / name
    args = ["train", f"--output_dir={out}", f"--data.cache_dir={root / 'cache'}", "--model.kind=hf", f"--model.path={base}"]
    assert main([*args, *COMMON, *extra]) == 0
    return out


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


LORA = ["--model.lora.r=4", "--model.lora.alpha=8", "--checkpoint.every_steps=2"]


@pytest.fixture(scope="module")
def lora_run(root, base) -> Path:
    return train(root, base, "lora", *LORA, "--train.max_steps=4")


def test_lora_final_is_an_adapter_that_eval_reproduces(lora_run, capsys):
    final = lora_run / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "config.json").exists()
    assert sorted(r["step"] for r in records(lora_run, "train")) == [1, 2, 3, 4]
    capsys.readouterr()
    assert main(["eval", str(lora_run / "config.yaml"), "--checkpoint", str(final), "--json", "--eval.max_batches=2"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = records(lora_run, "eval")[-1]
    assert got["tokens"] == want["tokens"]
    assert abs(got["loss"] - want["loss"]) <= 1e-5  # the adapter rebuilds the trained model


def test_lora_final_generates(lora_run, capsys):
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(lora_run), "--prompt", "Is 12 even?", "--max-new-tokens", "4"]) == 0


def test_lora_export_merges_to_a_plain_model_with_the_same_logits(lora_run, base, tmp_path):
    from densebatch.run.commands import load_trained

    out = tmp_path / "merged"
    assert main(["export", str(lora_run), str(out)]) == 0
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert plain.config.vocab_size == len(tok) == BYTE_VOCAB + 2
    assert tok.convert_tokens_to_ids("<|bot|>") == BYTE_VOCAB + 1
    assert len(tok("<|user|>hi<|bot|>")["input_ids"]) == 4  # each added token is one id
    ours, _, _, _ = load_trained(lora_run)
    ids = torch.tensor([[72, BYTE_VOCAB, 105, 33, BYTE_VOCAB + 1, 10]])
    with torch.no_grad():
        want = ours.eval()(ids, torch.arange(6)[None])
        got = plain(input_ids=ids).logits
    # merged weights reassociate the adapter's sums: fp32 rounding (see tests/model/hf/test_lora.py)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    untrained = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():  # the adapters trained: the merge carries them (base tokens only: the base has 259 rows)
        assert (
            untrained(input_ids=ids[:, :4] % BYTE_VOCAB).logits
            - plain(input_ids=ids[:, :4] % BYTE_VOCAB).logits[..., :BYTE_VOCAB]
        ).abs().max() > 1e-3


def test_lora_resume_continues_exactly(lora_run, root, base):
    from safetensors.torch import load_file

    stopped = train(root, base, "lora_stopped", *LORA, "--train.max_steps=2")
    assert main(["train", str(stopped / "config.yaml"), "--resume", "--train.max_steps=4"]) == 0
    assert [r["loss"] for r in records(stopped, "train")] == [r["loss"] for r in records(lora_run, "train")]
    a = load_file(stopped / "final" / "adapter_model.safetensors")
    b = load_file(lora_run / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("trainable_tokens" in k for k in a)  # the added tokens' rows are part of what resumed


def test_full_finetune_with_added_tokens_saves_a_matching_model(root, base):
    run = train(root, base, "full", "--train.max_steps=2")
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "final")
    tok = transformers.AutoTokenizer.from_pretrained(run / "final")
    assert model.config.vocab_size == model.get_output_embeddings().weight.shape[0] == len(tok) == BYTE_VOCAB + 2


def test_reference_gpt_with_added_tokens_exports_a_matching_model(root, tmp_path):
    out = root / "gpt"
    args = ["train", f"--output_dir={out}", f"--data.cache_dir={root / 'cache'}", *COMMON, "--train.max_steps=2"]
    assert main([*args, "--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=256"]) == 0
    assert main(["export", str(out), str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size == len(tok) == BYTE_VOCAB + 2
    assert tok.convert_tokens_to_ids("<|user|>") == BYTE_VOCAB


def test_an_eager_only_architecture_trains_and_its_final_model_loads(root, capsys):
    """Gemma 2 soft-caps its attention scores, which only eager computes: trained with
    model.attn_implementation eager, its final/ is read back the same way by generate and eval."""
    torch.manual_seed(0)
    config = tiny_config("gemma2", vocab_size=BYTE_VOCAB, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "gemma2_base")
    run = train(root, root / "gemma2_base", "gemma2", "--model.attn_implementation=eager", "--train.max_steps=2")
    assert main(["generate", "--checkpoint", str(run), "--prompt", "Is 12 even?", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run / "config.yaml"), "--checkpoint", str(run / "final"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(got["loss"] - records(run, "eval")[-1]["loss"]) <= 1e-5


def test_the_docs_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    """Shell lines run in bash; the densebatch lines through the CLI's own main() in this process (the
    same command, without five more interpreter start-ups), in order, in an empty directory."""
    text = (Path(__file__).parents[2] / "docs" / "hf-models.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text.split("## Walkthrough", 1)[1], re.S).group(1)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.chdir(tmp_path)
    shell: list[str] = []

    def run_shell() -> str:
        r = subprocess.run(["bash", "-e", "-c", "\n".join(shell)], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        shell.clear()
        return r.stdout

    for line in block.splitlines():
        if line.startswith("densebatch "):
            if shell:
                run_shell()
            assert main(shlex.split(line)[1:]) == 0, line
        else:
            shell.append(line)
    printed = run_shell()
    assert printed.strip().splitlines()[-1] == "261 261 [259, 104, 105]"  # what the page says it prints
    assert "resumed from runs/hf-lora/checkpoints/step-000004 (step 4)" in capsys.readouterr().out
