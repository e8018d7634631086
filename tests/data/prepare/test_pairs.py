"""Preference pairs in prepare: TRL's formats from every record format, through the templates, stored as one unit
(prompt once, then each answer: data/store/pair_layout.py); bad pairs counted or named; the length rule;
inspect shows the three parts; the streamed store equals the in-memory one."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from in_memory_prepare import in_memory

from densebatch.config import DataConfig
from densebatch.data.inspect import render_documents
from densebatch.data.prepare.default_dataset import as_pair, generate_records
from densebatch.data.prepare.pair_documents import finish_pair
from densebatch.data.prepare.pairs import pair_segments
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.templates import IM_END, IM_START, RecordError, alpaca_prompt
from densebatch.data.store.pair_layout import CHOSEN, REJECTED, loss_bit, pair_document, pair_spans, part_of
from densebatch.errors import DataError

PAIRS = [
    {"prompt": "Name a color.", "chosen": "Blue.", "rejected": "Seven."},
    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5, or so I think"},
    {"prompt": "Say hi.", "chosen": "hi", "rejected": "no"},
]
CHATS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
        "chosen": [{"role": "assistant", "content": "Hello."}],
        "rejected": [{"role": "assistant", "content": "Go away."}],
    },
    {
        "prompt": [{"role": "user", "content": "2+2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "22"}],
    },
]


def _cfg(data_cfg, path, **kw) -> DataConfig:
    return data_cfg(path=str(path), pairs=True, **kw)


def _stored(store) -> list[tuple[list, list, list]]:
    """Each stored pair as (prompt tokens, chosen answer tokens, rejected answer tokens)."""
    out = []
    for i in range(len(store)):
        t, m = (np.asarray(x) for x in store.document(i))
        prefix, c, _ = pair_spans(m, [len(m)])[0]
        out.append((t[: prefix + 1].tolist(), t[prefix + 1 : prefix + c].tolist(), t[prefix + c + 1 :].tolist()))
    return out


def _write(tmp_path, fmt: str, records: list[dict]):
    path = tmp_path / f"pairs.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif fmt == "json":
        path.write_text(json.dumps(records), encoding="utf-8")
    elif fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(records[0]))
            w.writeheader()
            w.writerows(records)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    else:  # a save_to_disk dataset
        import datasets

        path = tmp_path / "pairs_ds"
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "hf_disk"])
def test_string_pairs_from_every_format_are_stored_alike(tmp_path, data_cfg, fmt):
    want = _stored(prepare(_cfg(data_cfg, _write(tmp_path, "jsonl", PAIRS))).train)
    got = prepare(_cfg(data_cfg, _write(tmp_path, fmt, PAIRS), cache_dir=str(tmp_path / fmt))).train
    assert got.meta["pairs"] is True and _stored(got) == want


def test_a_stored_pair_is_its_prompt_once_then_each_answer_with_the_loss_on_the_answers(tmp_path, data_cfg):
    prepared = prepare(_cfg(data_cfg, _write(tmp_path, "jsonl", PAIRS)))
    tok, store = prepared.tokenizer, prepared.train
    for rec, (prompt, chosen, rejected) in zip(PAIRS, _stored(store)):
        assert prompt == tok.encode(alpaca_prompt(rec["prompt"]))  # once, with no loss
        assert chosen == tok.encode(rec["chosen"]) + [tok.eos_id]
        assert rejected == tok.encode(rec["rejected"]) + [tok.eos_id]
    t, m = store.document(0)
    part, bit = part_of(np.asarray(m)), loss_bit(np.asarray(m))
    prefix = int((part == 0).sum())
    assert (bit[: prefix + 1] == 0).all()  # the prompt's tokens (and the branch's opening one) are no target
    assert part[prefix] == CHOSEN and bit[part == CHOSEN].sum() == len(_stored(store)[0][1])
    assert int(store.doc_loss_tokens[0]) == int(bit.sum())  # the store counts the loss bit only


def test_implicit_prompts_are_the_common_start_as_trl_extracts_them(tmp_path, data_cfg):
    """TRL's implicit format: the prompt is the longest common start (messages, or characters with a space
    before the cut going to the answers); stored exactly as the explicit pair."""
    text = [
        {"chosen": r["prompt"] + " " + r["chosen"].lstrip(), "rejected": r["prompt"] + " " + r["rejected"].lstrip()}
        for r in PAIRS
    ]
    explicit = [
        {"prompt": r["prompt"], "chosen": " " + r["chosen"].lstrip(), "rejected": " " + r["rejected"].lstrip()} for r in PAIRS
    ]
    cfg = _cfg(data_cfg, _write(tmp_path, "jsonl", text), template="raw")
    ref = _cfg(data_cfg, _write(tmp_path, "json", explicit), template="raw", cache_dir=str(tmp_path / "e"))
    assert _stored(prepare(cfg).train) == _stored(prepare(ref).train)
    chats = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CHATS]
    cfg = _cfg(data_cfg, _write(tmp_path, "jsonl", chats), template="chatml", cache_dir=str(tmp_path / "c1"))
    ref = _cfg(data_cfg, _write(tmp_path, "json", CHATS), template="chatml", cache_dir=str(tmp_path / "c2"))
    assert _stored(prepare(cfg).train) == _stored(prepare(ref).train)


def test_chat_pairs_through_chatml_cut_where_the_reply_begins():
    cfg = DataConfig(template="chatml", pairs=True)
    p = pair_segments(CHATS[0], cfg, lambda s: s)
    prompt = f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHi?{IM_END}\n{IM_START}assistant\n"
    assert p.prompt == [(prompt, False)]
    assert p.chosen == [(f"Hello.{IM_END}", True), ("\n", False)]
    assert p.rejected == [(f"Go away.{IM_END}", True), ("\n", False)]
    # a string pair under chatml: the prompt a user message, each answer an assistant reply
    s = pair_segments(PAIRS[2], cfg, lambda s: s)
    assert s.prompt == [(f"{IM_START}user\nSay hi.{IM_END}\n{IM_START}assistant\n", False)]
    assert s.chosen[0] == (f"hi{IM_END}", True)


def test_chat_pairs_through_the_tokenizers_own_template_match_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    import shutil

    from densebatch.data.prepare.chat_template import ChatTemplate
    from densebatch.data.prepare.tokenizer_files import byte_level_tokenizer
    from densebatch.data.prepare.tokenizers import load_tokenizer

    d = tmp_path / "llama3"
    d.mkdir()
    fixtures = __import__("pathlib").Path(__file__).resolve().parent / "chat_templates"
    shutil.copy(fixtures / "llama3" / "tokenizer_config.json", d)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    byte_level_tokenizer(specials, []).save(str(d / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(d))
    chat = ChatTemplate.of(load_tokenizer(str(d)))
    rec = CHATS[0]
    p = pair_segments(rec, DataConfig(template="chat_template", pairs=True), lambda s: s, chat)
    prompt = auto.apply_chat_template(rec["prompt"], tokenize=False, add_generation_prompt=True)
    assert p.prompt == [(prompt, False)]  # TRL's prompt: the template's generation prompt
    for key, segs in (("chosen", p.chosen), ("rejected", p.rejected)):
        whole = auto.apply_chat_template(rec["prompt"] + rec[key], tokenize=False)
        assert prompt + "".join(t for t, _ in segs) == whole  # TRL's completion: the rest of the whole
        assert segs[0][1] and rec[key][0]["content"] in segs[0][0]


def test_alpaca_takes_the_instruction_when_there_is_no_prompt_field_and_custom_its_format():
    rec = {"instruction": "Add.", "input": "2 + 2", "chosen": "4", "rejected": "5"}
    p = pair_segments(rec, DataConfig(pairs=True), lambda s: s)
    assert p.prompt == [(alpaca_prompt("Add.", "2 + 2"), False)] and p.chosen == [("4", True)]
    cfg = DataConfig(template="custom", prompt_format="Q: {question}\nA:", pairs=True)
    p = pair_segments({"question": "2+2?", "chosen": " 4", "rejected": " 5"}, cfg, lambda s: s)
    assert p.prompt == [("Q: 2+2?\nA:", False)] and p.rejected == [(" 5", True)]
    # loss_on all: the whole answer carries loss, never the prompt
    cfg = DataConfig(template="chatml", pairs=True, loss_on="all")
    p = pair_segments(CHATS[1], cfg, lambda s: s)
    assert p.chosen == [(f"4{IM_END}\n", True)] and p.prompt[0][1] is False


@pytest.mark.parametrize(
    "rec, reason",
    [
        ({"prompt": "Q", "chosen": "same", "rejected": "same"}, "identical_answers"),
        ({"prompt": "Q", "chosen": "  ", "rejected": "b"}, "empty_answer"),
        ({"prompt": "Q", "chosen": "a"}, "missing_field"),
        ({"prompt": "Q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}, "wrong_type"),
        ({**CHATS[1], "rejected": [{"role": "assistant", "content": " "}]}, "empty_answer"),
    ],
)
def test_bad_pairs_are_record_errors_with_their_reason(rec, reason):
    with pytest.raises(RecordError) as e:
        pair_segments(rec, DataConfig(template="chatml", pairs=True), lambda s: s)
    assert e.value.reason == reason


def test_bad_pairs_are_counted_skips_or_one_line_errors_as_the_user_chose(tmp_path, data_cfg):
    long_prompt = {"prompt": "x " * 200, "chosen": "a", "rejected": "b"}
    bad = [{"prompt": "Q", "chosen": "same", "rejected": "same"}, {"prompt": "Q", "chosen": "", "rejected": "b"}, long_prompt]
    path = _write(tmp_path, "jsonl", PAIRS + bad)
    prepared = prepare(_cfg(data_cfg, path, on_bad_record="skip", max_seq_len=64, template="raw"))
    assert prepared.summary.skipped == {"identical_answers": 1, "empty_answer": 1, "prompt_too_long": 1}
    assert len(prepared.train) == len(PAIRS)
    with pytest.raises(DataError) as e:
        prepare(_cfg(data_cfg, path, max_seq_len=64, template="raw", cache_dir=str(tmp_path / "e")))
    assert "pairs.jsonl:4" in str(e.value) and "\n" not in str(e.value)


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(1, 30),
    chosen=st.integers(1, 30),
    rejected=st.integers(1, 30),
    max_len=st.integers(4, 80),
)
def test_the_length_rule_keeps_the_prompt_and_cuts_the_answers_ends(prompt, chosen, rejected, max_len):
    """A pair longer than data.max_seq_len (as laid out) keeps its whole prompt and the starts of both answers,
    each at least one token; it fits after the cut; shorter pairs are untouched; drop drops."""
    p, c, r = np.arange(prompt) + 100, np.arange(chosen) + 200, np.arange(rejected) + 300
    tokens, mask = pair_document(p, c, r, chosen_loss=np.ones(chosen), rejected_loss=np.ones(rejected))
    assert len(tokens) == prompt + chosen + rejected + 1
    cfg = DataConfig(max_seq_len=max_len, pairs=True)
    if prompt + 3 > max_len:
        return  # a bad pair (prompt_too_long) before this rule
    t, m, cut = finish_pair(tokens, mask, cfg)
    assert len(t) <= max_len and cut == (len(tokens) > max_len)
    prefix, kc, kr = pair_spans(m, [len(m)])[0]
    assert prefix == prompt - 1 and kc >= 2 and kr >= 2
    assert t[: prefix + kc].tolist() == tokens[: prefix + kc].tolist()  # the chosen branch's start
    assert t[prefix + kc :].tolist() == tokens[prefix + chosen + 1 : prefix + chosen + 1 + kr].tolist()
    dropped = finish_pair(tokens, mask, DataConfig(max_seq_len=max_len, overlong="drop", pairs=True))
    assert (dropped is None) == cut


def test_inspect_shows_a_pair_with_its_three_parts_marked(tmp_path, data_cfg):
    prepared = prepare(_cfg(data_cfg, _write(tmp_path, "jsonl", PAIRS), template="raw"))
    text = render_documents(prepared.train, prepared.tokenizer, [1])
    assert "3 pairs" in text and "--- pair 1:" in text
    assert "[prompt: " in text and "\n2 + 2 =\n" in text
    assert "[chosen: 3 tokens]\n[[ 4<|endoftext|>]]" in text.replace("<|endoftext|>", "<|endoftext|>")
    assert "[rejected: " in text and "[[ 5, or so I think" in text


def test_the_embedded_default_pairs_prefer_the_right_answer_over_a_wrong_one():
    records = generate_records(200, 1)
    pairs = [as_pair(r, i, 1) for i, r in enumerate(records)]
    assert all(p["chosen"] == r["output"] != p["rejected"] for p, r in zip(pairs, records))
    assert {p["rejected"] for p in pairs if p["task"] == "color"} <= {"red", "green", "blue", "yellow"}
    assert pairs == [as_pair(r, i, 1) for i, r in enumerate(generate_records(200, 1))]  # from the seed


def test_the_streamed_pair_store_is_the_in_memory_one_byte_for_byte(tmp_path, data_cfg, monkeypatch):
    recs = [
        {"prompt": f"Task {i}: " + "w " * (i % 17), "chosen": f"yes {i}" * (1 + i % 3), "rejected": f"no {i}"} for i in range(300)
    ]
    recs[7] = {"prompt": "Q", "chosen": "same", "rejected": "same"}
    path = _write(tmp_path, "jsonl", recs)
    kw = dict(eval_fraction=0.1, on_bad_record="skip", max_seq_len=40, chunk_records=64, num_proc=2, template="raw")
    with monkeypatch.context() as m:
        in_memory(m)
        ref = prepare(_cfg(data_cfg, path, cache_dir=str(tmp_path / "ref"), **kw))
    got = prepare(_cfg(data_cfg, path, cache_dir=str(tmp_path / "got"), **kw))
    for split in ("train", "eval"):
        a, b = getattr(ref, split), getattr(got, split)
        assert _stored(a) == _stored(b) and np.array_equal(np.asarray(a.loss_mask), np.asarray(b.loss_mask))
    assert ref.summary.truncated == got.summary.truncated > 0


def test_pair_spans_counts_each_part():
    t, m = pair_document(np.array([5, 6, 7]), np.array([8, 9]), np.array([10]), chosen_loss=[1, 1], rejected_loss=[0])
    assert t.tolist() == [5, 6, 7, 8, 9, 7, 10]
    assert pair_spans(m, [len(m)]).tolist() == [[2, 3, 2]]
    assert part_of(m).tolist() == [0, 0, CHOSEN, CHOSEN, CHOSEN, REJECTED, REJECTED]
    assert loss_bit(m).tolist() == [0, 0, 0, 1, 1, 0, 0]
