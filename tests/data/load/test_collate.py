"""Collators: labels are inputs shifted by one except -100 at exactly padding, prompt and document ends;
a split document keeps the target at every cut; positions restart per piece; counts and the planner's
facts (single_doc_rows, max_position, documents) exact; the book's collate on its own data; masked-LM."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import memory_store, shared_data_dir

from densebatch.batch import IGNORE_INDEX, segment_bounds
from densebatch.data.load.collate import CausalCollator, MaskedLMCollator, collator_from_config
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.errors import ConfigError, DataError
from densebatch.testing.book import alpaca_text, book_collate, gpt2_tokenizer

EOS = 50256  # GPT-2's end-of-text, the book's padding


def reference(store, rows, pad_id, mult, use_mask=True):
    """Per-token Python reference of the causal collate contract: the target of a piece's token is the
    next token of its *document* (also across a cut), -100 only after the document's last token."""
    lens = [sum(b - a for _, a, b in row) for row in rows]
    T = -(-max(lens, default=0) // mult) * mult
    ids = np.full((len(rows), T), pad_id)
    lab = np.full((len(rows), T), IGNORE_INDEX)
    pos = np.zeros((len(rows), T), np.int64)
    for r, row in enumerate(rows):
        t = 0
        for d, a, b in row:
            off, n = store.offsets[d], store.offsets[d + 1] - store.offsets[d]
            for k in range(b - a):
                ids[r, t] = store.tokens[off + a + k]
                pos[r, t] = k
                if a + k + 1 < n and (not use_mask or store.loss_mask[off + a + k + 1]):
                    lab[r, t] = store.tokens[off + a + k + 1]
                t += 1
        pos[r, t:] = np.arange(T - t)
    return ids, lab, pos


doc_st = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 1)), min_size=1, max_size=30)


def _draw_rows(data, store, n: int) -> list[list[tuple[int, int, int]]]:
    """1-4 rows of 1-3 spans ``(document, start, end)`` drawn from the ``n`` documents of ``store``."""
    rows = []
    for _ in range(data.draw(st.integers(1, 4))):
        row = []
        for d in data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3)):
            L = int(store.lengths[d])
            a = data.draw(st.integers(0, L - 1))
            row.append((d, a, data.draw(st.integers(a + 1, L))))
        rows.append(row)
    return rows


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(doc_st, min_size=1, max_size=12), st.data(), st.sampled_from([1, 4, 8]), st.booleans())
def test_causal_matches_reference(docs, data, mult, use_mask):
    """Tokens drawn from a tiny vocabulary so pad/eos ids (0..20 includes 0 = pad, 20 = eos) occur inside texts."""
    store = memory_store([[t for t, _ in d] for d in docs], [[m for _, m in d] for d in docs], eos_id=20, pad_id=0)
    n = len(docs)
    rows = _draw_rows(data, store, n)
    batch = CausalCollator(pad_id=0, pad_to_multiple_of=mult, use_loss_mask=use_mask)(store, rows)
    ids, lab, pos = reference(store, rows, 0, mult, use_mask)
    assert batch.input_ids.dtype == torch.int64 and batch.input_ids.shape == ids.shape and ids.shape[1] % mult == 0
    assert np.array_equal(batch.input_ids.numpy(), ids)
    assert np.array_equal(batch.labels.numpy(), lab)
    assert np.array_equal(batch.positions.numpy(), pos)
    assert batch.num_loss_tokens == int((lab != IGNORE_INDEX).sum())
    assert batch.num_real_tokens == sum(b - a for row in rows for _, a, b in row)


def test_docstring_example_and_padding_segment():
    store = memory_store([[1, 2, 9], [3, 9]])  # eos = 9 ends each document
    b = CausalCollator(pad_id=0, pad_to_multiple_of=1)(store, [[(0, 0, 3), (1, 0, 2)], [(1, 0, 2)]])
    assert b.input_ids.tolist() == [[1, 2, 9, 3, 9], [3, 9, 0, 0, 0]]
    assert b.labels.tolist() == [[2, 9, -100, 9, -100], [9, -100, -100, -100, -100]]
    assert b.positions.tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert (b.num_loss_tokens, b.num_real_tokens, b.num_slots) == (4, 7, 10)


def test_split_piece_restarts_positions_and_prompt_mask_is_by_position():
    # doc 0: prompt 5 6 (no loss as targets), response 7 EOS; an EOS id inside the prompt of doc 1
    store = memory_store([[5, 6, 7, EOS], [EOS, 4, EOS]], [[0, 0, 1, 1], [0, 1, 1]])
    b = CausalCollator(pad_id=EOS)(store, [[(0, 0, 2), (0, 2, 4)], [(1, 0, 3)]])
    assert b.positions.tolist() == [[0, 1, 0, 1], [0, 1, 2, 0]]
    # the first piece keeps 7 (the next piece's first token) as its last target: the cut loses nothing
    assert b.labels.tolist() == [[-100, 7, EOS, -100], [4, EOS, -100, -100]]


def test_bad_piece_is_a_clear_error():
    store = memory_store([[1, 2, 3]])
    with pytest.raises(ValueError, match="ends past the document"):
        CausalCollator(pad_id=0)(store, [[(0, 0, 5)]])


# --------------------------------------------------------------------------- book equivalence
FIXTURE_BATCHES = 10  # batches of each order whose items tests/fixtures keeps (make_fixtures.py)


@pytest.fixture(scope="module")
def book_items(book_ids):
    """(training items, {index: GPT-2 ids}, batches to check, token count per item): every item from
    ../shared/data (which must agree with tests/fixtures), else the fixture's items."""
    n_train, items, lengths = book_ids
    shared = shared_data_dir()
    if shared is None:
        return n_train, items, FIXTURE_BATCHES, lengths[:n_train]
    data = json.loads((shared / "instruction-data.json").read_text(encoding="utf-8"))
    train = data[: int(len(data) * 0.85)]
    ids = [e.ids for e in gpt2_tokenizer(shared / "gpt2").encode_batch([alpaca_text(r) for r in train])]
    stale = "tests/fixtures is stale: run tests/fixtures/make_fixtures.py"
    assert len(train) == n_train and all(ids[i] == x for i, x in items.items()), stale
    assert [len(x) for x in ids] == lengths[:n_train].tolist(), stale
    return n_train, dict(enumerate(ids)), None, lengths[:n_train]


def test_book_equivalence_on_its_own_data(book_items):
    """Our documents are the book's items plus the end-of-text prepare appends. With pad = eos = 50256,
    no prompt masking and one document per row, our batch is exactly one column wider than the
    book's (T = longest item + 1 vs longest item): on the book's columns inputs and targets are
    equal, and our extra column has no target. Batches: the book's own loader order
    (torch.manual_seed(123), shuffle, 8 rows, drop_last), and our `random` planner's (all of them
    with ../shared/data; the first 10 of each from tests/fixtures)."""
    n_train, items, limit, lengths = book_items
    keys = sorted(items)
    at = {k: j for j, k in enumerate(keys)}  # item index -> document of the store
    store = memory_store([items[k] + [EOS] for k in keys])
    ours = CausalCollator(pad_id=EOS, use_loss_mask=False)
    torch.manual_seed(123)
    loader = torch.utils.data.DataLoader(range(n_train), batch_size=8, shuffle=True, drop_last=True, collate_fn=list)
    book_batches = list(itertools.islice(loader, limit))
    widths = []
    plan = plan_epoch(lengths + 1, settings=PlanSettings(strategy="random", rows_per_batch=8), seed=123, epoch=0)
    our_batches = [[d for row in plan.batch(i) for d, _, _ in row] for i in range(plan.num_batches)][:limit]
    assert len(book_batches) >= FIXTURE_BATCHES and len(our_batches) >= FIXTURE_BATCHES
    for k, idx in enumerate(book_batches + our_batches):
        bi, bt = book_collate([items[i] for i in idx])
        b = ours(store, [[(at[i], 0, len(items[i]) + 1)] for i in idx])
        W = bi.shape[1]
        if k < len(book_batches):
            widths.append(W)
        assert b.input_ids.shape[1] == W + 1
        assert torch.equal(b.input_ids[:, :W], bi) and torch.equal(b.labels[:, :W], bt)
        assert (b.labels[:, W] == IGNORE_INDEX).all()
    assert widths[:10] == [61, 76, 73, 68, 65, 72, 80, 67, 62, 75]  # ../shared/data/README.md


def test_book_masks_by_value_we_mask_by_position(book_items):
    _, items, _, _ = book_items
    item = items[0][:10] + [EOS] + items[0][10:]  # an end-of-text id inside the text
    _, bt = book_collate([item, items[1]])
    store = memory_store([item + [EOS], items[1] + [EOS]])
    b = CausalCollator(pad_id=EOS, use_loss_mask=False)(store, [[(0, 0, len(item) + 1)], [(1, 0, len(items[1]) + 1)]])
    n = len(item)
    assert bt[0, 9] == EOS and b.labels[0, 9] == EOS  # the in-text id: both keep it
    assert bt[0, n - 1] == IGNORE_INDEX  # the book loses the real end-of-text target
    assert b.labels[0, n - 1] == EOS  # we keep it
    assert b.labels[0, n] == IGNORE_INDEX  # and never predict past the document


# ------------------------------------------------------------------------------------ masked LM
def _mlm_store():
    rng = np.random.default_rng(0)
    docs = [rng.integers(5, 1000, int(n)).tolist() + [2] for n in rng.integers(50, 300, 40)]
    return memory_store(docs, eos_id=2, pad_id=0, vocab_size=1000, mask_id=3, special_ids=(0, 1, 2, 3))


def test_mlm_hf_semantics_and_determinism():
    store = _mlm_store()
    coll = collator_from_config(
        type("C", (), {"mode": "mlm", "mlm_probability": 0.15, "pad_to_multiple_of": 8})(), store.meta, seed=5
    )
    rows = [[(d, 0, int(store.lengths[d]))] for d in range(40)]
    b = coll(store, rows, step=(1, 2))
    plain = CausalCollator(pad_id=0, pad_to_multiple_of=8)(store, rows)
    orig, sel = plain.input_ids, b.labels != IGNORE_INDEX
    real = plain.positions.new_zeros(plain.positions.shape, dtype=torch.bool)
    for r, n in enumerate(store.lengths.tolist()):
        real[r, :n] = True
    special = torch.isin(orig, torch.tensor([0, 1, 2, 3]))
    assert not (sel & (~real | special)).any(), "padding and special tokens are never selected"
    assert torch.equal(b.labels[sel], orig[sel])
    share = sel.sum().item() / (real & ~special).sum().item()
    assert 0.13 < share < 0.17
    masked = (b.input_ids == 3) & sel
    kept = (b.input_ids == orig) & sel
    assert 0.75 < masked.sum().item() / sel.sum().item() < 0.85
    assert 0.06 < kept.sum().item() / sel.sum().item() < 0.15  # 10% unchanged (+ random hits of itself)
    assert torch.equal(b.input_ids[~sel], orig[~sel])
    assert torch.equal(b.positions, plain.positions) and b.num_loss_tokens == int(sel.sum())
    again = coll(store, rows, step=(1, 2))
    assert torch.equal(again.input_ids, b.input_ids) and torch.equal(again.labels, b.labels)
    assert torch.equal(coll(store, rows, step=(1, 3)).labels, b.labels)  # the batch index does not matter
    other = coll(store, rows, step=(2, 2))
    assert not torch.equal(other.labels, b.labels)  # the epoch does: each epoch masks anew


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.data())
def test_mlm_masking_depends_only_on_seed_epoch_document_and_position(data):
    """The same document masks the same tokens alone, packed with others, split into pieces, in any
    row or batch: what makes mlm evaluation the same under every strategy and a step split over ranks
    the same as one process."""
    store = _mlm_store()
    coll = MaskedLMCollator(0, mask_id=3, vocab_size=1000, special_ids=(0, 1, 2, 3), mlm_probability=0.3, seed=7)
    alone = {}
    for d in range(len(store.lengths)):
        b = coll(store, [[(d, 0, int(store.lengths[d]))]], step=(4, 0))
        alone[d] = (b.input_ids[0].tolist(), b.labels[0].tolist())
    rows = []
    for _ in range(data.draw(st.integers(1, 4))):
        row = []
        for d in data.draw(st.lists(st.integers(0, len(store.lengths) - 1), min_size=1, max_size=3)):
            n = int(store.lengths[d])
            a = data.draw(st.integers(0, n - 1))
            row.append((d, a, data.draw(st.integers(a + 1, n))))
        rows.append(row)
    b = coll(store, rows, step=(4, data.draw(st.integers(0, 99))))
    for r, row in enumerate(rows):
        col = 0
        for d, a, z in row:
            assert b.input_ids[r, col : col + z - a].tolist() == alone[d][0][a:z]
            assert b.labels[r, col : col + z - a].tolist() == alone[d][1][a:z]
            col += z - a


def test_mlm_without_mask_token_is_a_clear_error():
    with pytest.raises(ConfigError, match="mask token.*batching.mode: causal"):
        MaskedLMCollator(pad_id=0, mask_id=None, vocab_size=10)


@pytest.mark.parametrize("mode", ["causal", "mlm"])
def test_stale_store_meta_is_a_one_line_data_error(mode):
    cfg = type("C", (), {"mode": mode, "mlm_probability": 0.15, "pad_to_multiple_of": 1})()
    meta = {"mask_id": 3, "vocab_size": 10} if mode == "causal" else {"eos_id": 2, "mask_id": 3}
    with pytest.raises(DataError, match="data.cache_dir") as e:
        collator_from_config(cfg, meta)
    assert "\n" not in str(e.value)


def test_empty_share_collates_to_an_empty_batch():
    """A rank with nothing left in the last step gets zero rows (see plan._shard)."""
    b = CausalCollator(pad_id=0)(memory_store([[1, 2, 3]]), [])
    assert b.input_ids.shape == (0, 0) and b.num_loss_tokens == b.num_real_tokens == 0


# ------------------------------------------------------------------------ split documents
split_docs_st = st.lists(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 1)), min_size=1, max_size=90), min_size=1, max_size=14
)


def _cuts(plan):
    """(batch index, row, column of the piece's last token, doc, stop) of every piece that stops inside its document."""
    out = []
    for i in range(plan.num_batches):
        for r, row in enumerate(plan.batch(i)):
            col = 0
            for d, a, b in row:
                col += b - a
                out.append((i, r, col - 1, d, b))
    return out


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    split_docs_st,
    st.sampled_from(["packed", "token_budget"]),
    st.sampled_from([2, 3, 7, 16, 64]),
    st.booleans(),
    st.integers(0, 3),
)
def test_split_plan_keeps_every_target_of_the_unsplit_documents(docs, strategy, seq_len, use_mask, seed):
    """Issue 8, item 1: a 10-token document cut 4/4/2 carries 9 targets whichever way it is cut. Loss
    tokens of all batches of a split plan == loss tokens of the same documents collated whole, and the
    label at every cut is the next token of the document (or -100 where the loss mask says so)."""
    store = memory_store([[t for t, _ in d] for d in docs], [[m for _, m in d] for d in docs], eos_id=20, pad_id=0)
    s = PlanSettings(
        strategy=strategy, seq_len=seq_len, max_tokens_per_batch=max(seq_len, 16), long_docs="split", rows_per_batch=3
    )
    plan = plan_epoch(store.lengths, settings=s, seed=seed, epoch=0)
    coll = CausalCollator(pad_id=0, use_loss_mask=use_mask)
    batches = [coll(store, plan.batch(i)) for i in range(plan.num_batches)]
    whole = coll(store, [[(d, 0, int(n))] for d, n in enumerate(store.lengths)])
    assert sum(b.num_loss_tokens for b in batches) == whole.num_loss_tokens
    assert sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches) == whole.num_loss_tokens
    for i, r, col, d, stop in _cuts(plan):
        n, off = int(store.lengths[d]), int(store.offsets[d])
        label = int(batches[i].labels[r, col])
        if stop == n:
            assert label == IGNORE_INDEX, "the document's last token predicts nothing"
        elif use_mask and not store.loss_mask[off + stop]:
            assert label == IGNORE_INDEX
        else:
            assert label == int(store.tokens[off + stop]), "a cut keeps the next token as its target"


def test_ten_token_document_cut_four_four_two_keeps_nine_targets():
    """The issue's example, by hand: pieces (0,4), (4,8), (8,10) of one 10-token document."""
    store = memory_store([list(range(1, 10)) + [EOS]])
    b = CausalCollator(pad_id=0)(store, [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 10)]])
    assert b.labels.tolist() == [[2, 3, 4, 5], [6, 7, 8, 9], [EOS, -100, -100, -100]]
    assert b.num_loss_tokens == 9 == CausalCollator(pad_id=0)(store, [[(0, 0, 10)]]).num_loss_tokens


# ------------------------------------------------------------------------ the planner's facts
@settings(max_examples=40, deadline=None, derandomize=True)
@given(split_docs_st, st.data(), st.sampled_from([1, 8]), st.booleans())
def test_batch_carries_single_doc_rows_max_position_and_documents(docs, data, mult, mlm):
    store = memory_store(
        [[t for t, _ in d] for d in docs], eos_id=20, pad_id=0, vocab_size=30, mask_id=21, special_ids=(0, 20, 21)
    )
    n = len(docs)
    rows = _draw_rows(data, store, n)
    if mlm:
        b = MaskedLMCollator(0, mask_id=21, vocab_size=30, special_ids=(0, 20), mlm_probability=0.3, pad_to_multiple_of=mult)(
            store, rows
        )
    else:
        b = CausalCollator(pad_id=0, pad_to_multiple_of=mult)(store, rows)
    assert b.single_doc_rows == all(len(r) == 1 for r in rows)
    assert b.max_position == int(b.positions.max())
    assert b.documents == tuple(sorted({d for r in rows for d, _, _ in r}))
    assert all(type(d) is int for d in b.documents)
    # the segment bounds attention kernels take: every piece and padding run, over the flattened rows
    cu, longest = segment_bounds(b.positions)
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == cu.tolist() and b.max_seqlen == longest


def test_planner_facts_by_hand():
    store = memory_store([[1, 2, 9], [3, 9], [4, 5, 6, 7, 9]])
    coll = CausalCollator(pad_id=0)
    one = coll(store, [[(2, 0, 5)], [(0, 0, 3)]])
    assert (one.single_doc_rows, one.max_position, one.documents) == (True, 4, (0, 2))
    packed = coll(store, [[(0, 0, 3), (1, 0, 2)], [(2, 1, 3)]])
    assert (packed.single_doc_rows, packed.max_position, packed.documents) == (False, 2, (0, 1, 2))
    # a short row's padding run is longer than any piece: max_position is still the largest position
    padded = coll(store, [[(2, 0, 5)], [(1, 0, 1)]])
    assert padded.positions[1].tolist() == [0, 0, 1, 2, 3] and padded.max_position == 4
    assert coll(store, [[(1, 0, 1)], [(1, 0, 1)]]).documents == (1,)
    # rows of 5: pieces of 3 and 2; a piece of 2, then 3 of padding
    bounds = coll(store, [[(0, 0, 3), (1, 0, 2)], [(2, 1, 3)]])
    assert bounds.cu_seqlens.tolist() == [0, 3, 5, 7, 10] and bounds.max_seqlen == 3
    assert coll(store, []).cu_seqlens.tolist() == [0]


def test_mlm_probability_zero_is_refused_at_load():
    from densebatch.config import load_config
    from densebatch.errors import ConfigError

    for p in ("0", "1", "-0.1"):
        with pytest.raises(ConfigError, match="batching.mlm_probability"):
            load_config(None, [f"--batching.mlm_probability={p}"])


def test_source_ids_follow_the_batch_to_a_device():
    from densebatch.data.store.store import DocumentStore

    store = DocumentStore.from_documents([([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1])], {"sources": ["x", "y"]}, source=[0, 1])
    batch = CausalCollator(0)(store, [[(0, 0, 3), (1, 0, 2)], [(1, 0, 2)]])
    assert batch.source_ids.tolist() == [[0, 0, 0, 1, 1], [1, 1, -1, -1, -1]]
    assert torch.equal(batch.to("cpu").source_ids, batch.source_ids)
    assert CausalCollator(0)(DocumentStore.from_documents([([1, 2], [0, 1])]), [[(0, 0, 2)]]).source_ids is None
