"""inspect: decoded documents with loss-carrying tokens marked, plain and coloured."""

from __future__ import annotations

import pytest

from densebatch.data.inspect import render_documents
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.tokenizers import load_tokenizer
from densebatch.data.store.store import DocumentStore
from densebatch.errors import DataError


def test_plain_marking_of_loss_spans():
    tok = load_tokenizer("default")
    store = DocumentStore.from_documents([(list(b"Q: hi\nA: yo") + [256], [0] * 9 + [1, 1, 1])])
    out = render_documents(store, tok, [0], color=False)
    assert "Q: hi\nA: [[yo<|endoftext|>]]" in out
    assert "document 0: 12 tokens, 3 carry loss" in out


def test_colour_marking_and_range_errors(data_cfg, tmp_path, records, write_jsonl):
    p = prepare(data_cfg(path=str(write_jsonl(tmp_path / "a.jsonl", records))))
    out = render_documents(p.train, p.tokenizer, range(len(p.train)), color=True)
    assert "\x1b[32mCAT<|endoftext|>\x1b[0m" in out and "[[" not in out
    with pytest.raises(DataError, match="does not exist"):
        render_documents(p.train, p.tokenizer, [99])
