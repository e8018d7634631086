"""densebatch's document attention for Falcon in transformers < 5.25, where Falcon picks its attention class.

From transformers 5.25 Falcon's attention calls ``ALL_ATTENTION_FUNCTIONS`` like other models, so
``hf_attention.register()`` is all it needs and ``install()`` does nothing. Before that, Falcon's
decoder layer does not go through transformers' ``AttentionInterface``: it looks its attention
class up in its own table (``FALCON_ATTENTION_CLASSES``: eager, sdpa, flash_attention_2), and its model
always builds a T x T mask first. ``install()`` adds a ``"densebatch"`` entry to that table, so a Falcon
loaded with ``attn_implementation="densebatch"`` gets ``DenseFalconAttention`` in every layer: the same
parameters and projections as ``FalconAttention`` (its state dict, checkpoints and LoRA targets are
unchanged), with the attention itself done by ``hf_attention.densebatch_attention`` on the batch's plan.
Falcon's model asks ``create_causal_mask`` for a mask under that name, and transformers builds none for
an implementation it has no mask function for, so no T x T tensor exists in the forward.

Grouped and multi-query key/values (``new_decoder_architecture`` with ``num_kv_heads``, ``multi_query``)
are passed to the kernel as they are, where Falcon's own ``_split_heads`` broadcasts them to every query
head. Rotary Falcon only: ALiBi Falcon is refused (``hf_checks``). Like Falcon's own rotary path, no
attention dropout is applied.
"""

from __future__ import annotations

import math

from torch import Tensor

from densebatch.model.hf.attention import NAME, densebatch_attention


def _attention_class():
    from transformers.models.falcon import modeling_falcon as mf

    class DenseFalconAttention(mf.FalconAttention):
        """``FalconAttention`` whose scores are computed per document by densebatch's kernel."""

        def _split_qkv(self, fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            """Query (rows, T, H, D) and key/value (rows, T, Hkv, D), key/values not repeated. Query head h
            reads key/value head h // (H // Hkv), as Falcon's grouping and SDPA's ``enable_gqa`` both do."""
            rows, t, _ = fused.shape
            d = self.head_dim
            if self.new_decoder_architecture:  # per kv group: its query heads, then one key and one value
                qkv = fused.view(rows, t, -1, self.num_heads // self.num_kv_heads + 2, d)
                return qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
            if not self.multi_query:  # per head: query, key, value
                qkv = fused.view(rows, t, self.num_heads, 3, d)
                return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
            qkv = fused.view(rows, t, self.num_heads + 2, d)  # every query head, then one key and one value
            return qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]

        def forward(
            self,
            hidden_states: Tensor,
            alibi: Tensor | None,
            attention_mask: Tensor | None,
            position_ids: Tensor | None = None,
            layer_past=None,
            use_cache: bool = False,
            output_attentions: bool = False,
            position_embeddings: tuple[Tensor, Tensor] | None = None,
            **kwargs,
        ):
            if alibi is not None:  # refused when the model is built; kept as a guard
                raise ValueError("densebatch's Falcon attention is rotary only (ALiBi Falcon is not supported)")
            rows, t, _ = hidden_states.shape
            q, k, v = (x.transpose(1, 2) for x in self._split_qkv(self.query_key_value(hidden_states)))
            cos, sin = position_embeddings
            q, k = mf.apply_rotary_pos_emb(q, k, cos, sin)
            if layer_past is not None:
                k, v = layer_past.update(k, v, self.layer_idx)
            # Falcon's layer passes on no keywords but the positions: with them, packed rows that come
            # without densebatch's plan (a transformers loop) are still kept apart (``_plan_from_packed``)
            kwargs.setdefault("position_ids", position_ids)
            out, _ = densebatch_attention(self, q, k, v, None, 0.0, 1.0 / math.sqrt(self.head_dim), **kwargs)
            return self.dense(out.reshape(rows, t, self.num_heads * self.head_dim)), None

    return DenseFalconAttention


def install() -> None:
    """Add densebatch's attention class to Falcon's table where Falcon has one (transformers < 5.25);
    idempotent; transformers imported on first use."""
    from transformers.models.falcon import modeling_falcon as mf

    table = getattr(mf, "FALCON_ATTENTION_CLASSES", None)
    if table is None:  # transformers >= 5.25: Falcon's attention reads AttentionInterface (register())
        return
    if NAME not in table:
        table[NAME] = _attention_class()
