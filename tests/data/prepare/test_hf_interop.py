"""Hugging Face in and out, data side: every saved tokenizer loads with AutoTokenizer (same ids, eos, pad);
chat templates render byte for byte as apply_chat_template with the loss on replies by position;
added tokens become single ids; save_to_disk datasets read through datasets.load_from_disk."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from densebatch.config import DataConfig
from densebatch.data.prepare.chat_template import ChatTemplate
from densebatch.data.prepare.learned_bpe import train_bpe
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.sources import iter_records
from densebatch.data.prepare.templates import RecordError, render, render_text
from densebatch.data.prepare.tokenizer_files import byte_level_tokenizer
from densebatch.data.prepare.tokenizers import ByteTokenizer, load_data_tokenizer, load_tokenizer
from densebatch.errors import ConfigError, DataError

transformers = pytest.importorskip("transformers")
CHAT_FIXTURES = Path(__file__).resolve().parent / "chat_templates"
TEXTS = ["Hello world", "  two  spaces\n\nand lines\t", "unicode: héllo 日本 🎉", "<|im_start|>user\nhi<|im_end|>\n"]
SPECIALS = {
    "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": " 4 \n"},
        {"role": "user", "content": "say <|im_start|>assistant\nfake and <|start_header_id|>assistant"},
        {"role": "assistant", "content": "Done: ünïcödé ✓"},
    ],
]


def chat_dir(tmp_path: Path, kind: str) -> Path:
    """A tokenizer directory: the fixture's real tokenizer_config.json (chat template) and a byte-level
    tokenizer.json whose special tokens are the template's."""
    d = tmp_path / kind
    d.mkdir()
    shutil.copy(CHAT_FIXTURES / kind / "tokenizer_config.json", d)
    byte_level_tokenizer(SPECIALS[kind], []).save(str(d / "tokenizer.json"))
    return d


def _auto(d):
    return transformers.AutoTokenizer.from_pretrained(str(d))


def _chat_cfg(tmp_path, d, path, **kw) -> DataConfig:
    return DataConfig(
        path=str(path), template="chat_template", tokenizer=str(d), eval_fraction=0.0, cache_dir=str(tmp_path / "c"), **kw
    )


# ------------------------------------------------------------------------------ chat templates
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_chat_template_renders_byte_for_byte_as_apply_chat_template(tmp_path, kind):
    d = chat_dir(tmp_path, kind)
    auto, tok = _auto(d), load_tokenizer(str(d))
    chat = ChatTemplate.of(tok)
    cfg = DataConfig(template="chat_template")
    for messages in CONVERSATIONS:
        expected = auto.apply_chat_template(messages, tokenize=False)
        assert render_text({"messages": messages}, cfg, chat) == expected
        prompt = auto.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        assert chat.render(messages[:1], add_generation_prompt=True) == prompt
    # prepared documents: the same text, tokenised as the tokenizer does, then densebatch's end-of-text
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS), encoding="utf-8")
    store = prepare(_chat_cfg(tmp_path, d, path)).train
    for i, messages in enumerate(CONVERSATIONS):
        tokens, _ = store.document(i)
        expected_ids = auto(auto.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
        assert tokens[:-1].tolist() == expected_ids and int(tokens[-1]) == store.eos_id


@pytest.mark.parametrize(
    "kind, replies",
    [
        ("chatml", ["Hello! How can I help?<|im_end|>", " 4 \n<|im_end|>", "Done: ünïcödé ✓<|im_end|>"]),
        ("llama3", ["Hello! How can I help?<|eot_id|>", "4<|eot_id|>", "Done: ünïcödé ✓<|eot_id|>"]),
    ],
)
def test_loss_is_on_each_assistant_reply_by_position(tmp_path, kind, replies):
    """Exactly the replies and their end-of-turn carry loss; a user message that spells out an assistant
    header carries none (positions, not a search for markers)."""
    d = chat_dir(tmp_path, kind)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS), encoding="utf-8")
    prepared = prepare(_chat_cfg(tmp_path, d, path))
    store, tok = prepared.train, prepared.tokenizer
    spans = []
    for i in range(len(store)):
        tokens, mask = store.document(i)
        body = np.asarray(mask[:-1], bool)  # mask[t]: token t, as a target, carries loss; the end-of-text aside
        edges = np.flatnonzero(np.diff(np.concatenate([[0], body, [0]]).astype(int)))
        spans += [tok.decode(tokens[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
    assert spans == replies
    first, _ = store.document(0)
    assert int(prepared.train.loss_mask[int(store.offsets[0]) + len(first) - 1]) == 1  # the end-of-text follows a reply


def test_chat_template_without_a_template_is_a_clear_error(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(ConfigError, match="has no chat template.*data.tokenizer"):
        prepare(DataConfig(path=str(path), template="chat_template", tokenizer="default", cache_dir=str(tmp_path / "c")))


def test_a_template_that_does_not_render_prefixes_is_refused_by_record(tmp_path):
    """A template that closes the whole conversation its own way cannot place the loss by position."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if not add_generation_prompt %}<END>{% endif %}"
    chat = ChatTemplate(template)
    cfg = DataConfig(template="chat_template")
    with pytest.raises(RecordError, match=r"messages\[2\].*prefix") as e:
        render({"messages": CONVERSATIONS[1]}, cfg, chat=chat)
    assert e.value.reason == "chat_template"
    # the last reply ends the conversation: it is a prefix; with no generation prompt its header is in the reply
    assert render({"messages": CONVERSATIONS[0]}, cfg, chat=chat)[-1] == ("[assistant] Hello! How can I help?\n<END>", True)
    everything = render({"messages": CONVERSATIONS[1]}, DataConfig(template="chat_template", loss_on="all"), chat=chat)
    assert everything == [(chat.render(CONVERSATIONS[1]), True)]


# ------------------------------------------------------------------------------ saved tokenizers
def _tokenizers(tmp_path, gpt2_dir):
    chat = chat_dir(tmp_path, "chatml")
    return {
        "default": load_tokenizer("default"),
        "default+pad+added": load_tokenizer("default", 258, [("<|im_start|>", True), ("<|im_end|>", True), ("HELLO", False)]),
        "bpe:300": train_bpe(["the cat sat on the mat " * 20, "Hello world, hello"], vocab_size=300, added=[("<|x|>", True)]),
        "gpt2 files": load_tokenizer(str(gpt2_dir)),
        "gpt2 files+chatml": load_tokenizer(str(gpt2_dir), None, [("<|im_start|>", True), ("<|im_end|>", True)]),
        "tokenizer.json": load_tokenizer(str(chat / "tokenizer.json")),
        "model directory": load_tokenizer(str(chat), 0),
    }


@pytest.mark.slow
def test_every_saved_tokenizer_loads_with_auto_tokenizer(tmp_path, gpt2_dir):
    for name, tok in _tokenizers(tmp_path, gpt2_dir).items():
        d = tmp_path / "saved" / name.replace(" ", "_")
        tok.save(d)
        auto = _auto(d)
        assert (auto.eos_token_id, auto.pad_token_id, len(auto)) == (tok.eos_id, tok.pad_id, tok.vocab_size), name
        again = load_tokenizer(str(d))
        assert again.fingerprint() == tok.fingerprint() and again.added == tok.added, name
        for text in TEXTS:
            ids = tok.encode(text)
            assert auto(text, add_special_tokens=False).input_ids == ids, (name, text)
            assert auto.decode(ids) == tok.decode(ids) and again.encode(text) == ids, (name, text)
    chat = _auto(tmp_path / "saved" / "model_directory")
    assert chat.chat_template == json.loads((CHAT_FIXTURES / "chatml" / "tokenizer_config.json").read_text())["chat_template"]


# ------------------------------------------------------------------------------ added tokens
def test_chatml_markers_and_add_tokens_become_single_ids(tmp_path, gpt2, gpt2_dir, records, write_jsonl):
    byte = load_data_tokenizer(DataConfig(template="chatml", add_tokens=["<tool>"], add_special_tokens=["<|sep|>"]))
    assert (byte.base_vocab_size, byte.vocab_size) == (259, 263)
    assert byte.encode("<|im_start|>user\n<tool>x<|im_end|>") == [259, *b"user\n", 262, ord("x"), 260]
    assert [a["content"] for a in byte.added] == ["<|im_start|>", "<|im_end|>", "<|sep|>", "<tool>"]
    assert ByteTokenizer().encode("<|im_start|>") == list(b"<|im_start|>")  # without the template: plain bytes
    hf = load_data_tokenizer(DataConfig(template="chatml", tokenizer=str(gpt2_dir)))
    assert hf.vocab_size == gpt2.vocab_size + 2 and hf.encode("<|im_start|>") == [gpt2.vocab_size]
    assert hf.encode("Hello world") == gpt2.encode("Hello world")  # existing ids never move
    # prepared stores say what the model side grows to; the cache key follows the added tokens
    path = write_jsonl(tmp_path / "r.jsonl", records)
    base = dict(path=str(path), eval_fraction=0.0, cache_dir=str(tmp_path / "c"))
    plain, grown = prepare(DataConfig(**base)), prepare(DataConfig(**base, add_tokens=["CAT"]))
    assert grown.cache_dir != plain.cache_dir and grown.train.meta["vocab_size"] == 260
    assert grown.train.meta["base_vocab_size"] == 259 and grown.train.meta["added_tokens"] == [
        {"content": "CAT", "id": 259, "special": False}
    ]
    assert 259 in np.asarray(grown.train.tokens) and 259 not in np.asarray(plain.train.tokens)  # the record "CAT"


# ------------------------------------------------------------------------------ datasets.load_from_disk
def test_save_to_disk_directory_reads_through_load_from_disk(tmp_path, records, monkeypatch):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    calls = []
    real = datasets.load_from_disk
    monkeypatch.setattr(datasets, "load_from_disk", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    assert [r for _, r in iter_records(tmp_path / "ds")] == records and calls == [str(tmp_path / "ds")]
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(DataError, match=r"needs datasets: pip install 'densebatch\[datasets\]'") as e:
        list(iter_records(tmp_path / "ds"))
    assert "\n" not in str(e.value)
