"""Encoder masked LMs through the Hugging Face adapter (``batching.mode: mlm``): each packed document
attends to the whole of itself and to nothing else, under every attention implementation, for each
encoder architecture; and models of the other kind are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from densebatch.errors import ConfigError
from densebatch.model.hf.adapter import ALLOWED, HFCausalLM
from densebatch.model.hf.checks import check_model_dir
from densebatch.testing.batches import pack, random_docs
from densebatch.testing.models import ENCODERS, TWO_LAYER_VOCAB, save_encoder, two_layer_config

transformers = pytest.importorskip("transformers")
V = TWO_LAYER_VOCAB
# Rows of packed documents; several longer than ModernBERT's local window (8), one of a single token.
ROWS = [[9, 14, 5], [20], [3, 11, 1, 7]]


@pytest.fixture(scope="module")
def encoder_dirs(tmp_path_factory):
    out = {}
    for kind in ENCODERS:
        out[kind] = tmp_path_factory.mktemp(kind)
        save_encoder(kind, out[kind])
    return out


@pytest.mark.parametrize("impl", sorted(ALLOWED))
@pytest.mark.parametrize("kind", ENCODERS)
def test_packed_documents_attend_to_all_of_themselves_and_nothing_else(encoder_dirs, kind, impl, gen):
    """Packed (padding after the last document, so padding must be masked as a key too) == alone through
    the model's own forward (no mask, its own positions), to 1e-5 in float32."""
    model = HFCausalLM(encoder_dirs[kind], attn_implementation=impl, task="mlm").eval()
    docs = [random_docs(gen, row, V) for row in ROWS]
    batch = pack(docs, seq_len=32)
    with torch.no_grad():
        packed = model(batch.input_ids, batch.positions)  # (rows, T, V)
        worst = 0.0
        for r, row in enumerate(docs):
            t = 0
            for d in row:
                alone = model.lm(input_ids=torch.tensor([d])).logits[0]  # (n, V)
                worst = max(worst, (packed[r, t : t + len(d)] - alone).abs().max().item())
                t += len(d)
    assert worst <= 1e-5, f"{kind} under {impl}: packed vs alone differ by {worst:.2e}"


def test_bidirectional_means_a_token_sees_the_tokens_after_it(encoder_dirs):
    """The check above would pass for a causal mask too if the model ignored later tokens: changing a
    document's last token changes the logits at its first position, and nothing in the next document."""
    model = HFCausalLM(encoder_dirs["bert"], task="mlm").eval()
    a, b = [5, 6, 7, 8], [9, 10, 11]
    with torch.no_grad():
        one = model(pack([[a, b]]).input_ids, pack([[a, b]]).positions)
        changed = [5, 6, 7, 12]
        two = model(pack([[changed, b]]).input_ids, pack([[changed, b]]).positions)
    assert (one[0, 0] - two[0, 0]).abs().max() > 1e-4
    assert torch.allclose(one[0, 4:], two[0, 4:], atol=1e-6)


def test_a_model_of_the_other_kind_is_refused_in_one_line(encoder_dirs, tmp_path):
    causal = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(two_layer_config("gpt2")).save_pretrained(causal)
    cases = [
        (encoder_dirs["bert"], "causal", "batching.mode: mlm"),  # an encoder with mode causal
        (causal, "mlm", "batching.mode: causal"),  # a causal model with mode mlm
    ]
    for path, task, hint in cases:
        with pytest.raises(ConfigError, match=hint) as e:
            check_model_dir(path, task)
        assert "\n" not in str(e.value)
    # a BERT saved as BertLMHeadModel (a decoder-capable class) is not loaded as a masked LM
    lm_head = tmp_path / "bert-lm-head"
    config = transformers.BertConfig(
        **{**transformers.AutoConfig.from_pretrained(encoder_dirs["bert"]).to_dict(), "is_decoder": True}
    )
    transformers.BertLMHeadModel(config).save_pretrained(lm_head)
    with pytest.raises(ConfigError, match="not a masked LM"):
        check_model_dir(lm_head, "mlm")
    # saved as one masked-LM class, built as another: refused, not silently re-headed
    renamed = tmp_path / "renamed"
    transformers.AutoModelForMaskedLM.from_pretrained(encoder_dirs["bert"]).save_pretrained(renamed)
    meta = (renamed / "config.json").read_text().replace('"BertForMaskedLM"', '"RobertaForMaskedLM"')
    (renamed / "config.json").write_text(meta)
    with pytest.raises(ConfigError, match="saved as RobertaForMaskedLM"):
        check_model_dir(renamed, "mlm")


def test_a_config_that_neither_mode_trains_is_refused_with_what_to_change(encoder_dirs, tmp_path):
    """A masked LM built as a decoder (causal attention, as from_pretrained would run it) is refused for
    mlm; a causal head over an encoder (is_decoder false) is refused by both modes with one message that
    sends to neither mode; a class of the model's own (a renamed one) is not loaded as transformers' class."""
    meta = json.loads((encoder_dirs["bert"] / "config.json").read_text())

    def config_dir(name: str, **changes) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**meta, **changes}))
        return tmp_path / name

    def refused(path: Path, task: str, match: str) -> str:
        with pytest.raises(ConfigError, match=match) as e:
            check_model_dir(path, task)
        assert "\n" not in str(e.value)
        return str(e.value)

    refused(config_dir("decoder", is_decoder=True), "mlm", "built as a decoder .* set is_decoder: false")
    head = config_dir("head", architectures=["BertLMHeadModel"], is_decoder=False)
    texts = {refused(head, task, "is_decoder false: a causal LM's head") for task in ("mlm", "causal")}
    assert len(texts) == 1 and "set batching.mode" not in texts.pop()
    refused(config_dir("mine", architectures=["MyBertForMaskedLM"]), "mlm", "saved as MyBertForMaskedLM .* BertForMaskedLM")


def test_unchecked_encoders_and_odd_architecture_lists(encoder_dirs, tmp_path):
    """An encoder type not checked for packed isolation is refused for mlm; a bare-string or null-holding
    ``architectures`` is read as the class it names; RoBERTa's context is its table less the rows before
    its first position (no index past the table at the longest row)."""
    deberta = tmp_path / "deberta"
    config = transformers.DebertaV2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    transformers.DebertaV2ForMaskedLM(config).save_pretrained(deberta)
    with pytest.raises(ConfigError, match="deberta-v2, which is not checked yet"):
        check_model_dir(deberta, "mlm")
    odd = tmp_path / "odd"
    transformers.AutoModelForMaskedLM.from_pretrained(encoder_dirs["bert"]).save_pretrained(odd)
    meta = json.loads((odd / "config.json").read_text())
    for arch in ("BertForMaskedLM", [None, "BertForMaskedLM"]):
        (odd / "config.json").write_text(json.dumps({**meta, "architectures": arch}))
        assert check_model_dir(odd, "mlm")["model_type"] == "bert"
    roberta = HFCausalLM(encoder_dirs["roberta"], task="mlm")
    assert roberta.position_offset == 1 and roberta.max_positions == roberta.lm.config.max_position_embeddings - 1
