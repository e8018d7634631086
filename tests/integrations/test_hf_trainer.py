"""densebatch's batches inside Hugging Face ``Trainer`` (densebatch.dense_batches) on a tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import densebatch
from densebatch.cli import main
from densebatch.testing.models import tiny_config

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

VOCAB = 259  # the default tokenizer's ids
ARGS = [
    "--data.tokenizer=default",
    "--data.default.num_records=64",
    "--data.max_seq_len=256",
    "--batching.strategy=packed",
    "--batching.seq_len=256",
    "--batching.max_tokens_per_batch=1024",
    "--train.progress=false",
    "--train.plots=false",
    "--train.lr=1e-3",
    "--train.warmup_steps=0",
    "--train.schedule=constant",
    "--eval.accuracy_samples=0",
    "--eval.max_batches=1",
    "--seed=5",
    "--train.loss_tokens_per_step=null",  # the demo's default sizes steps by loss tokens; HF Trainer counts batches
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("hf_trainer") / "base"
    config = tiny_config("llama", vocab_size=VOCAB, tie_word_embeddings=False, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(d)
    return d


def _recording(trainer):
    """Keep the loss of every micro-batch ``trainer`` computes (before any update is applied) in ``trainer.losses``:
    its compute_loss, as dense_batches left it, wrapped on the instance (a subclass with its own compute_loss
    would keep the trainer's loss path)."""
    inner, trainer.losses = trainer.compute_loss, []

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = inner(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        trainer.losses.append(float((loss[0] if return_outputs else loss).detach()))
        return loss

    trainer.compute_loss = compute_loss
    return trainer


def _trainer(base: Path, out: Path, dataset, steps: int, **kw):
    densebatch.register_attention()
    model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="densebatch")
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0,
        seed=5, report_to=[], save_strategy="steps", save_steps=2, logging_steps=1, use_cpu=True, optim="adamw_torch",
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    return _recording(densebatch.dense_batches(trainer, strategy="packed", seq_len=256, max_tokens_per_batch=1024, **kw))


def _prepared_dataset(cache: Path):
    """The documents ``densebatch train`` trains on (the embedded default, prepared), as a datasets.Dataset."""
    from densebatch.config import load_config
    from densebatch.data.prepare.pipeline import prepare

    cfg = load_config(None, [*ARGS, f"--data.cache_dir={cache}"])
    store = prepare(cfg.data).train
    docs = [store.document(i) for i in range(len(store))]
    return datasets.Dataset.from_dict({"input_ids": [t.tolist() for t, _ in docs], "loss_mask": [m.tolist() for _, m in docs]})


def test_the_first_step_in_trainer_has_densebatch_trains_loss(base, tmp_path):
    """The issue's check: the same documents, plan settings and seed give HF Trainer the batch `densebatch
    train` takes first, and the same loss on it (densebatch's loss head against transformers' loss)."""
    out = tmp_path / "db"
    assert main(["train", f"--output_dir={out}", f"--data.cache_dir={tmp_path / 'cache'}", "--model.kind=hf",
                 f"--model.path={base}", "--train.max_steps=1", *ARGS]) == 0  # fmt: skip
    first = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "train")
    for loss in ("densebatch", "hf"):  # densebatch's loss path in the trainer, and the trainer's own
        trainer = _trainer(base, tmp_path / loss, _prepared_dataset(tmp_path / "cache"), steps=1, loss=loss)
        trainer.train()
        assert len(trainer.losses) == 1 and abs(trainer.losses[0] - first["loss"]) <= 1e-6, (loss, trainer.losses, first["loss"])


def test_packed_rows_in_trainer_score_each_document_as_alone(base, tmp_path):
    """Inside the Trainer (attn_implementation densebatch, packed rows with cu_seq_lens), each document's
    loss is what it is alone: the step's loss equals the sum of the documents' own losses over its targets."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, VOCAB, int(n)).tolist() for n in rng.integers(5, 60, 24)]
    trainer = _trainer(base, tmp_path / "hf", datasets.Dataset.from_dict({"input_ids": docs}), steps=1)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "cu_seq_lens_q" in batch and int((batch["position_ids"] == 0).sum()) > batch["input_ids"].shape[0]
    trainer.train()
    model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    total, count = 0.0, 0
    ids, pos, shift = batch["input_ids"].reshape(-1), batch["position_ids"].reshape(-1), batch["shift_labels"].reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1).tolist() + [len(ids)]
    with torch.no_grad():
        for a, b in zip(starts[:-1], starts[1:]):  # each piece alone, in a row of its own
            logits = model(input_ids=ids[a:b][None]).logits[0]
            y = shift[a:b]
            total += float(torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum"))
            count += int((y != -100).sum())
    assert abs(trainer.losses[0] - total / count) <= 1e-5


def test_a_resumed_trainer_run_continues_with_the_same_batches(base, tmp_path):
    """4 steps in one go against 2 steps, then a new Trainer resumed from the step-2 checkpoint for 2 more:
    the same losses at steps 3 and 4 (the same batches, the same weights)."""
    rng = np.random.default_rng(1)
    ds = datasets.Dataset.from_dict({"input_ids": [rng.integers(3, VOCAB, int(n)).tolist() for n in rng.integers(5, 90, 80)]})
    whole = _trainer(base, tmp_path / "whole", ds, steps=4)
    whole.train()
    first = _trainer(base, tmp_path / "part", ds, steps=2)
    first.train()
    resumed = _trainer(base, tmp_path / "part", ds, steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"))
    assert len(whole.losses) == 4 and np.allclose(resumed.losses, whole.losses[2:], atol=1e-6), (whole.losses, resumed.losses)


def test_trl_sft_trainer_trains_on_the_same_batches_with_the_same_loss(base, tmp_path):
    """TRL's SFTTrainer with dense_batches: its first step is the plain Trainer's (the same planned batch, and on
    both densebatch's loss path, which reads shift_labels, so no target at a row cut is lost), within 1e-5."""
    trl = pytest.importorskip("trl")
    from densebatch.data.prepare.tokenizers import load_tokenizer

    rng = np.random.default_rng(2)
    ds = datasets.Dataset.from_dict({"input_ids": [rng.integers(3, VOCAB, int(n)).tolist() for n in rng.integers(5, 300, 40)]})
    plain = _trainer(base, tmp_path / "plain", ds, steps=1)
    plain.train()
    load_tokenizer("default").save(tmp_path / "tok")

    model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation=densebatch.register_attention())
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), max_steps=1, learning_rate=1e-3, seed=5, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, packing=False, dataset_kwargs={"skip_prepare_dataset": True},
    )  # fmt: skip
    sft = trl.SFTTrainer(
        model=model, args=args, train_dataset=ds, processing_class=transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    )
    _recording(densebatch.dense_batches(sft, strategy="packed", seq_len=256, max_tokens_per_batch=1024, pad_id=0))
    assert sft.densebatch_loss.startswith("densebatch fused head") and plain.densebatch_loss == sft.densebatch_loss
    assert (
        next(iter(sft.get_train_dataloader()))["input_ids"].shape == next(iter(plain.get_train_dataloader()))["input_ids"].shape
    )
    sft.train()
    assert len(sft.losses) == 1 and abs(sft.losses[0] - plain.losses[0]) <= 1e-5, (sft.losses, plain.losses)


@pytest.mark.slow
def test_two_processes_under_torchrun_train_as_one_with_twice_the_accumulation(base, tmp_path):
    """Trainer under torchrun (2 processes, gloo): each rank takes its share of every step, and 3 steps of 2
    batches a rank end with the weights of one process taking 4 batches a step (the same planned batches,
    the loss averaged over the step's tokens across ranks)."""
    import subprocess
    import sys

    from support import subprocess_env, torchrun

    driver = Path(__file__).parent / "hf_trainer_driver.py"
    env = subprocess_env()
    two = subprocess.run(
        torchrun([str(tmp_path / "two"), str(base), "2"], script=driver), env=env, capture_output=True, text=True, timeout=300
    )
    # the trainer counting each rank's tokens alone: densebatch's loss path still divides by the whole step's
    local = subprocess.run(
        torchrun([str(tmp_path / "local"), str(base), "2", "local"], script=driver),
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    one = subprocess.run(
        [sys.executable, str(driver), str(tmp_path / "one"), str(base), "4"], env=env, capture_output=True, text=True, timeout=300
    )
    assert two.returncode == 0 and one.returncode == 0 and local.returncode == 0, (two.stderr[-2000:], one.stderr[-2000:])
    runs = [json.loads(f.read_text()) for d in ("two", "one") for f in sorted((tmp_path / d).glob("rank-*.json"))]
    local_sums = [json.loads(f.read_text())["sums"] for f in sorted((tmp_path / "local").glob("rank-*.json"))]
    ranks, alone = [r for r in runs if r["world"] == 2], [r for r in runs if r["world"] == 1]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and len(alone) == 1
    assert np.allclose(ranks[0]["sums"], ranks[1]["sums"], atol=0)  # DDP: the same weights on both ranks
    assert np.allclose(ranks[0]["sums"], alone[0]["sums"], rtol=1e-5, atol=1e-5)
    assert np.allclose(ranks[0]["logs"], alone[0]["logs"], atol=1e-4)
    assert len(local_sums) == 2 and np.allclose(local_sums[0], alone[0]["sums"], rtol=1e-5, atol=1e-5)


def test_settings_and_rows_longer_than_the_models_positions_are_refused_before_training(base, tmp_path):
    """A bad strategy or budget is refused when dense_batches is called (it surfaced at trainer.train()), and
    rows longer than the model's 256 positions before the first step (an index error deep in the embedding)."""
    dataset = datasets.Dataset.from_dict({"input_ids": [list(range(1, 301)), list(range(1, 41))] * 4})
    for bad, match in (({"strategy": "bogus"}, "strategy: expected one of"), ({"max_tokens_per_batch": 0}, "positive")):
        with pytest.raises(ValueError, match=match):
            densebatch.dense_batches(_trainer(base, tmp_path / "a", dataset, steps=1), **bad)
    cases = {
        ("packed", 512): "pass seq_len=256",
        ("token_budget", 512): "pass max_tokens_per_batch=256",
        ("random", 512): "cut the documents to 256 tokens",
    }
    for (strategy, budget), fix in cases.items():
        trainer = _trainer(base, tmp_path / strategy, dataset, steps=1)
        densebatch.dense_batches(trainer, strategy=strategy, seq_len=budget, max_tokens_per_batch=budget, rows_per_batch=2)
        with pytest.raises(ValueError, match=f"has 256 positions: {fix}"):
            trainer.get_train_dataloader()
    trainer = densebatch.dense_batches(
        _trainer(base, tmp_path / "ok", dataset, steps=1), strategy="token_budget", max_tokens_per_batch=256
    )
    assert next(iter(trainer.get_train_dataloader()))["input_ids"].shape[1] <= 256  # long documents split to the budget
