"""Generation: greedy is deterministic, stops at end-of-text, and batching changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from densebatch.errors import UserError
from densebatch.model import GPT, generate, generate_batch
from densebatch.testing.models import tiny_gpt

V = 64


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_gpt(V).eval()


class NoCache(nn.Module):
    """The same model without ``init_kv_cache``: decoding reruns the whole sequence each step."""

    def __init__(self, inner: GPT) -> None:
        super().__init__()
        self.inner = inner
        self.max_positions = inner.max_positions

    def forward(self, input_ids, positions):
        return self.inner(input_ids, positions)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_greedy_is_deterministic_and_matches_full_recompute(model):
    p = prompts(1)[0]
    a = generate(model, p, max_new_tokens=20)
    assert a == generate(model, torch.tensor(p), max_new_tokens=20)
    assert len(a) == 20
    # reference: argmax of a full forward over prompt + generated tokens, step by step
    seq = list(p)
    for _ in range(20):
        logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])
        seq.append(int(logits[0, -1].argmax()))
    assert a == seq[len(p) :]
    assert a == generate(NoCache(model), p, max_new_tokens=20)


def test_stops_at_eos(model):
    p = prompts(1)[0]
    free = generate(model, p, max_new_tokens=20)
    eos = free[5]
    out = generate(model, p, max_new_tokens=20, eos_id=eos)
    assert out == free[: free.index(eos)]


def test_batch_equals_one_by_one(model):
    ps = prompts(7)
    one = [generate(model, p, max_new_tokens=10) for p in ps]
    assert generate_batch(model, ps, max_new_tokens=10) == one
    assert generate_batch(NoCache(model), ps, max_new_tokens=10) == one
    eos = one[0][3]
    stopped = generate_batch(model, ps, max_new_tokens=10, eos_id=eos)
    assert stopped == [o[: o.index(eos)] if eos in o else o for o in one]


def test_sampling_is_seeded_and_respects_top_k(model):
    p = prompts(1)[0]
    a = generate(model, p, 15, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    b = generate(model, p, 15, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    assert a == b
    seq = list(p)
    for tok in a:  # every sampled token is among the 3 most likely
        logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1]
        assert tok in logits.topk(3).indices.tolist()
        seq.append(tok)


def test_context_limit(model):
    assert len(generate(model, list(range(3, 60)), max_new_tokens=50)) == 64 - 57
    with pytest.raises(UserError, match="context"):
        generate(model, [3] * 64, max_new_tokens=5)
    with pytest.raises(UserError, match="at least one token"):
        generate(model, [], max_new_tokens=5)


def test_hf_adapter_generates(tmp_path):
    transformers = pytest.importorskip("transformers")
    from densebatch.model.hf.adapter import HFCausalLM

    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=V).save_pretrained(tmp_path)
    torch.manual_seed(0)
    hf = HFCausalLM(tmp_path).eval()
    ps = prompts(4)
    one = [generate(hf, p, max_new_tokens=8) for p in ps]
    assert generate_batch(hf, ps, max_new_tokens=8) == one
    with torch.no_grad():  # Hugging Face's own greedy decoding of the first prompt agrees
        ref = hf.hf.generate(torch.tensor([ps[0]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert one[0] == ref[0, len(ps[0]) :].tolist()


class CountingForwards(nn.Module):
    """The model, recording the input shape of every forward (with the KV cache when the model has one)."""

    def __init__(self, inner: GPT) -> None:
        super().__init__()
        self.inner = inner
        self.max_positions = inner.max_positions
        self.shapes: list[tuple[int, int]] = []

    def init_kv_cache(self):
        return self.inner.init_kv_cache()

    def forward(self, input_ids, positions, cache=None):
        self.shapes.append(tuple(input_ids.shape))
        return self.inner(input_ids, positions, cache=cache)


def test_batched_decoding_uses_the_kv_cache(model):
    """What made 200 prompts x 64 tokens quick, checked without a clock: one forward over the
    left-padded prompts, then one forward of one new token per row per step, never the whole
    sequence again; and the cached decoding gives exactly the tokens of full recomputation."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, V, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(12)]
    counting = CountingForwards(model)
    out = generate_batch(counting, ps, max_new_tokens=16)
    longest = max(len(p) for p in ps)
    assert counting.shapes == [(12, longest)] + [(12, 1)] * 15
    assert all(len(o) == 16 for o in out)
    assert out == generate_batch(NoCache(model), ps, max_new_tokens=16)
