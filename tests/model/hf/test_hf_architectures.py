"""Packed documents stay isolated in every Hugging Face architecture densebatch supports; the others are refused.

For each tiny random config of ``densebatch.testing.models.ARCHITECTURES`` (width 32, 1-2 layers, a sliding window of
``WINDOW`` tokens where the architecture has one, shorter than the longer documents): the per-token
losses and the logits of each document packed with others equal those of the document alone
(fp32, 1e-5). Packed rows go through ``attn_implementation: densebatch`` (the default: documents one by
one through transformers' attention interface, on the segmented and the masked backend) and through
transformers' own kernel with the 4-D document mask; the document alone always goes through
transformers' own kernel without a mask, so the reference shares no code with densebatch's attention.
Architectures that cannot be isolated raise a one-line ``ConfigError`` that says why. docs/hf-models.md
has the measured table (benchmarks/model/hf_isolation_table.py).
"""

from __future__ import annotations

import pytest
import torch

from densebatch.errors import ConfigError
from densebatch.testing.batches import pack, random_docs
from densebatch.testing.models import (
    ARCHITECTURES,
    LENGTHS,
    SEQ_LEN,
    VOCAB,
    WINDOW,
    packed_vs_alone,
    tiny_config,
    write_config_dir,
)

pytest.importorskip("transformers")
from densebatch.model.hf.adapter import HIDDEN_PATH_TYPES, REFUSED, HFCausalLM  # noqa: E402

SUPPORTED = [(k, impl) for k, impl in ARCHITECTURES if k not in REFUSED]
# (kind, attn_implementation, model.attention) of the packed model
PATHS = [(k, impl, "auto") for k, impl in SUPPORTED] + [
    (k, "densebatch", backend) for k, _ in SUPPORTED for backend in ("segmented", "masked")
]


@pytest.fixture(scope="module")
def config_root(tmp_path_factory):
    return tmp_path_factory.mktemp("archs")


def build(root, kind: str, impl: str, attention: str = "auto") -> HFCausalLM:
    path = root / kind if (root / kind / "config.json").is_file() else write_config_dir(root, kind)
    torch.manual_seed(0)
    return HFCausalLM(path, attn_implementation=impl, attention=attention).eval()


@pytest.mark.parametrize(("kind", "impl", "attention"), PATHS, ids=[f"{k}-{i}-{a}" for k, i, a in PATHS])
def test_packed_documents_equal_each_document_alone(config_root, kind, impl, attention, gen):
    own = dict(SUPPORTED)[kind]
    model = build(config_root, kind, impl, attention)
    reference = build(config_root, kind, own)
    reference.load_state_dict(model.state_dict())
    loss_diff, logit_diff = packed_vs_alone(model, [random_docs(gen, row, VOCAB) for row in LENGTHS], reference)
    assert loss_diff <= 1e-5 and logit_diff <= 1e-5, f"{kind}/{impl}/{attention}: losses {loss_diff:.2e}, logits {logit_diff:.2e}"


@pytest.mark.parametrize("kind", sorted(set(REFUSED) & set(dict(ARCHITECTURES))))
def test_unisolatable_architectures_are_refused(tmp_path, kind):
    with pytest.raises(ConfigError, match=f"{kind} is not supported: it uses ALiBi") as e:
        HFCausalLM(write_config_dir(tmp_path, kind))
    assert "\n" not in str(e.value)


def test_falcon_with_alibi_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="falcon is not supported: it uses ALiBi"):
        HFCausalLM(write_config_dir(tmp_path, "falcon", alibi=True))


def test_soft_capped_attention_is_refused_under_sdpa(config_root):
    with pytest.raises(
        ConfigError, match="model.attn_implementation: gemma2 soft-caps .* set model.attn_implementation: densebatch"
    ):
        build(config_root, "gemma2", "sdpa")


# Falcon's three ways of laying out query/key/value: multi-query (the tiny config's default: one key/value
# head), grouped (new_decoder_architecture, 2 key/value heads for 4 query heads) and one per head.
FALCON_LAYOUTS = {
    "multi_query": {},
    "grouped": {"new_decoder_architecture": True, "num_kv_heads": 2, "multi_query": False},
    "per_head": {"multi_query": False},
}


@pytest.mark.parametrize("layout", FALCON_LAYOUTS)
def test_falcon_attends_document_by_document_in_every_qkv_layout(tmp_path, layout, gen):
    """Before transformers 5.25 Falcon picks its attention class from its own table, and densebatch's class
    there (model/hf/falcon.py) must keep packed documents apart and have Falcon's own parameters; from
    5.25 Falcon calls the attention interface like other models. Either way packed == alone, which the
    SDPA reference (the same weights) only gives document by document."""
    from transformers.models.falcon import modeling_falcon as mf

    path = write_config_dir(tmp_path, "falcon", **FALCON_LAYOUTS[layout])
    torch.manual_seed(0)
    model = HFCausalLM(path, attention="segmented").eval()
    own_table = hasattr(mf, "FALCON_ATTENTION_CLASSES")
    expected = "DenseFalconAttention" if own_table else "FalconAttention"
    assert type(model.hf.transformer.h[0].self_attention).__name__ == expected
    assert model.hf.config._attn_implementation == "densebatch"
    reference = HFCausalLM(path, attn_implementation="sdpa").eval()
    reference.load_state_dict(model.state_dict())  # the same parameter names and shapes as Falcon's own class
    loss_diff, logit_diff = packed_vs_alone(model, [random_docs(gen, row, VOCAB) for row in LENGTHS], reference)
    assert loss_diff <= 1e-5 and logit_diff <= 1e-5, f"falcon/{layout}: losses {loss_diff:.2e}, logits {logit_diff:.2e}"


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_negative_control_a_forgotten_window_shows(config_root, kind, gen):
    """Without the sliding window drawn into the mask, packed documents longer than it differ from
    the same documents alone (where transformers applies the window itself): the test above would see it."""
    model = build(config_root, kind, dict(ARCHITECTURES)[kind])
    assert any(w == WINDOW for w in model._windows.values())
    model._windows = {name: None for name in model._windows}
    loss_diff, _ = packed_vs_alone(model, [random_docs(gen, row, VOCAB) for row in LENGTHS])
    assert loss_diff > 1e-4


@pytest.mark.parametrize("kind", sorted(HIDDEN_PATH_TYPES & {k for k, _ in SUPPORTED}))
def test_hidden_state_path_matches_the_models_own_logits(config_root, kind, gen):
    """The architectures whose losses skip the full logits (only target positions projected) lose nothing."""
    model = build(config_root, kind, dict(ARCHITECTURES)[kind])
    assert model._hidden_path
    batch = pack([random_docs(gen, row, VOCAB) for row in LENGTHS], seq_len=SEQ_LEN)
    with torch.no_grad():
        fast = model.token_losses(batch)
        model._hidden_path = False
        assert torch.allclose(fast, model.token_losses(batch), atol=1e-5)


@pytest.mark.parametrize(("kind", "dropped"), [("mistral", "window"), ("gemma2", "window"), ("gemma2", "softcap")])
def test_negative_control_densebatch_attention_must_honour_each_layers_options(
    config_root, tmp_path, kind, dropped, gen, monkeypatch
):
    """If densebatch's attention function ignored what a layer passes it (its sliding window, its
    soft-cap), packed documents would differ from transformers' own result: the test above would see it."""
    import densebatch.model.hf.attention as hf_attention
    from densebatch.model.attention import AttnOptions

    # random weights give scores far below Gemma 2's cap of 50, where tanh is the identity: a cap the scores reach
    root = tmp_path / "capped" if dropped == "softcap" else config_root
    if dropped == "softcap":
        write_config_dir(root, kind, attn_logit_softcapping=0.02)
    model = build(root, kind, "densebatch", "segmented")
    reference = build(root, kind, dict(ARCHITECTURES)[kind])
    reference.load_state_dict(model.state_dict())
    docs = [random_docs(gen, row, VOCAB) for row in LENGTHS]
    assert packed_vs_alone(model, docs, reference)[0] <= 1e-5
    monkeypatch.setattr(hf_attention, "AttnOptions", lambda **kw: AttnOptions(**{**kw, dropped: None}))
    assert packed_vs_alone(model, docs, reference)[0] > 1e-4


@pytest.mark.parametrize("kind", ["llama", "falcon"])
def test_a_transformers_loop_giving_only_position_ids_keeps_packed_documents_apart(kind, gen):
    """``densebatch.register_attention()`` and the model called directly with packed rows whose positions
    restart at each document, no ``cu_seq_lens`` (what ``DataCollatorWithFlattening`` gives by default):
    each document's logits are its logits alone. Falcon's layers pass on only the positions."""
    from densebatch.integrations.hf_trainer import register_attention

    transformers = pytest.importorskip("transformers")
    register_attention()
    overrides = dict(new_decoder_architecture=True, num_kv_heads=2, multi_query=False) if kind == "falcon" else {}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), attn_implementation="densebatch").eval()
    ids = torch.randint(3, VOCAB, (1, 12), generator=gen)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=torch.cat([torch.arange(7), torch.arange(5)])[None]).logits[0]
        first, second = model(input_ids=ids[:, :7]).logits[0], model(input_ids=ids[:, 7:]).logits[0]
    assert (packed[:7] - first).abs().max() <= 1e-5 and (packed[7:] - second).abs().max() <= 1e-5
