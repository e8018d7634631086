"""The public Python API refuses what it cannot read, before or at the document, with a message saying what to
pass: no float ids truncated, no text read as digits, no generator or DatasetDict failing deep inside, no
setting that numpy would choke on later, and no Trainer setting silently ignored."""

from __future__ import annotations

import pytest
import torch

import densebatch
from densebatch.data.torch_loader import DenseBatchSampler


def _first(dataset, **kw):
    return next(iter(densebatch.dataloader(dataset, strategy="random", rows_per_batch=1, **kw)))


@pytest.mark.parametrize(
    "items, said",
    [
        ([torch.rand(5)], "got float32 values"),  # it read [0, 0, 0, 0, 0]
        ([[1.9, 2.7]], "got float64 values"),  # it read [1, 2]
        (["hello", "world"], "got str"),
        ([[1, [2, 3]]], "got nested lists"),
    ],
)
def test_a_document_that_is_not_a_flat_list_of_integer_ids_is_named(items, said):
    with pytest.raises(ValueError, match=rf"document 0: input_ids must be a flat list of integer token ids; {said}"):
        _first(items)


def test_datasets_that_cannot_be_read_by_index_say_what_to_pass():
    datasets = pytest.importorskip("datasets")
    with pytest.raises(TypeError, match="map-style dataset .* got generator"):
        densebatch.dataloader(x for x in [[1, 2]])
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    with pytest.raises(TypeError, match=r"pass one split, e.g. dataset\['train'\]"):
        densebatch.dataloader(datasets.DatasetDict({"train": ds}))
    with pytest.raises(ValueError, match="no input_ids column .*text.*tokenize it first"):
        densebatch.dataloader(datasets.Dataset.from_dict({"text": ["a b"]}))
    with pytest.raises(ValueError, match="document 0: input_ids must be"):  # a string column: pyarrow's error before
        _first(datasets.Dataset.from_dict({"input_ids": ["ab", "cd"]}))


@pytest.mark.parametrize(
    "settings, said",
    [
        ({"seq_len": "16"}, "seq_len: expected a positive integer"),
        ({"seq_len": 16.5}, "seq_len: expected a positive integer"),
        ({"rows_per_batch": "2"}, "rows_per_batch: expected a positive integer"),
        ({"drop_last": "no"}, "drop_last: expected true or false"),  # truthy: it dropped the last batch
    ],
)
def test_settings_of_the_wrong_type_are_refused_when_given(settings, said):
    with pytest.raises(ValueError, match=said):
        DenseBatchSampler([5, 6, 7], "random", **settings)


def test_a_sampler_state_and_a_step_count_that_cannot_be_are_refused():
    sampler = DenseBatchSampler([5, 6, 7, 8], "random", rows_per_batch=1)
    with pytest.raises(ValueError, match="epoch and step must be >= 0"):  # step -3 yielded 8 batches of 4
        sampler.load_state_dict({"seed": 0, "epoch": 0, "step": -3})
    batch = _first([[1, 2, 3]])
    logits = torch.zeros(1, 3, 8)
    with pytest.raises(ValueError, match="num_items_in_batch: expected the step's number of targets"):
        densebatch.causal_loss(logits, batch, -5)  # clamped to 1 before
    assert float(densebatch.causal_loss(logits, batch, 2)) == pytest.approx(2 * torch.log(torch.tensor(8.0)).item() / 2)


def test_a_trainer_grouping_by_length_is_refused_by_dense_batches(tmp_path):
    transformers = pytest.importorskip("transformers")
    from densebatch.testing.models import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], train_sampling_strategy="group_by_length"
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[[1, 2, 3]])
    with pytest.raises(ValueError, match="group_by_length would be ignored"):
        densebatch.dense_batches(trainer)


def test_ids_past_the_models_vocabulary_and_a_pad_id_outside_it_are_named():
    """An id past vocab_size (a tokenizer other than the model's) is named with its documents at its batch, not
    an index error deep in the embedding; a pad id outside the vocabulary, or negative, when the loader is made."""
    with pytest.raises(ValueError, match=r"token id 300 in document\(s\) 1: past the model's vocabulary of 256 ids"):
        list(densebatch.dataloader([[1, 2, 3], [4, 300]], strategy="random", rows_per_batch=1, vocab_size=256))
    for pad, said in ((-1, "pad_id: expected a token id in 0 .. "), (1000, r"pad_id: expected a token id in 0 \.\. 255")):
        with pytest.raises(ValueError, match=said):
            densebatch.dataloader([[1, 2, 3]], pad_id=pad, vocab_size=256)


def test_dense_batches_checks_ids_against_the_trainers_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from densebatch.testing.models import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[[1, 2, 3], [5, 100, 7]])
    loader = densebatch.dense_batches(
        trainer, strategy="random", rows_per_batch=2, max_tokens_per_batch=64
    ).get_train_dataloader()
    with pytest.raises(ValueError, match="token id 100 .* past the model's vocabulary of 64 ids"):
        next(iter(loader))
    with pytest.raises(ValueError, match=r"pad_id: expected a token id in 0 \.\. 63; got 64"):
        densebatch.dense_batches(trainer, strategy="random", pad_id=64).get_train_dataloader()
