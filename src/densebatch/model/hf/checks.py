"""What the Hugging Face adapter checks before it builds a model: that the directory holds a decoder-only
causal LM (or, for ``batching.mode: mlm``, an encoder masked LM), that the architecture can keep packed
documents apart under the chosen attention, and which sliding window each layer type has (``model/hf/adapter.py``
draws it into a mask or passes it to the kernel); and the one line a user reads when transformers cannot make
a model of the directory's files (``unbuildable``)."""

from __future__ import annotations

import json
from pathlib import Path

from densebatch.errors import ConfigError, json_type
from densebatch.model.hf.attention import NAME as DENSEBATCH

MIN_TRANSFORMERS = "5.5.4"  # the oldest transformers the test suite passes with (pyproject.toml says which fail)


def check_transformers(version: str | None = None) -> None:
    """``ConfigError`` in one line when transformers ``version`` (None: the installed one's) is older than
    ``MIN_TRANSFORMERS``: an older one fails inside transformers (a keyword Falcon does not take, encoders'
    masks) or, worse, runs with other losses (HF Trainer under DDP in 5.5.0)."""
    from packaging.version import InvalidVersion, Version  # a dependency of transformers

    if version is None:
        import transformers

        version = transformers.__version__

    try:
        old = Version(version) < Version(MIN_TRANSFORMERS)  # 5.5.4rc1 is older, as pip reads it
    except InvalidVersion:
        return  # a build that names itself oddly: let it run
    if old:
        raise ConfigError(
            f"model.kind hf needs transformers >= {MIN_TRANSFORMERS} (installed: {version}): pip install -U 'densebatch[hf]'"
        )


# Architectures that cannot keep packed documents apart, and why (refused when built).
_ALIBI = (
    "uses ALiBi position biases, which it derives from a 2-D padding mask and not from position_ids, and accepts "
    "no 4-D document mask: packed documents cannot be isolated"
)
REFUSED = {"bloom": _ALIBI, "mpt": _ALIBI}


def layer_windows(config) -> dict[str, int | None]:
    """Layer type -> sliding window (None: full causal attention), the types of the model's layers.

    ``config.layer_types`` names each layer's type when they differ (Gemma 2, Qwen2 with
    ``use_sliding_window``); without it a ``sliding_window`` applies to every layer (Mistral, Phi-3,
    Starcoder2). Only these two types are known; another (e.g. chunked attention) is refused.
    """
    window = getattr(config, "sliding_window", None) or None
    types = set(getattr(config, "layer_types", None) or ())
    unknown = types - {"full_attention", "sliding_attention"}
    if unknown:
        raise ConfigError(
            f"model.path: {config.model_type} has layers of type {sorted(unknown)[0]!r}, whose mask densebatch "
            "cannot draw: packed documents would not be isolated"
        )
    if window is None or types == {"full_attention"}:
        return {"full_attention": None}
    if not types or types == {"sliding_attention"}:
        return {"sliding_attention": window}
    return {"full_attention": None, "sliding_attention": window}


def check_architecture(config, attn_implementation: str) -> None:
    """``ConfigError`` for an architecture that cannot keep packed documents apart under this
    attention implementation (see ``REFUSED``; soft-capped attention logits need eager)."""
    kind = getattr(config, "model_type", "?")
    if kind in REFUSED or (kind == "falcon" and getattr(config, "alibi", False)):
        raise ConfigError(f"model.path: {kind} is not supported: it {REFUSED.get(kind, _ALIBI)}")
    if getattr(config, "attn_logit_softcapping", None) and attn_implementation == "sdpa":
        raise ConfigError(
            f"model.attn_implementation: {kind} soft-caps its attention scores, which SDPA cannot compute "
            f"(it would give other logits); set model.attn_implementation: {DENSEBATCH} (or eager)"
        )


CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")  # the class names of decoder-only language models
MASKED_HEADS = ("ForMaskedLM",)  # the class names of encoder masked language models
_ENCODERS = {"bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "megatron-bert", "roberta-prelayernorm", "xmod"}
# Encoders whose packed documents are checked to attend only to themselves (tests/model/hf/test_hf_mlm.py);
# XLM-RoBERTa and CamemBERT run RoBERTa's code. Other masked LMs (DeBERTa-v2 reads a mask of its own
# kind, RoFormer, MPNet, ...) are refused for batching.mode mlm until they are checked.
MLM_CHECKED = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "modernbert")
TASKS = {"causal": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
         "mlm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES")}  # fmt: skip


def check_model_dir(path: str | Path, task: str = "causal") -> dict:
    """``ConfigError`` in one line, before anything is loaded, when ``path`` does not hold a model of ``task``
    (``causal``: a decoder-only causal LM; ``mlm``, ``batching.mode: mlm``: an encoder masked LM): no
    ``config.json``, an encoder-decoder, a saved class of the other kind (``BertForMaskedLM`` for a causal
    run: ``AutoModelForCausalLM`` would load it as ``BertLMHeadModel``, which reads the future unless it was
    built as a decoder; a causal LM for an mlm run), an encoder built as a decoder for mlm, a causal head
    over an encoder that is not a decoder (either mode), a model type transformers has no such class for,
    or a saved class other than the one transformers would build, its own classes included (a model is
    never loaded through a class it was not saved as). Returns the parsed config.json."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: '{path}' has no config.json (expected a local Hugging Face model directory)")
    try:
        meta = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.path: {path / 'config.json'} is not valid JSON ({e})") from None
    kind, saved = _names(meta, path / "config.json")
    mlm = task == "mlm"
    auto = TASKS[task][0]
    if mlm:
        supported = "batching.mode mlm trains encoder masked LMs (a class ending in ForMaskedLM)"
    else:
        supported = "densebatch trains decoder-only causal LMs (a class ending in ForCausalLM or LMHeadModel)"
    if meta.get("is_encoder_decoder"):
        raise ConfigError(f"model.path: {path} holds an encoder-decoder ({', '.join(saved) or kind}); {supported}")
    heads, other = (MASKED_HEADS, CAUSAL_HEADS) if mlm else (CAUSAL_HEADS, MASKED_HEADS)
    decoder = bool(meta.get("is_decoder"))
    if kind in _ENCODERS and not decoder and saved and all(a.endswith(CAUSAL_HEADS) for a in saved):
        raise ConfigError(  # neither mode trains it as saved: each would send the user to the other
            f"model.path: {path} holds {', '.join(saved)} with is_decoder false: a causal LM's head over a {kind} "
            "encoder that attends to later tokens; for batching.mode mlm save it as a ...ForMaskedLM class "
            "(config.json's architectures), for causal set is_decoder: true in config.json"
        )
    if saved and not any(a.endswith(heads) for a in saved):
        hint = f": set batching.mode: {'causal' if mlm else 'mlm'}" if any(a.endswith(other) for a in saved) else ""
        raise ConfigError(
            f"model.path: {path} holds {', '.join(saved)}, not a {'masked' if mlm else 'causal'} LM ({auto} would load "
            f"{model_class(kind, task) or 'nothing'} with its own head); {supported}{hint}"
        )
    if mlm and decoder:
        raise ConfigError(
            f"model.path: {path} holds a {kind} built as a decoder (is_decoder true: it attends only to earlier "
            f"tokens, and {auto}.from_pretrained would run it so); {supported} with bidirectional attention: set "
            "is_decoder: false in config.json"
        )
    if not mlm and kind in _ENCODERS and not decoder:
        raise ConfigError(
            f"model.path: {path} holds a {kind} encoder (is_decoder false: it attends to later tokens); {supported}, "
            "or set batching.mode: mlm"
        )
    if mlm and kind not in MLM_CHECKED:
        raise ConfigError(
            f"model.path: batching.mode mlm keeps packed documents apart for {', '.join(MLM_CHECKED)} (checked); "
            f"{path} holds a {kind}, which is not checked yet"
        )
    built = model_class(kind, task)
    if built is None:
        raise ConfigError(
            f"model.path: transformers has no {'masked' if mlm else 'causal'} LM for model type {kind!r} ({path}); {supported}"
        )
    mismatched = [a for a in saved if a.endswith(heads) and a != built]
    if mismatched:  # a class of the model's own repository too (remote code is not run here)
        raise ConfigError(
            f"model.path: {path} was saved as {mismatched[0]} but {auto} would load it as {built}: a model is not "
            f"trained through a class it was not saved as (if it is that model, name {built} in config.json's "
            "architectures)"
        )
    return meta


def _names(meta, cfg_file: Path) -> tuple[str, list[str]]:
    """(model_type, the saved class names) of a parsed config.json; ``ConfigError`` naming the file when it is
    not an object or those fields are not a name and a list of names."""
    why = None if isinstance(meta, dict) else f"expected a JSON object; got {json_type(meta)}"
    kind, saved = (meta.get("model_type", "?"), meta.get("architectures") or []) if why is None else ("?", [])
    if why is None and not isinstance(kind, str):
        why = f"model_type must be a string (got {kind!r})"
    elif why is None and not isinstance(saved, (list, str)):
        why = f"architectures must be a list of class names (got {saved!r})"
    if why is not None:
        raise ConfigError(f"model.path: {cfg_file} is not a model configuration: {why}")
    return kind, [a for a in ([saved] if isinstance(saved, str) else saved) if isinstance(a, str)]


def read_hf_config(path: Path):
    """``AutoConfig.from_pretrained(path)``; ``ConfigError`` in one line when transformers cannot read its
    config.json (a value of the wrong type: ``"n_layer": "two"``)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except load_errors() as e:
        raise unbuildable(e, path, "read its config.json") from None


def load_errors() -> tuple[type[Exception], ...]:
    """What transformers raises when a directory's files do not make a model: a config value of the wrong type
    or size (a width its heads do not divide, a negative dimension, an unknown activation), weights that are
    damaged, truncated or of other shapes than the config's. Not TypeError or AttributeError: those are bugs."""
    from safetensors import SafetensorError

    try:
        from huggingface_hub.errors import StrictDataclassError  # a config field of the wrong type
    except ImportError:  # an older hub, which has no strict configs
        StrictDataclassError = ValueError  # noqa: N806
    return (OSError, ValueError, KeyError, ZeroDivisionError, RuntimeError, SafetensorError, StrictDataclassError)


def unbuildable(e: Exception, path: Path, doing: str) -> ConfigError:
    """The one line for ``e``, raised by transformers while it was ``doing`` (read its config.json, build the
    model...) with the files of ``path``: the exception's type and message, weights named when they are at fault."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    text = text if len(text) <= 200 else text[:197] + "..."
    if "ignore_mismatched_sizes" in text:  # printed after transformers' load report, which lists each tensor
        return ConfigError(
            f"model.path {path}: transformers could not load its weights: their shapes do not match its config.json "
            "(transformers' load report above lists each tensor)"
        )
    if doing.startswith("build") and (isinstance(e, OSError) or type(e).__name__ == "SafetensorError" or "state_dict" in text):
        doing = "load its weights"  # from_pretrained builds, then reads the weights: these are the weights' fault
    return ConfigError(f"model.path {path}: transformers could not {doing}: {type(e).__name__}: {text}")


def model_class(model_type: str, task: str = "causal") -> str | None:
    """The class transformers' Auto class for ``task`` builds for ``model_type`` (None: none)."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        raise ConfigError("model.kind hf needs transformers: pip install 'densebatch[hf]'") from None
    return getattr(modeling_auto, TASKS[task][1]).get(model_type)


def attention_heads(config) -> tuple[int, int]:
    """(query heads, key/value heads) of a transformers ``config``'s attention layers, from the fields the
    architectures spell them with: GPT-2's ``n_head``, Falcon's ``num_kv_heads`` (its new architecture) and
    ``multi_query`` (one key/value head: Falcon, GPTBigCode), else ``num_key_value_heads`` (as many as query
    heads when absent)."""
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    if getattr(config, "new_decoder_architecture", False):
        return heads, config.num_kv_heads
    if getattr(config, "multi_query", False):
        return heads, 1
    return heads, getattr(config, "num_key_value_heads", None) or heads
