"""Adapter giving any Hugging Face causal LM the densebatch model interface, documents kept apart.

Hugging Face models isolate packed documents only when handed the right mask. With
``position_ids`` alone they leak across documents under both ``sdpa`` and ``eager`` when a KV cache
is in use (``use_cache`` defaults to True, in training too); with ``use_cache=False`` and no mask,
transformers >= 4.56 derives a document mask itself from the restarts of ``position_ids``. This
adapter does not rely on that: it passes its own mask. Measured with transformers 5.24 on CPU
(tests/model/test_hf.py checks it on every run):

===================  ===========================  =================================================
attn_implementation  mask passed here             packed vs alone (max |logit diff|)
===================  ===========================  =================================================
sdpa                 4-D boolean (rows, 1, T, T)  ~2e-7  (isolated)
eager                4-D additive float, min/0    ~2e-7  (isolated; a boolean mask leaks: 0.24-0.38)
flex_attention       -                            GPT-2 refuses it; Llama crashes the process
===================  ===========================  =================================================

So ``ALLOWED`` is {sdpa, eager}; anything else raises ``ConfigError``. When every row is one
document followed by padding (``Batch.single_doc_rows``), neither mask nor positions are passed:
plain causal attention is exact for the real tokens because the padding comes after them, and
without ``position_ids`` transformers sees no packing and runs SDPA's causal kernel (no 4-D mask).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from densebatch.batch import Batch
from densebatch.errors import ConfigError
from densebatch.model.attention import document_mask, rows_hold_one_document
from densebatch.model.loss_head import LOSS_HEADS, head_token_losses, plain_head_token_losses

# attn_implementation -> how the document mask is expressed (see the table above).
ALLOWED = {"sdpa": "bool", "eager": "additive"}
# Architectures whose logits are exactly lm_head(base_model(...).last_hidden_state) (no soft-capping,
# no logit scale), so token_losses may project only the positions that carry a target, through the
# fused chunked head (model/loss_head.py) when lm_head is a plain nn.Linear.
_HIDDEN_PATH_TYPES = {"gpt2", "llama", "mistral", "qwen2", "qwen3"}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def has_weights(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in _WEIGHT_FILES)


class HFCausalLM(nn.Module):
    """A local ``AutoModelForCausalLM`` (weights, or random init from config.json alone)."""

    def __init__(
        self,
        path: str | Path,
        attn_implementation: str = "sdpa",
        gradient_checkpointing: bool = False,
        loss_head: str = "fused",
    ) -> None:
        super().__init__()
        if loss_head not in LOSS_HEADS:
            raise ValueError(f"loss_head: expected one of {', '.join(LOSS_HEADS)}; got {loss_head!r}")
        self.loss_head = loss_head
        if attn_implementation not in ALLOWED:
            raise ConfigError(
                f"Hugging Face attn_implementation {attn_implementation!r} cannot keep packed documents "
                f"isolated (tests show it leaks or crashes); use one of: {', '.join(ALLOWED)}"
            )
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: '{path}' has no config.json (expected a local Hugging Face model directory)")
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ConfigError("model.kind hf needs transformers: pip install 'densebatch[hf]'") from None
        if has_weights(path):
            # fp32 master weights whatever the checkpoint dtype: autocast does the low precision.
            self.hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation, dtype=torch.float32)
        else:
            config = AutoConfig.from_pretrained(path)
            self.hf = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        actual = getattr(self.hf.config, "_attn_implementation", attn_implementation)
        if actual != attn_implementation:
            raise ConfigError(f"transformers chose attn_implementation {actual!r} instead of {attn_implementation!r}; use sdpa")
        self.attn_implementation = attn_implementation
        if gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(self.hf, "activation_checkpointing_enable"):  # transformers >= 5.x name
                self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self._hidden_path = getattr(self.hf.config, "model_type", None) in _HIDDEN_PATH_TYPES

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_input_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int | None:
        c = self.hf.config
        return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)

    # ---------------------------------------------------------------------------------- forward
    def _mask(self, positions: Tensor) -> Tensor:
        mask = document_mask(positions)  # (rows, 1, T, T) bool
        if ALLOWED[self.attn_implementation] == "bool":
            return mask
        dtype = next(self.hf.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)

    def _inputs(self, input_ids: Tensor, positions: Tensor, single_doc_rows: bool) -> dict:
        if single_doc_rows:
            # One document per row, starting at column 0: its positions are 0, 1, ... (the model's
            # default), and padding only follows it. Passing no position_ids matters: transformers
            # >= 4.56 reads the restart of positions at the padding run as a second packed sequence
            # and builds a 4-D mask, where no mask lets SDPA run its causal kernel.
            return dict(input_ids=input_ids, use_cache=False)
        return dict(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=self._mask(positions),
            use_cache=False,
        )

    def forward(self, input_ids: Tensor, positions: Tensor, single_doc_rows: bool = False) -> Tensor:
        """Logits (rows, T, vocab), each document attending only to itself."""
        return self.hf(**self._inputs(input_ids, positions, single_doc_rows)).logits

    label_smoothing = 0.0  # train.label_smoothing, set by the run (training passes only)

    def token_losses(self, batch: Batch) -> Tensor:
        """Cross-entropy per position in float32, 0 where the label is -100. (rows, T)

        Architectures in ``_HIDDEN_PATH_TYPES`` project only the positions with a target, through
        the fused chunked head unless ``loss_head="plain"``; others compute the model's own logits.
        """
        inputs = self._inputs(batch.input_ids, batch.positions, rows_hold_one_document(batch))
        eps = self.label_smoothing if self.training else 0.0  # evaluation reports the plain cross-entropy
        if not self._hidden_path:
            logits = self.hf(**inputs).logits  # (rows, T, vocab)
            return plain_head_token_losses(logits, batch.labels, nn.Identity(), eps)
        h = self.hf.base_model(**inputs).last_hidden_state  # (rows, T, C)
        head = self.hf.get_output_embeddings()
        if self.loss_head == "plain" or type(head) is not nn.Linear:
            return plain_head_token_losses(h, batch.labels, head, eps)
        return head_token_losses(h, batch.labels, head.weight, head.bias, batch.num_loss_tokens, label_smoothing=eps)

    # -------------------------------------------------------------------------------- structure
    def layer_groups(self) -> dict[str, list[nn.Parameter]]:
        """embeddings: input/output embedding matrices and any other nn.Embedding (e.g. GPT-2's
        position table); blocks: the largest ModuleList (the repeated layers); head: the rest
        (final norm, an untied output matrix). Each parameter exactly once."""
        seen: set[int] = set()

        def take(params) -> list[nn.Parameter]:
            out = []
            for p in params:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
            return out

        layers = max(
            (m for m in self.hf.modules() if isinstance(m, nn.ModuleList)),
            key=lambda m: sum(p.numel() for p in m.parameters()),
            default=None,
        )
        embeddings = take(self.hf.get_input_embeddings().parameters())
        blocks = take(layers.parameters()) if layers is not None else []
        embeddings += take(p for m in self.hf.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
        out_emb = self.hf.get_output_embeddings()
        head = take(p for p in self.hf.parameters() if out_emb is None or all(p is not q for q in out_emb.parameters()))
        if out_emb is not None:
            head += take(out_emb.parameters())
        return {"embeddings": embeddings, "blocks": blocks, "head": head}

    def output_embeddings(self) -> list[nn.Parameter]:
        """The output embedding matrix (an untied lm_head, or the input embeddings when tied): the
        optimizer treats it as an embedding (no weight decay unless ``decay_all``)."""
        head = self.hf.get_output_embeddings()
        return [] if head is None else [p for p in head.parameters() if p.ndim >= 2]

    def resize_vocab(self, vocab_size: int) -> None:
        """Grow the embedding matrices to ``vocab_size`` (a tokenizer larger than the config)."""
        if vocab_size > self.vocab_size:
            self.hf.resize_token_embeddings(vocab_size)

    # ------------------------------------------------------------------------------------- I/O
    def save(self, path: str | Path) -> None:
        """``save_pretrained`` (safetensors): ``AutoModelForCausalLM.from_pretrained(path)`` loads it."""
        self.hf.save_pretrained(path)
