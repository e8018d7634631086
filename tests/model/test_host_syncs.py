"""A micro-batch's forward and backward never read the device back (issue 22).

Host synchronisations (``aten::_local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``;
``aten::nonzero``: a data-dependent shape) stall a GPU between kernels and rule out CUDA graphs. The
collator computes what the models would otherwise read back (``single_doc_rows``, ``max_position``,
the segment bounds ``cu_seqlens`` / ``max_seqlen``, ``num_loss_tokens``): attention plans are built on
the host from the bounds, the loss head gathers a statically sized index. Counted here with the
profiler on CPU, where the same ops run, over ``token_losses`` + ``backward`` of a collated batch of
packed rows, for the reference GPT and a Hugging Face Llama under each CPU attention backend.
A batch built without those facts (``testing.batches.pack`` leaves two of them unknown) does sync:
the negative control that shows the counter sees them.
"""

from __future__ import annotations

import collections

import pytest
import torch
from support import random_store
from torch.profiler import ProfilerActivity, profile

from densebatch.data.load.collate import CausalCollator
from densebatch.model import GPT, GPTConfig
from densebatch.testing.batches import pack

SYNCS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item")
VOCAB = 100


def syncs(model, batch) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (model.token_losses(batch).sum() / batch.num_loss_tokens).backward()
    return dict(collections.Counter(e.name for e in prof.events() if e.name in SYNCS))


@pytest.fixture(scope="module")
def batch():
    store = random_store(12, seed=1, vocab=VOCAB, lengths=(20, 120))
    rows = [[(0, 0, int(store.lengths[0])), (1, 0, int(store.lengths[1]))], [(2, 0, int(store.lengths[2]))], [(3, 0, 9)]]
    return CausalCollator(pad_id=0)(store, rows)


def gpt(attention: str) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, block_size=512, attention=attention))


def llama(tmp_path, attention: str):
    transformers = pytest.importorskip("transformers")
    from densebatch.model.hf.adapter import HFCausalLM

    transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
    ).save_pretrained(tmp_path)  # fmt: skip
    torch.manual_seed(0)
    return HFCausalLM(tmp_path, attention=attention)


@pytest.mark.parametrize("attention", ["segmented", "masked"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_forward_and_backward_make_no_host_sync(kind, attention, batch, tmp_path):
    model = gpt(attention) if kind == "gpt" else llama(tmp_path, attention)
    assert batch.single_doc_rows is False and batch.cu_seqlens is not None  # packed rows: the plans do real work
    assert syncs(model, batch) == {}


def test_negative_control_a_batch_without_the_collators_facts_syncs(batch):
    bare = pack([[[1, 2, 3, 4], [5, 6]], [[7, 8, 9]]], seq_len=8)  # single_doc_rows and max_position unknown
    assert bare.single_doc_rows is None
    assert sum(syncs(gpt("segmented"), bare).values()) > 0
