"""Tokenizers: byte-level default, GPT-2 BPE files, tokenizer.json / HF model dirs, save/load round trips."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.data.prepare.tokenizers import ByteTokenizer, load_tokenizer
from densebatch.errors import ConfigError


@given(st.text())
@settings(max_examples=200, deadline=None, derandomize=True)
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_specials_and_defaults():
    tok = load_tokenizer("default")
    assert (tok.eos_id, tok.mask_id, tok.vocab_size, tok.pad_id) == (256, 257, 259, 256)
    assert tok.decode([104, 105, 256]) == "hi<|endoftext|>"
    # Special-token strings in text are plain bytes for the byte-level tokenizer.
    assert 256 not in tok.encode("<|endoftext|>")
    assert load_tokenizer("default", pad_id=258).pad_id == 258
    assert tok.encode_batch(["a", "bc"]) == [tok.encode("a"), tok.encode("bc")]


def test_pad_id_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match="data.pad_id"):
        load_tokenizer("default", pad_id=9999)


def test_byte_tokenizer_save_load(tmp_path):
    load_tokenizer("default", pad_id=258).save(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(tok, ByteTokenizer) and tok.pad_id == 258 and tok.fingerprint() == "byte-v1"


def test_unknown_spec_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))


def test_gpt2_bpe_files(gpt2):
    assert gpt2.eos_id == 50256 and gpt2.pad_id == 50256 and gpt2.vocab_size == 50257
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("<|endoftext|>") == [50256]  # as Hugging Face's GPT2TokenizerFast


@given(st.text(max_size=200))
@settings(max_examples=50, deadline=None, derandomize=True)
def test_gpt2_round_trips_text(gpt2, text):
    assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_save_load_round_trip(gpt2, tmp_path):
    gpt2.save(tmp_path / "tok")
    back = load_tokenizer(str(tmp_path / "tok"))
    assert (back.eos_id, back.pad_id, back.vocab_size) == (50256, 50256, 50257)
    assert back.fingerprint() == gpt2.fingerprint()
    text = "Below is an instruction.\n\n### Response:\nDone — café!"
    assert back.encode(text) == gpt2.encode(text)


def _tiny_tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "<mask>": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_tokenizer_json_file_and_model_dir(tmp_path):
    _tiny_tokenizer_json(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))  # eos found by its well-known name
    assert tok.eos_id == 1 and tok.mask_id == 4 and tok.encode("hello world") == [2, 3]
    # A model directory whose tokenizer_config.json names the end-of-text token.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "world"}}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_id == 3 and tok.pad_id == 3
    tok.save(tmp_path / "saved")
    assert load_tokenizer(str(tmp_path / "saved")).eos_id == 3


def test_a_tokenizer_that_encodes_text_to_no_ids_is_refused(tmp_path):
    """What transformers 5.25's GPT2TokenizerFast(vocab_file=..., merges_file=...).save_pretrained wrote: a
    byte-level BPE with an empty vocabulary, its end-of-text an added token; datatrove then wrote each document
    as its end-of-text alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="encodes text to no ids") as e:
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert "\n" not in str(e.value)


def test_tokenizer_json_without_eos_is_a_config_error(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="end-of-text"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


# ----------------------------------------------------------------------------- bpe:N (learned)
def test_learned_bpe_is_deterministic_and_round_trips(tmp_path):
    from densebatch.data.prepare.learned_bpe import train_bpe

    texts = [f"Below is an instruction number {i}. Write a response." for i in range(300)]
    a, b = train_bpe(texts, vocab_size=400), train_bpe(texts, vocab_size=400)
    assert a.fingerprint() == b.fingerprint()
    assert a.vocab_size <= 400 and a.decode([a.eos_id]) == "<|endoftext|>" and a.mask_id is not None
    ids = a.encode("Below is an instruction — ünïcode too")
    assert a.decode(ids) == "Below is an instruction — ünïcode too"  # byte-level: every byte encodable
    assert len(a.encode(texts[0])) < len(texts[0].encode()) / 2  # frequent strings became single ids
    a.save(tmp_path / "tok")
    c = load_tokenizer(tmp_path / "tok")
    assert c.encode(texts[5]) == a.encode(texts[5]) and c.eos_id == a.eos_id


def test_learned_bpe_spec_errors():
    from densebatch.errors import ConfigError

    for spec in ("bpe:x", "bpe:10"):
        with pytest.raises(ConfigError, match="bpe:N"):
            load_tokenizer(spec)


def test_prepare_learns_and_caches_bpe(tmp_path):
    from densebatch.config import load_config
    from densebatch.data.prepare.pipeline import prepare

    cfg = load_config(None, ["--data.tokenizer=bpe:600", f"--data.cache_dir={tmp_path}", "--data.default.num_records=300"]).data
    first = prepare(cfg)
    again = prepare(cfg)
    assert not first.summary.cache_hit and again.summary.cache_hit
    assert again.tokenizer.fingerprint() == first.tokenizer.fingerprint()
    assert first.train.meta["vocab_size"] == first.tokenizer.vocab_size <= 600
    tokens, _ = again.train.document(0)
    assert tokens[-1] == again.tokenizer.eos_id
    assert "### Response:" in again.tokenizer.decode(tokens.tolist())


def test_auto_resolves_to_the_model_directory_tokenizer(tmp_path):
    from densebatch.data.prepare.tokenizers import has_tokenizer_files, resolve_tokenizer_spec

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert not has_tokenizer_files(model)
    assert resolve_tokenizer_spec("auto", str(model)) == "default"  # a model dir without a tokenizer
    assert resolve_tokenizer_spec("auto", None) == "default"  # the reference GPT
    _tiny_tokenizer_json(model / "tokenizer.json")
    assert has_tokenizer_files(model) and resolve_tokenizer_spec("auto", str(model)) == str(model)
    assert load_tokenizer(resolve_tokenizer_spec("auto", str(model))).encode("hello world") == [2, 3]
    for explicit in ("default", "bpe:512", str(tmp_path / "elsewhere")):
        assert resolve_tokenizer_spec(explicit, str(model)) == explicit  # only auto is resolved
    assert load_tokenizer("auto").name == "default"  # unresolved (no model known): the byte-level default
