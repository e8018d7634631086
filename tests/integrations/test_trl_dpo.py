"""dense_batches(DPOTrainer): TRL's trainer on densebatch's plan of whole pairs (every pair once an epoch, no batch
over its budget of padded rows), its own collator and loss kept; what it cannot take is refused in one line."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import densebatch  # noqa: E402
from densebatch.testing.models import two_layer_config  # noqa: E402

PAIRS = [{"prompt": "Q" * (1 + i % 7), "chosen": " a" * (1 + i % 5), "rejected": " b" * (1 + (i * 3) % 4)} for i in range(21)]


@pytest.fixture
def trainer(tmp_path):
    from densebatch.data.prepare.tokenizer_files import byte_level_tokenizer

    byte_level_tokenizer(["<|endoftext|>"], []).save(str(tmp_path / "tokenizer.json"))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(two_layer_config("llama")).save_pretrained(tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False,
        save_strategy="no", max_steps=2, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    return trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=tok)


def test_every_pair_once_an_epoch_within_the_budget_and_trls_own_loss_trains(trainer):
    budget = 96
    densebatch.dense_batches(trainer, max_tokens_per_batch=budget)
    loader = trainer.get_train_dataloader()
    seen = [i for batch in loader.batch_sampler for i in batch]
    assert sorted(seen) == list(range(len(PAIRS)))  # whole pairs, each once
    for batch in loader:
        assert batch["input_ids"].numel() <= budget  # two padded rows a pair, within the budget
        rows = batch["input_ids"].shape[0]
        assert rows % 2 == 0 and torch.equal(batch["completion_mask"].sum(1) > 0, torch.ones(rows, dtype=torch.bool))
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(strategy="packed"), "packs several pairs into a row, which needs densebatch's own loss"),
        (dict(max_tokens_per_batch=8), "pass max_tokens_per_batch="),
        (dict(seq_len=128), "seq_len, source_column and loss_chunk_tokens do not apply"),
    ],
)
def test_what_it_cannot_take_is_one_line(trainer, change, words):
    with pytest.raises(ValueError) as e:
        densebatch.dense_batches(trainer, **change)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_dataset_or_collator_it_cannot_plan_is_named(trainer):
    collator = trainer.data_collator
    trainer.data_collator = lambda examples: examples
    with pytest.raises(ValueError, match="not TRL's DataCollatorForPreference"):
        densebatch.dense_batches(trainer)
    trainer.data_collator = collator
    trainer.train_dataset = trainer.train_dataset.remove_columns(["rejected_ids"])
    with pytest.raises(ValueError, match="has no rejected_ids"):
        densebatch.dense_batches(trainer)
