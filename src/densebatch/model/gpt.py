"""The reference decoder: a one-file GPT whose attention never crosses document boundaries.

nanoGPT-shaped: token + learned position embeddings, pre-LN blocks (multi-head attention, GELU
MLP), final LayerNorm, lm head tied to the token embedding, GPT-2 initialisation (residual
projections scaled by 1/sqrt(2 * n_layer)). Positions come from the ``Batch`` (0 at every document
start), so a packed document sees exactly what it would see alone; attention kernels live in
``model/attention.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from densebatch.batch import Batch, RowShard
from densebatch.errors import ConfigError, read_json_object
from densebatch.model.attention import (
    BACKENDS,
    AttentionPlan,
    attend_eagerly,
    pick_backend,
    plan_attention,
    rows_hold_one_document,
)
from densebatch.model.loss_head import LOSS_HEADS, head_token_losses, plain_head_token_losses

KIND = "densebatch-gpt"  # written to config.json so load_model knows what it is reading


@dataclass
class GPTConfig:
    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 1024
    dropout: float = 0.0
    attention: str = "auto"  # auto | flex | varlen | segmented | masked
    gradient_checkpointing: bool = False
    loss_head: str = "fused"  # fused (chunked linear + cross-entropy, lean) | plain (full logits of the loss positions)


class KVCache:
    """Keys and values of tokens already seen, per layer, for incremental decoding."""

    def __init__(self, n_layer: int) -> None:
        self.kv: list[tuple[Tensor, Tensor] | None] = [None] * n_layer
        self.positions: Tensor | None = None  # (rows, S)

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        old = self.kv[layer]
        if old is not None:
            k, v = torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2)  # (rows, H, S+T, D)
        self.kv[layer] = (k, v)
        return k, v


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj.residual = True  # type: ignore[attr-defined]  (scaled init)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, plan: AttentionPlan, cache: KVCache | None, layer: int) -> Tensor:
        rows, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(rows, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (rows, H, T, D)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (rows, H, S+T, D)
        y = attend_eagerly(q, k=k, v=v, plan=plan, dropout_p=self.dropout if self.training else 0.0)  # (rows, H, T, D)
        y = y.transpose(1, 2).reshape(rows, T, C)  # (rows, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.proj.residual = True  # type: ignore[attr-defined]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, plan: AttentionPlan, cache: KVCache | None = None, layer: int = 0) -> Tensor:
        x = x + self.attn(self.ln1(x), plan, cache, layer)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, *, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing  # train.label_smoothing (training passes only)
        # config.py validates user settings; these catch a GPTConfig built by hand.
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"GPTConfig.n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
        if cfg.attention not in BACKENDS:
            raise ValueError(f"GPTConfig.attention: expected one of {', '.join(BACKENDS)}; got {cfg.attention!r}")
        if cfg.loss_head not in LOSS_HEADS:
            raise ValueError(f"GPTConfig.loss_head: expected one of {', '.join(LOSS_HEADS)}; got {cfg.loss_head!r}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix, saved once
        self.apply(self._init_weights)

    @property
    def vocab_size(self) -> int:
        """Token ids the model reads and predicts (as ``HFCausalLM.vocab_size``)."""
        return self.cfg.vocab_size

    def _init_weights(self, m: nn.Module) -> None:
        # GPT-2: N(0, 0.02); projections into the residual stream shrink with depth so the
        # residual's variance does not grow with n_layer.
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(m, "residual", False) else 0.02
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    # ---------------------------------------------------------------------------------- forward
    def attention_backend(self, device: torch.device, seq_len: int | None = None) -> str:
        return pick_backend(self.cfg.attention, device, training=torch.is_grad_enabled(), seq_len=seq_len)

    def hidden_states(
        self,
        input_ids: Tensor,
        *,
        positions: Tensor,
        single_doc_rows: bool = False,
        cache: KVCache | None = None,
        max_position: int | None = None,
        cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None,
        branches: Tensor | None = None,
        shard: RowShard | None = None,
    ) -> Tensor:
        """Final-normed hidden states. (rows, T, n_embd). ``max_position``: ``positions.max()`` when the
        caller knows it (a Batch does), which spares a host synchronisation; so do the segment bounds
        ``cu_seqlens`` / ``max_seqlen`` (``Batch``'s) for the attention plan; ``branches``: a pair batch's
        (``Batch.pairs``), whose rejected branches never attend to their chosen ones. ``shard``: the rows are
        split over context ranks and ``input_ids`` / ``positions`` are this rank's columns (``Batch.shard``)."""
        top = int(positions.max()) if max_position is None else max_position
        # The run layer checks row lengths against block_size before training: here it is a bug.
        if top >= self.cfg.block_size:
            raise ValueError(f"position {top} is beyond the position table (block_size {self.cfg.block_size})")
        past = cache.positions if cache is not None else None
        backend = self.attention_backend(input_ids.device, (positions if shard is None else shard.positions).shape[-1])
        plan = plan_attention(
            positions,
            backend=backend,
            single_doc_rows=single_doc_rows,
            past_positions=past,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            branches=branches,
            shard=shard,
        )  # shared by all layers
        if cache is not None:
            cache.positions = positions if past is None else torch.cat([past, positions], dim=-1)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))  # (rows, T, C)
        for i, block in enumerate(self.blocks):
            if self.cfg.gradient_checkpointing and self.training and torch.is_grad_enabled() and cache is None:
                x = checkpoint(block, x, plan, use_reentrant=False)
            else:
                x = block(x, plan, cache, i)
        return self.ln_f(x)

    def forward(
        self, input_ids: Tensor, positions: Tensor, single_doc_rows: bool = False, cache: KVCache | None = None
    ) -> Tensor:
        """Logits (rows, T, vocab). ``single_doc_rows``: the caller guarantees that everything after
        the first segment of every row is padding (then plain causal attention is exact)."""
        return self.lm_head(self.hidden_states(input_ids, positions=positions, single_doc_rows=single_doc_rows, cache=cache))

    weighs_losses = True  # token_losses returns batch.loss_weights x CE when the batch has them
    task = "causal"  # the reference GPT is a causal LM only

    def token_losses(self, batch: Batch) -> Tensor:
        """Cross-entropy per position in float32, 0 where the label is -100. (rows, T)

        The head runs only on positions that carry a target: padding and prompt tokens cost no
        vocabulary projection. ``loss_head: fused`` (default) never holds more than one chunk of
        logits (``model/loss_head.py``); ``plain`` projects all loss positions at once.
        """
        single = rows_hold_one_document(batch)
        h = self.hidden_states(
            batch.input_ids,
            positions=batch.positions,
            single_doc_rows=single,
            cache=None,
            max_position=batch.max_position,
            cu_seqlens=batch.cu_seqlens,
            max_seqlen=batch.max_seqlen,
            branches=None if batch.pairs is None else batch.pairs.branches,
            shard=batch.shard,
        )  # (rows, T, C)
        eps = self.label_smoothing if self.training else 0.0  # evaluation reports the plain cross-entropy
        w = batch.loss_weights  # weight x CE per position (train.source_balance), or None
        if self.cfg.loss_head == "plain":
            return plain_head_token_losses(h, batch.labels, self.lm_head, eps, w)
        return head_token_losses(
            h, batch.labels, self.lm_head.weight, None, batch.num_loss_tokens, label_smoothing=eps, token_weights=w
        )

    # -------------------------------------------------------------------------------- structure
    def layer_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by group (each exactly once; the head is tied to ``wte`` so it adds only ln_f)."""
        groups = {
            "embeddings": [self.wte.weight, self.wpe.weight],
            "blocks": [p for b in self.blocks for p in b.parameters()],
            "head": list(self.ln_f.parameters()),
        }
        if self.lm_head.weight is not self.wte.weight:
            groups["head"].append(self.lm_head.weight)
        return groups

    def output_embeddings(self) -> list[nn.Parameter]:
        """The output embedding matrix (one row per token, like ``wte``; the same tensor when tied):
        embeddings-like, so the optimizer leaves it undecayed unless ``decay_all``."""
        return [self.lm_head.weight]

    def init_kv_cache(self) -> KVCache:
        return KVCache(self.cfg.n_layer)

    @property
    def max_positions(self) -> int:
        return self.cfg.block_size

    # ------------------------------------------------------------------------------------- I/O
    def save(self, path: str | Path) -> None:
        """``config.json`` + ``model.safetensors`` (no pickle); ``load_model(path)`` reads them back."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        full = self.state_dict()
        state = {name: full[k].detach().cpu().contiguous() for k, name in self.export_names(list(full)).items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        self.write_config(path)

    def export_names(self, keys: list[str]) -> dict[str, str]:
        """State-dict key -> name in the saved weights (the output head is the input embedding: not stored)."""
        return {k: k for k in keys if k != "lm_head.weight"}

    def write_config(self, path: str | Path) -> None:
        """``config.json``, beside weights written under ``export_names``."""
        (Path(path) / "config.json").write_text(json.dumps({"densebatch_kind": KIND, **asdict(self.cfg)}, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> GPT:
        from safetensors.torch import load_file

        path = Path(path)
        model = cls(read_saved_config(path / "config.json"))
        try:  # safetensors only: a tampered or truncated file is refused, never unpickled
            state = load_file(str(path / "model.safetensors"))
            state["lm_head.weight"] = state["wte.weight"]
            model.load_state_dict(state)
        except Exception as e:  # SafetensorError, OSError, missing / mis-shaped keys
            raise ConfigError(f"{path / 'model.safetensors'}: cannot be loaded as this model's weights: {e}") from None
        return model


_POSITIVE = ("vocab_size", "n_layer", "n_head", "n_embd", "block_size")
_CHOICES = {"attention": BACKENDS, "loss_head": LOSS_HEADS}


def read_saved_config(cfg_file: Path) -> GPTConfig:
    """The ``GPTConfig`` a saved ``config.json`` holds, checked: ``ConfigError`` in one line naming the file and
    the field when it is not what ``GPT.write_config`` writes (a hand-edited or damaged file)."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{cfg_file} is not a model configuration densebatch saved: {why}")

    meta = read_json_object(cfg_file, "a model configuration densebatch saved")
    meta = {k: v for k, v in meta.items() if k != "densebatch_kind"}
    unknown = [k for k in meta if k not in {f.name for f in fields(GPTConfig)}]
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}")
    if "vocab_size" not in meta:
        raise bad("vocab_size is missing")
    for key in _POSITIVE:
        if key in meta and not (type(meta[key]) is int and meta[key] > 0):
            raise bad(f"{key} must be a positive integer (got {meta[key]!r})")
    dropout = meta.get("dropout", 0.0)
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        raise bad(f"dropout must be a number in [0, 1) (got {dropout!r})")
    for key, choices in _CHOICES.items():
        if key in meta and meta[key] not in choices:
            raise bad(f"{key} must be one of {', '.join(choices)} (got {meta[key]!r})")
    if type(meta.get("gradient_checkpointing", False)) is not bool:
        raise bad(f"gradient_checkpointing must be true or false (got {meta['gradient_checkpointing']!r})")
    cfg = GPTConfig(**meta)
    if cfg.n_embd % cfg.n_head:
        raise bad(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
    return cfg
