"""Adapter giving any Hugging Face causal LM the densebatch model interface, documents kept apart.

Hugging Face models isolate packed documents only when handed the right mask or kernel. With
``position_ids`` alone they leak across documents under both ``sdpa`` and ``eager`` when a KV cache
is in use (``use_cache`` defaults to True, in training too); with ``use_cache=False`` and no mask,
transformers >= 4.56 derives a document mask itself from the restarts of ``position_ids``. This
adapter does not rely on that.

``attn_implementation: densebatch`` (the default) registers densebatch's own attention with
transformers' ``AttentionInterface`` (``model/hf/attention.py``): every layer's attention call gets
the batch's attention plan (built once per forward from the collator's segment bounds) and runs the
``model.attention`` backend on it: varlen FlashAttention or flex on CUDA, the per-document segmented
path on CPU. No T x T mask is ever built, so memory and time grow with the documents, not with the
row; grouped-query key/values are shared, not repeated; sliding windows, soft-capping, scaling and
attention dropout are honoured per layer. Transformers builds no mask of its own for an
implementation it does not know (its mask interface returns early), so nothing O(T^2) remains.

``sdpa`` and ``eager`` keep the older path: a 4-D document mask handed to transformers' own kernels.
Measured with transformers 5.24 on CPU (tests/model/hf/test_hf.py checks it on every run):

===================  ===========================  =================================================
attn_implementation  mask passed here             packed vs alone (max |logit diff|)
===================  ===========================  =================================================
densebatch           none (segment bounds)        ~2e-7  (isolated)
sdpa                 4-D boolean (rows, 1, T, T)  ~2e-7  (isolated)
eager                4-D additive float, min/0    ~2e-7  (isolated; a boolean mask leaks: 0.24-0.38)
flex_attention       -                            GPT-2 refuses it; Llama crashes the process
===================  ===========================  =================================================

So ``ALLOWED`` is {densebatch, sdpa, eager}; anything else raises ``ConfigError``. Under sdpa/eager,
when every row is one document followed by padding (``Batch.single_doc_rows``), neither mask nor
positions are passed: plain causal attention is exact for the real tokens because the padding comes
after them, and without ``position_ids`` transformers sees no packing and runs SDPA's causal kernel.

A 4-D mask is used by transformers as given, for every layer: a sliding-window architecture
(Mistral, Phi-3, Starcoder2; Gemma 2 and Qwen2 on some layers) would silently lose its window. So
the window is drawn into the mask here (``q - k < sliding_window`` within a document), and models
whose layers differ get one mask per layer type (``{"full_attention": ..., "sliding_attention": ...}``,
which transformers' Gemma 2 and Qwen2/3 accept in place of a tensor). Architectures that cannot be
isolated are refused when built (``REFUSED``: ALiBi models); soft-capped attention (Gemma 2), which
SDPA cannot compute, needs ``densebatch`` or ``eager``; Falcon before transformers 5.25,
which picks its attention classes itself, gets densebatch's class in its own table (``model/hf/falcon.py``). docs/hf-models.md has the table for every architecture,
measured by ``benchmarks/model/hf_isolation_table.py`` and checked by tests/model/hf/test_hf_architectures.py.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from densebatch.batch import IGNORE_INDEX, Batch, RowShard
from densebatch.errors import ConfigError
from densebatch.model.attention import pick_backend, plan_attention, rows_hold_one_document
from densebatch.model.hf.attention import NAME as DENSEBATCH
from densebatch.model.hf.attention import planned
from densebatch.model.hf.checks import REFUSED, layer_windows  # noqa: F401  (REFUSED: also read by tests)
from densebatch.model.hf.loading import ALLOWED, DTYPES, load_hf_model
from densebatch.model.hf.masks import hf_document_mask
from densebatch.model.loss_head import LOSS_HEADS, head_token_losses, plain_head_token_losses
from densebatch.model.quiet import quiet_progress

# Architectures whose logits are exactly lm_head(base_model(...).last_hidden_state) (no soft-capping,
# no logit scale), so token_losses may project only the positions that carry a target, through the
# fused chunked head (model/loss_head.py) when lm_head is a plain nn.Linear.
# (tests/model/hf/test_hf_architectures.py checks each against the model's own logits.)
HIDDEN_PATH_TYPES = {
    "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "olmo", "stablelm", "starcoder2",
    "opt", "gpt_bigcode", "falcon",
}  # fmt: skip


class HFCausalLM(nn.Module):
    """A local ``AutoModelForCausalLM`` (weights, or random init from config.json alone), or with
    ``task="mlm"`` an ``AutoModelForMaskedLM`` (an encoder: BERT, RoBERTa, DistilBERT, ModernBERT, ...)."""

    weighs_losses = True  # token_losses returns batch.loss_weights x CE when the batch has them
    eval_hits: Tensor | None = None  # mlm, eval mode: masked tokens predicted right by the last token_losses

    def __init__(
        self,
        path: str | Path,
        *,
        attn_implementation: str = DENSEBATCH,
        gradient_checkpointing: bool = False,
        loss_head: str = "fused",
        dtype: str = "float32",
        attention: str = "auto",
        empty_weights: bool = False,
        task: str = "causal",
        label_smoothing: float = 0.0,
    ) -> None:
        """``empty_weights``: the structure only, parameters on the meta device, for a sharded build that
        reads each rank's rows from the weight files (``model/hf/weights.py``). ``task`` (``batching.mode``):
        ``causal``, or ``mlm`` for an encoder masked LM (``AutoModelForMaskedLM``; attention bidirectional
        within each document, targets unshifted: the collator puts each masked token's label at its position)."""
        super().__init__()
        self.label_smoothing = label_smoothing  # train.label_smoothing (training passes only)
        if loss_head not in LOSS_HEADS:
            raise ValueError(f"loss_head: expected one of {', '.join(LOSS_HEADS)}; got {loss_head!r}")
        self.loss_head = loss_head
        path = Path(path)
        self.hf = load_hf_model(
            path, attn_implementation=attn_implementation, dtype=dtype, empty_weights=empty_weights, task=task
        )
        self.attn_implementation = attn_implementation
        self.attention = attention  # model.attention: the backend densebatch's kernel runs (auto picks per device)
        self.path = path.resolve()  # the base model a LoRA adapter names
        self.dtype = DTYPES[dtype]
        self.lora = False  # set by model/hf/lora.py's apply_lora
        self._windows = layer_windows(self.hf.config)
        self.task = task
        self.causal = task == "causal"
        emb = getattr(self.lm.base_model, "embeddings", None)  # RoBERTa's positions start after its padding row
        self.position_offset = int(emb.padding_idx) + 1 if hasattr(emb, "create_position_ids_from_input_ids") else 0
        if gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(self.hf, "activation_checkpointing_enable"):  # transformers >= 5.x name
                self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self._hidden_path = getattr(self.hf.config, "model_type", None) in HIDDEN_PATH_TYPES

    @property
    def lm(self) -> nn.Module:
        """The transformers model itself (``self.hf`` is a ``PeftModel`` around it when LoRA is on;
        its adapters are injected into this model's layers, so calling it runs them)."""
        return self.hf.get_base_model() if self.lora else self.hf

    @property
    def vocab_size(self) -> int:
        return int(input_embedding_weight(self.lm).shape[0])

    @property
    def max_positions(self) -> int | None:
        c = self.lm.config
        table = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
        return None if table is None else table - self.position_offset  # RoBERTa: rows 0..padding_idx unused

    # ---------------------------------------------------------------------------------- forward
    def _inputs(
        self,
        input_ids: Tensor,
        *,
        positions: Tensor,
        single_doc_rows: bool,
        cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None,
        branches: Tensor | None = None,
        shard: RowShard | None = None,
    ) -> AbstractContextManager[dict]:
        """The model's keyword inputs, as a context (densebatch's attention plan is published while it runs).
        Positions count from 0 in each document; a model whose position table starts after its padding
        row (RoBERTa: ``padding_idx + 1``) gets them shifted, as it shifts its own. ``shard``: rows split over
        context ranks, ``input_ids`` / ``positions`` this rank's columns (their true positions: rotary and
        position tables read them as they are); the plan is the whole rows' (``Batch.shard``)."""
        given = positions + self.position_offset if self.position_offset else positions
        if self.attn_implementation == DENSEBATCH:
            # The plan is built once here and reaches every layer's attention call as a keyword
            # (transformers forwards unknown keywords to the attention interface), no mask at all.
            whole = positions if shard is None else shard.positions
            backend = pick_backend(self.attention, input_ids.device, torch.is_grad_enabled(), whole.shape[-1])
            plan = plan_attention(
                positions,
                backend=backend,
                single_doc_rows=single_doc_rows,
                past_positions=None,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                causal=self.causal,
                branches=branches,
                shard=shard,
            )
            return planned(plan, input_ids=input_ids, position_ids=given, use_cache=False)
        if shard is not None:  # the run layer refuses it up front
            raise ConfigError(f"model.attn_implementation: {self.attn_implementation} cannot attend across context ranks")
        if single_doc_rows and self.causal and branches is None:
            # One document per row, starting at column 0: its positions are the model's default, and
            # padding only follows it. Passing no position_ids matters: transformers >= 4.56 reads the
            # restart of positions at the padding run as a second packed sequence and builds a 4-D mask,
            # where no mask lets SDPA run its causal kernel.
            return nullcontext(dict(input_ids=input_ids, use_cache=False))
        mask = hf_document_mask(
            positions, windows=self._windows, how=ALLOWED[self.attn_implementation], dtype=self.dtype, causal=self.causal,
            branches=branches,
        )  # fmt: skip
        return nullcontext(dict(input_ids=input_ids, position_ids=given, attention_mask=mask, use_cache=False))

    def forward(self, input_ids: Tensor, positions: Tensor, single_doc_rows: bool = False) -> Tensor:
        """Logits (rows, T, vocab), each document attending only to itself."""
        with self._inputs(input_ids, positions=positions, single_doc_rows=single_doc_rows) as inputs:
            return self.lm(**inputs).logits

    def token_losses(self, batch: Batch) -> Tensor:
        """Cross-entropy per position in float32, 0 where the label is -100. (rows, T)

        Architectures in ``HIDDEN_PATH_TYPES`` project only the positions with a target, through
        the fused chunked head unless ``loss_head="plain"``; others compute the model's own logits.
        An encoder (``task`` mlm) in eval mode also leaves the number of masked tokens it predicted
        right in ``eval_hits`` (a device scalar, read by ``train/evaluate.py``: no host sync here).
        """
        single = rows_hold_one_document(batch)
        eps = self.label_smoothing if self.training else 0.0  # evaluation reports the plain cross-entropy
        plan_inputs = dict(
            positions=batch.positions, single_doc_rows=single, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen,
            branches=None if batch.pairs is None else batch.pairs.branches,
            shard=batch.shard,
        )  # fmt: skip
        with self._inputs(batch.input_ids, **plan_inputs) as inputs:
            if not self._hidden_path:
                logits = self.lm(**inputs).logits  # (rows, T, vocab)
                if not (self.training or self.causal):  # masked-token accuracy, which evaluation reports
                    self.eval_hits = ((logits.argmax(-1) == batch.labels) & (batch.labels != IGNORE_INDEX)).sum()
                return plain_head_token_losses(logits, batch.labels, nn.Identity(), eps, batch.loss_weights)
            h = self.lm.base_model(**inputs).last_hidden_state  # (rows, T, C)
        head = self.lm.get_output_embeddings()  # a frozen nn.Linear under LoRA, or PEFT's wrapper (trainable tokens)
        w = batch.loss_weights  # weight x CE per position (train.source_balance), or None
        if self.loss_head == "plain" or type(head) is not nn.Linear:
            return plain_head_token_losses(h, batch.labels, head, eps, w)
        return head_token_losses(
            h, batch.labels, head.weight, head.bias, batch.num_loss_tokens, label_smoothing=eps, token_weights=w
        )

    def _layers(self) -> nn.ModuleList | None:
        """The repeated layers: the largest ModuleList."""
        return max(
            (m for m in self.lm.modules() if isinstance(m, nn.ModuleList)),
            key=lambda m: sum(p.numel() for p in m.parameters()),
            default=None,
        )

    # -------------------------------------------------------------------------------- structure
    def layer_groups(self) -> dict[str, list[nn.Parameter]]:
        """embeddings: input/output embedding matrices and any other nn.Embedding (e.g. GPT-2's
        position table); blocks: the largest ModuleList (the repeated layers); head: the rest
        (final norm, an untied output matrix). Each parameter exactly once, frozen ones included (the
        optimizer leaves out those that do not require a gradient: all but the adapters under LoRA)."""
        seen: set[int] = set()

        def take(params) -> list[nn.Parameter]:
            out = []
            for p in params:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
            return out

        layers = self._layers()
        embeddings = take(self.lm.get_input_embeddings().parameters())
        blocks = take(layers.parameters()) if layers is not None else []
        embeddings += take(p for m in self.lm.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
        out_emb = self.lm.get_output_embeddings()
        head = take(p for p in self.lm.parameters() if out_emb is None or all(p is not q for q in out_emb.parameters()))
        if out_emb is not None:
            head += take(out_emb.parameters())
        return {"embeddings": embeddings, "blocks": blocks, "head": head}

    def output_embeddings(self) -> list[nn.Parameter]:
        """The output embedding matrix (an untied lm_head, or the input embeddings when tied): the
        optimizer treats it as an embedding (no weight decay unless ``decay_all``)."""
        head = self.lm.get_output_embeddings()
        return [] if head is None else [p for p in head.parameters() if p.ndim >= 2]

    def resize_vocab(self, vocab_size: int, known: int | None = None) -> list[int]:
        """Make room for a tokenizer of ``vocab_size`` ids; the ids from ``known`` on (the tokens the
        tokenizer added to the one the model was trained with: ``tok.base_vocab_size``) get rows set
        to the mean of the rows before them, in the input and output embeddings (tied or not) and
        an output bias. Returns those new ids.

        The tables grow when the tokenizer is larger (``resize_token_embeddings``; ``config.vocab_size``
        follows, so the saved model and tokenizer agree). A table already padded past the tokenizer
        (Qwen's) keeps its size, but the rows of the new ids, never trained, are set all the same.
        The mean (transformers' ``mean_resizing`` without its random jitter) keeps a new token's
        logit near the average at the start, so the loss does not jump, and needs no random numbers:
        the same base model and tokenizer always give the same rows.
        """
        if self.lora:
            raise AssertionError("resize the vocabulary before adding LoRA adapters")
        rows = self.vocab_size
        if vocab_size > rows:
            self.hf.resize_token_embeddings(vocab_size, mean_resizing=False)
        start = min(rows, known if known is not None else rows)
        if start >= vocab_size:
            return []
        self.new_rows = (start, vocab_size)  # a sharded build fills these rows itself
        if start < 1:
            raise ConfigError(f"data.tokenizer: no base vocabulary to initialise {vocab_size} new token rows from")
        with torch.no_grad():
            tables = [input_embedding_weight(self.hf)]
            head = self.hf.get_output_embeddings()
            if head is not None and head.weight is not tables[0]:
                tables.append(head.weight)
            if head is not None and getattr(head, "bias", None) is not None:
                tables.append(head.bias)
            for t in tables:
                t[start:vocab_size] = t[:start].float().mean(0).to(t.dtype)  # (new, C) or (new,)
        return list(range(start, vocab_size))

    # ------------------------------------------------------------------------------------- I/O
    def save(self, path: str | Path, adapter: dict[str, Tensor] | None = None) -> None:
        """``save_pretrained`` (safetensors): ``AutoModelForCausalLM.from_pretrained(path)`` loads it.
        Under LoRA, the adapter alone (PEFT's ``save_pretrained``: adapter_config.json and
        adapter_model.safetensors, naming this base model by its absolute path); ``save_merged``
        writes the plain model. ``adapter``: the adapter's tensors whole (by state-dict key), for a
        model whose own are shards.

        PEFT would also save both whole embedding tables once they grew (``save_embedding_layers``
        "auto"): vocabulary x width each, the size of a small model. They carry nothing new: the base
        rows are the base model's, and the added tokens' rows are the adapter's trainable tokens
        (``load_adapter`` rebuilds the grown tables from the base), so they are left out."""
        if not self.lora:
            with quiet_progress():
                self.hf.save_pretrained(path)
            return
        for config in self.hf.peft_config.values():
            config.base_model_name_or_path = str(self.path)
        with quiet_progress():
            state = None if adapter is None else {k.removeprefix("hf."): v for k, v in adapter.items()}
            self.hf.save_pretrained(path, save_embedding_layers=False, state_dict=state)

    def export_names(self, keys: list[str]) -> dict[str, str] | None:
        """State-dict key -> name in ``save_pretrained``'s weight files (tied duplicates are the writer's to
        drop: they are one tensor); None under LoRA, whose saved form is PEFT's adapter."""
        if self.lora:
            return None
        return {k: k.removeprefix("hf.") for k in keys}

    def write_config(self, path: str | Path) -> None:
        """``config.json`` (and ``generation_config.json``) as ``save_pretrained`` writes them, without weights:
        with the weights' dtype and the architecture's class name (``fully_shard`` prefixes it with FSDP)."""
        self.hf.config.dtype = str(self.dtype).split(".")[1]
        self.hf.config.architectures = [type(self.hf).__name__.removeprefix("FSDP")]
        self.hf.config.save_pretrained(path)
        generation = getattr(self.hf, "generation_config", None)
        if generation is not None and self.hf.can_generate():
            generation.save_pretrained(path)

    def vocab_table_names(self) -> set[str]:
        """Parameter names of the input embedding, an untied output head and its bias (what added tokens grow)."""
        ids = {id(input_embedding_weight(self.hf))}
        head = self.hf.get_output_embeddings()
        if head is not None:
            ids |= {id(head.weight)} | ({id(head.bias)} if getattr(head, "bias", None) is not None else set())
        return {n for n, p in self.named_parameters() if id(p) in ids}

    def save_merged(self, path: str | Path) -> None:
        """A plain Hugging Face model (``from_pretrained`` loads it): LoRA adapters merged into the
        weights they adapt (``merge_and_unload``, in place: this model is spent afterwards)."""
        model = self.hf.merge_and_unload() if self.lora else self.hf
        with quiet_progress():
            model.save_pretrained(path)


def input_embedding_weight(model: nn.Module) -> Tensor:
    """The input embedding matrix (under PEFT's trainable tokens, the frozen table it wraps)."""
    emb = model.get_input_embeddings()
    base = getattr(emb, "get_base_layer", None)
    return (base() if base is not None else emb).weight
