"""The public Python API: densebatch.dataloader / DenseBatchSampler / Documents / Collator in a plain torch loop."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import densebatch
from densebatch.data.torch_loader import DenseBatchSampler, Documents

STRATEGIES = ["random", "length_grouped", "token_budget", "packed"]
PAD = 999_999


def _ids(doc: int, n: int) -> list[int]:
    """Document ``doc``'s tokens: each names its document and position, so a batch says what it holds."""
    return [doc * 1000 + p for p in range(n)]


@pytest.fixture(scope="module")
def lengths() -> list[int]:
    return np.random.default_rng(0).integers(1, 70, 90).tolist()


@pytest.fixture(scope="module")
def hf_dataset(lengths):
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict({"input_ids": [_ids(d, n) for d, n in enumerate(lengths)]})


def _kw(strategy: str) -> dict:
    return {"strategy": strategy, "seq_len": 48, "max_tokens_per_batch": 192, "rows_per_batch": 4, "seed": 3, "pad_id": PAD}


def _tokens(batch: dict) -> list[tuple[int, int]]:
    ids = batch["input_ids"][batch["input_ids"] != PAD]
    return [(int(t) // 1000, int(t) % 1000) for t in ids]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_document_once_an_epoch_on_one_and_two_ranks(hf_dataset, lengths, strategy):
    """The issue's check: over one epoch every token of every document comes out exactly once, on one
    rank and shared by two (each rank the same number of batches); a second epoch is another order."""
    want = sorted((d, p) for d, n in enumerate(lengths) for p in range(n))
    for world in (1, 2):
        loaders = [densebatch.dataloader(hf_dataset, **_kw(strategy), rank=r, world_size=world) for r in range(world)]
        epochs = [[list(loader) for loader in loaders] for _ in range(2)]
        for per_rank in epochs:
            assert len({len(b) for b in per_rank}) == 1, "every rank yields the same number of batches"
            got = sorted(t for batches in per_rank for b in batches for t in _tokens(b))
            assert got == want, (strategy, world)
        first = [_tokens(b) for b in epochs[0][0]]
        assert first != [_tokens(b) for b in epochs[1][0]], "each epoch has its own seeded order"
        again = densebatch.dataloader(hf_dataset, **_kw(strategy), rank=0, world_size=world)
        assert [_tokens(b) for b in again] == first, "the same seed plans the same epoch"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hugging_face_format_positions_labels_and_flash_attention_bounds(hf_dataset, strategy):
    """Positions restart at 0 at every piece (and padding run), labels are the tokens themselves (unshifted)
    with -100 at each piece's first token and at padding, and packed rows carry cu_seq_lens_q/k over the
    flattened rows that match the positions (what DataCollatorWithFlattening emits); rows of one piece get
    an attention_mask instead."""
    packed_rows = False
    for b in densebatch.dataloader(hf_dataset, **_kw(strategy)):
        ids, pos, labels = b["input_ids"], b["position_ids"], b["labels"]
        assert ids.shape == pos.shape == labels.shape and ids.dtype == torch.int64
        for r in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                real = ids[r, j] != PAD
                prev_same = bool(real and j > 0 and ids[r, j - 1] == ids[r, j] - 1)  # the piece goes on
                if real:
                    assert (pos[r, j] == 0) == (not prev_same)
                assert labels[r, j] == (ids[r, j] if prev_same else -100)
        assert torch.equal(b["shift_labels"][:, :-1][labels[:, 1:] != -100], labels[:, 1:][labels[:, 1:] != -100])
        if "cu_seq_lens_q" in b:
            packed_rows = True
            starts = torch.nonzero(pos.reshape(-1) == 0).reshape(-1)
            cu = b["cu_seq_lens_q"]
            assert cu.dtype == torch.int32 and torch.equal(cu, b["cu_seq_lens_k"])
            assert cu[:-1].tolist() == starts.tolist() and int(cu[-1]) == ids.numel()
            assert b["max_length_q"] == b["max_length_k"] == int((cu[1:] - cu[:-1]).max())
            assert "attention_mask" not in b
        else:
            assert torch.equal(b["attention_mask"].bool(), ids != PAD)
    assert packed_rows == (strategy != "random")


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_mid_epoch_continues_with_the_same_batches(hf_dataset, workers):
    """state_dict() after 3 batches (workers fetch ahead: the state is what was handed out) and a new
    loader's load_state_dict() give the rest of the epoch and the next epoch, batch for batch."""
    kw = dict(_kw("packed"), num_workers=workers)
    first = densebatch.dataloader(hf_dataset, **kw)
    whole = [_tokens(b) for _ in range(2) for b in first]  # epochs 0 and 1
    loader = densebatch.dataloader(hf_dataset, **kw)
    it = iter(loader)
    head = [_tokens(next(it)) for _ in range(3)]
    state = loader.state_dict()
    assert state == {"seed": 3, "epoch": 0, "step": 3}
    del it
    resumed = densebatch.dataloader(hf_dataset, **kw)
    resumed.load_state_dict(state)
    rest = [_tokens(b) for _ in range(2) for b in resumed]
    assert head + rest == whole


def test_a_list_of_ids_and_labels_or_loss_masks(lengths):
    """Documents of plain id lists, or dicts with Hugging Face labels (-100 = no target) or a loss mask: the
    prompt tokens' labels are -100 in the batches, as densebatch's own prepare marks them."""
    docs = [_ids(d, n) for d, n in enumerate(lengths)]
    prompt = [n // 2 for n in lengths]
    with_labels = [{"input_ids": x, "labels": [-100] * k + x[k:]} for x, k in zip(docs, prompt)]
    with_mask = [{"input_ids": x, "loss_mask": [0] * k + [1] * (len(x) - k)} for x, k in zip(docs, prompt)]
    for data in (with_labels, with_mask):
        for b in densebatch.dataloader(data, **_kw("packed")):
            for t, y in zip(b["input_ids"].reshape(-1).tolist(), b["labels"].reshape(-1).tolist()):
                if t != PAD and (t % 1000) < prompt[t // 1000]:
                    assert y == -100
    plain = sorted(t for b in densebatch.dataloader(docs, **_kw("token_budget")) for t in _tokens(b))
    assert plain == sorted((d, p) for d, n in enumerate(lengths) for p in range(n))
    assert Documents(docs).lengths.tolist() == lengths


def test_step_loss_over_micro_batches_is_the_mean_over_every_target(hf_dataset, lengths):
    """causal_loss with num_items (the step's targets): the micro-batches' losses add up to the mean over
    the targets of all of them, whatever each holds; over an epoch of whole documents (no split rows)
    that is the mean over every target of the data (here from a bigram model, where context is moot)."""
    torch.manual_seed(0)
    vocab = len(lengths) * 1000
    table, head = torch.nn.Embedding(vocab, 7), torch.nn.Linear(7, vocab)

    def logits(ids):
        return head(table(ids.clamp(max=vocab - 1)))  # the padding id is never a target

    def direct():  # the mean over every target of the data
        ids = torch.tensor([t for d, k in enumerate(lengths) for t in _ids(d, k)])
        keep = torch.tensor([p > 0 for k in lengths for p in range(k)])
        return torch.nn.functional.cross_entropy(logits(ids[:-1][keep[1:]]), ids[1:][keep[1:]])

    for strategy in ("token_budget", "packed"):  # whole documents; documents split across rows
        batches = list(densebatch.dataloader(hf_dataset, **dict(_kw(strategy), max_tokens_per_batch=512)))
        n = densebatch.num_items(batches)
        assert n == sum(lengths) - len(lengths)  # every token but each document's first: none lost at a cut
        step = sum(densebatch.causal_loss(logits(b["input_ids"]), b, n) for b in batches)
        assert torch.allclose(step, direct(), atol=1e-5), strategy
        hf_labels_only = [{"input_ids": b["input_ids"], "labels": b["labels"]} for b in batches]
        cut = sum(int(((b["shift_labels"] != -100) & (torch.roll(b["labels"], -1, 1) == -100)).sum()) for b in batches)
        assert densebatch.num_items(hf_labels_only) == n - cut and (cut > 0) == (strategy == "packed")


def test_a_sampler_of_many_documents_plans_in_shards_and_every_rank_agrees():
    """Above shard_docs the sampler reads a sharded plan; two ranks still yield the same number of
    batches and together every document once."""
    lengths = np.random.default_rng(1).integers(1, 30, 3000)
    samplers = [DenseBatchSampler(lengths, "packed", 64, 256, shard_docs=700, rank=r, world_size=2) for r in range(2)]
    batches = [list(s) for s in samplers]
    assert len(batches[0]) == len(batches[1]) == len(samplers[0])
    covered = np.zeros(len(lengths), np.int64)
    for rank in batches:
        for b in rank:
            for p in b:
                covered[p.doc] += p.stop - p.start
    assert np.array_equal(covered, lengths)


def test_the_package_exports_only_the_public_names_and_imports_no_torch():
    from densebatch import _EXPORTS

    assert sorted(densebatch.__all__) == sorted([*_EXPORTS, "__version__"])
    assert all(getattr(densebatch, name) is not None for name in _EXPORTS)
    code = "import sys, densebatch; assert 'torch' not in sys.modules, 'import densebatch pulled in torch'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


def test_the_training_loop_in_the_docs_runs_as_written(capsys):
    """docs/python.md's plain PyTorch loop, executed as it stands there."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "python.md").read_text()
    code = text.split("## A plain PyTorch loop", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/python.md", "exec"), {})
    assert "done {'seed': 0, 'epoch': 2, 'step': 0}" in capsys.readouterr().out


def test_an_epoch_taken_batch_by_batch_to_its_last_rolls_over_and_mappings_are_documents(hf_dataset, lengths):
    """Taking exactly an epoch's batches without exhausting the iterator (islice) ends the epoch: the state is
    the next epoch's start and the next pass yields a whole epoch. Items that are any Mapping (a tokenizer's
    BatchEncoding) are read by their input_ids."""
    import itertools
    import types

    loader = densebatch.dataloader(hf_dataset, **_kw("packed"))
    n = len(loader)
    assert len(list(itertools.islice(loader, n))) == n and loader.state_dict() == {"seed": 3, "epoch": 1, "step": 0}
    assert len(list(loader)) == n
    docs = [types.MappingProxyType({"input_ids": _ids(d, k)}) for d, k in enumerate(lengths)]
    assert densebatch.Documents(docs).lengths.tolist() == lengths


def test_a_store_that_needs_more_open_files_than_allowed_is_one_line(tmp_path, monkeypatch):
    """Raised to the hard limit when it must be; beyond it, one line saying what to do."""
    import resource

    from densebatch.data.store.store import DocumentStore
    from densebatch.errors import DataError

    store = DocumentStore.from_documents([([1, 2, 3], [0, 1, 1])] * 4).save(tmp_path / "s", shard_tokens=3)  # 4 shards
    monkeypatch.setattr(resource, "getrlimit", lambda what: (16, 16))
    with pytest.raises(DataError, match="open files.*data.shard_tokens") as e:
        DocumentStore.open(store.path)
    assert "\n" not in str(e.value)
