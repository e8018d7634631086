"""End to end: training on packed rows never lets a document learn from its neighbours.

Each row packs N copies of one fresh random document (the real collator: positions restart at
every copy). A model that keeps documents apart has nothing to copy from, so after training the
loss on copies 2..N stays at the level of copy 1 (random tokens: ln(vocab)); any leak across the
boundary lets it copy the previous copy and drives those losses toward 0. The negative control
trains the same model on the same rows flagged ``single_doc_rows=True``, which makes the models
use plain causal attention: it must leak, or this test could not fail.

Reference GPT (learned positions), Hugging Face GPT-2 and Llama (rotary; a small rope_theta so that
one layer learns the fixed offset quickly); 150 steps each, one thread.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from densebatch.data.load.collate import CausalCollator
from densebatch.data.store.store import DocumentStore
from densebatch.model import GPT, GPTConfig

VOCAB, DOC_LEN, COPIES, ROWS, STEPS, LR = 32, 8, 3, 8, 150, 1e-2


def batches(seed: int):
    """Rows of COPIES copies of one random document each, collated as training would."""
    gen = np.random.default_rng(seed)
    collate = CausalCollator(pad_id=0)
    for _ in range(STEPS):
        docs = [gen.integers(1, VOCAB, DOC_LEN) for _ in range(ROWS)]
        store = DocumentStore.from_documents([(d, np.ones(DOC_LEN)) for d in docs for _ in range(COPIES)])
        yield collate(store, [[(r * COPIES + k, 0, DOC_LEN) for k in range(COPIES)] for r in range(ROWS)])


def loss_per_copy(model, leak: bool) -> list[float]:
    """Train; the mean loss of each copy over the last 20 steps. [copy 1, copy 2, ...]"""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tail = []
    for step, batch in enumerate(batches(seed=0)):
        assert batch.single_doc_rows is False  # the collator knows these rows are packed
        if leak:
            batch = dataclasses.replace(batch, single_doc_rows=True)  # a false claim: plain causal attention
        losses = model.token_losses(batch)  # (rows, COPIES * DOC_LEN)
        (losses.sum() / batch.num_loss_tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= STEPS - 20:
            tail.append(losses.detach().view(ROWS, COPIES, DOC_LEN)[:, :, :-1].mean((0, 2)))  # last token: no target
    return torch.stack(tail).mean(0).tolist()


def build(kind: str, tmp_path):
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=32, block_size=32)).train()
    transformers = pytest.importorskip("transformers")
    from densebatch.model.hf.adapter import HFCausalLM

    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, **common)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=False,
            rope_theta=10.0,
            **common,
        )
    cfg.save_pretrained(tmp_path)
    torch.manual_seed(0)
    return HFCausalLM(tmp_path).train()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "gpt2", "llama"])
def test_packed_copies_cannot_copy_each_other(kind, tmp_path):
    floor = math.log(VOCAB - 1)  # random tokens from 1..VOCAB-1: nothing better than uniform
    first, *later = loss_per_copy(build(kind, tmp_path / "kept"), leak=False)
    assert first > 0.9 * floor
    assert min(later) > 0.95 * first, f"copies 2..{COPIES} learned from their neighbours: {first:.3f} -> {later}"

    first_leaky, *later_leaky = loss_per_copy(build(kind, tmp_path / "leaky"), leak=True)
    assert max(later_leaky) < 0.5 * first_leaky, f"negative control did not leak: {first_leaky:.3f} -> {later_leaky}"
