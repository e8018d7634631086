"""Packed documents stay isolated in every Hugging Face architecture densebatch supports; the others are refused.

For each tiny random config of ``densebatch.testing.models.ARCHITECTURES`` (width 32, 1-2 layers, a sliding window of
``WINDOW`` tokens where the architecture has one, shorter than the longer documents): the per-token
losses and the logits of each document packed with others equal those of the document alone
(fp32, 1e-5), through the adapter's own paths (the 4-D document mask for packed rows, no mask for a
row holding one document). Architectures that cannot be isolated raise a one-line ``ConfigError``
that says why. docs/hf-models.md has the measured table (benchmarks/model/hf_isolation_table.py).
"""

from __future__ import annotations

import pytest
import torch

from densebatch.errors import ConfigError
from densebatch.testing.batches import pack, random_docs
from densebatch.testing.models import ARCHITECTURES, LENGTHS, SEQ_LEN, VOCAB, WINDOW, packed_vs_alone, write_config_dir

pytest.importorskip("transformers")
from densebatch.model.hf import _HIDDEN_PATH_TYPES, REFUSED, HFCausalLM  # noqa: E402

SUPPORTED = [(k, impl) for k, impl in ARCHITECTURES if k not in REFUSED]


@pytest.fixture(scope="module")
def config_root(tmp_path_factory):
    return tmp_path_factory.mktemp("archs")


def build(root, kind: str, impl: str) -> HFCausalLM:
    path = root / kind if (root / kind / "config.json").is_file() else write_config_dir(root, kind)
    torch.manual_seed(0)
    return HFCausalLM(path, attn_implementation=impl).eval()


@pytest.mark.parametrize(("kind", "impl"), SUPPORTED, ids=[k for k, _ in SUPPORTED])
def test_packed_documents_equal_each_document_alone(config_root, kind, impl, gen):
    model = build(config_root, kind, impl)
    loss_diff, logit_diff = packed_vs_alone(model, [random_docs(gen, row, VOCAB) for row in LENGTHS])
    assert loss_diff <= 1e-5 and logit_diff <= 1e-5, f"{kind}/{impl}: losses {loss_diff:.2e}, logits {logit_diff:.2e}"


@pytest.mark.parametrize("kind", sorted(set(REFUSED) & set(dict(ARCHITECTURES))))
def test_unisolatable_architectures_are_refused(tmp_path, kind):
    with pytest.raises(ConfigError, match=f"{kind} is not supported: it uses ALiBi") as e:
        HFCausalLM(write_config_dir(tmp_path, kind))
    assert "\n" not in str(e.value)


def test_falcon_with_alibi_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="falcon is not supported: it uses ALiBi"):
        HFCausalLM(write_config_dir(tmp_path, "falcon", alibi=True))


def test_soft_capped_attention_needs_eager(config_root):
    with pytest.raises(ConfigError, match="model.attn_implementation: gemma2 soft-caps .* set model.attn_implementation: eager"):
        build(config_root, "gemma2", "sdpa")


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_negative_control_a_forgotten_window_shows(config_root, kind, gen):
    """Without the sliding window drawn into the mask, packed documents longer than it differ from
    the same documents alone (where transformers applies the window itself): the test above would see it."""
    model = build(config_root, kind, dict(ARCHITECTURES)[kind])
    assert any(w == WINDOW for w in model._windows.values())
    model._windows = {name: None for name in model._windows}
    loss_diff, _ = packed_vs_alone(model, [random_docs(gen, row, VOCAB) for row in LENGTHS])
    assert loss_diff > 1e-4


@pytest.mark.parametrize("kind", sorted(_HIDDEN_PATH_TYPES & {k for k, _ in SUPPORTED}))
def test_hidden_state_path_matches_the_models_own_logits(config_root, kind, gen):
    """The architectures whose losses skip the full logits (only target positions projected) lose nothing."""
    model = build(config_root, kind, dict(ARCHITECTURES)[kind])
    assert model._hidden_path
    batch = pack([random_docs(gen, row, VOCAB) for row in LENGTHS], seq_len=SEQ_LEN)
    with torch.no_grad():
        fast = model.token_losses(batch)
        model._hidden_path = False
        assert torch.allclose(fast, model.token_losses(batch), atol=1e-5)
