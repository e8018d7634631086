"""What the installed torch offers, read from the release itself, and which attention kernels a run used.

Every torch entry point densebatch calls whose form differs between the releases ``pyproject.toml``
admits is reached through a check here that reads the installed release: a Python function's
signature (``inspect``), an operator's schema (``torch.ops.aten.<op>``), or the presence of a name;
never a version string. Where a release lacks what a path needs, the caller takes its next kernel and
says why (``record_kernel``), or refuses in one line (``require``).

The signatures of ``torch.nn.attention.varlen.varlen_attn`` by release (each read from that release's
own ``torch/nn/attention/varlen.py``; ``tests/model/test_torch_releases.py`` replays them):

- 2.10 ``(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)``
- 2.11 ``(..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1))``: ``is_causal`` gone (causal
  is ``window_size=(-1, 0)``)
- 2.12, 2.13 add ``enable_gqa=False, seqused_k, block_table, num_splits`` (keyword-only); with
  ``enable_gqa`` False they refuse key/value heads fewer than the query's.

The record of kernels is process-wide: ``model/attention.py`` notes what each layer call ran, the
training loop reads it for the run's summary and the last record of ``metrics.jsonl``.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from densebatch.errors import ConfigError


# ------------------------------------------------------------------------------------------ varlen
@dataclass(frozen=True)
class Varlen:
    """How this release's ``varlen_attn`` is called: which of the keywords densebatch may pass it takes."""

    fn: Callable
    scale: bool  # scale= (2.11+)
    window_size: bool  # window_size=(left, right) (2.11+); causal is (-1, 0)
    is_causal: bool  # is_causal= (2.10 only)
    enable_gqa: bool  # enable_gqa= (2.12+): without it, fewer key/value heads go in as they are or expanded


def varlen() -> Varlen | None:
    """The installed ``varlen_attn`` and what it takes; None where the release has none."""
    try:
        from torch.nn.attention import varlen as module
    except ImportError:
        return None
    fn = getattr(module, "varlen_attn", None)
    return None if fn is None else _varlen_of(fn)


@lru_cache(maxsize=16)
def _varlen_of(fn: Callable) -> Varlen:
    params = inspect.signature(fn).parameters
    return Varlen(fn, "scale" in params, "window_size" in params, "is_causal" in params, "enable_gqa" in params)


def varlen_call(
    features: Varlen, *, causal: bool, window: int | None, scale: float | None, head_dim: int, gqa: bool
) -> tuple[dict | None, str]:
    """The keywords for one call (None and the reason where this release cannot compute it). ``gqa``: fewer
    key/value heads than query heads; ``enable_gqa`` is passed only then (and only where it exists)."""
    kw: dict = {}
    if scale is not None and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        if not features.scale:
            return None, "this torch's varlen_attn takes no scale"
        kw["scale"] = scale
    elif scale is not None and features.scale:
        kw["scale"] = scale
    if features.window_size:
        left = -1 if window is None else window - 1  # FlashAttention's window counts the keys before q
        kw["window_size"] = (left, 0 if causal else left)  # (-1, 0): causal; (-1, -1): the whole document
    elif features.is_causal:
        if window is not None:
            return None, "this torch's varlen_attn takes no window_size"
        kw["is_causal"] = causal
    else:
        return None, "this torch's varlen_attn takes neither window_size nor is_causal"
    if gqa and features.enable_gqa:
        kw["enable_gqa"] = True
    return kw, ""


@lru_cache(maxsize=16)
def varlen_takes_grouped_heads(fn: Callable, device: str) -> bool:
    """Whether a ``varlen_attn`` without ``enable_gqa`` (2.10, 2.11) computes fewer key/value heads as they
    are: its wrapper checks no heads and hands them to ``aten._flash_attention_forward``, the op to which 2.12's
    ``enable_gqa=True`` hands the very same tensors. Tried once per device on tiny tensors, forward and
    backward, against the same call with the heads expanded; any error or difference answers False (the
    caller then expands the heads: exact, at the cost of the key/value copies)."""
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(torch.device(device).type, enabled=False):
        return _probe_grouped_heads(fn, torch.device(device))


def _probe_grouped_heads(fn: Callable, dev: torch.device) -> bool:
    dtype = torch.bfloat16 if dev.type != "cuda" or torch.cuda.is_bf16_supported() else torch.float16
    gen = torch.Generator(device="cpu").manual_seed(0)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=dev)
    q = torch.randn(16, 2, 16, generator=gen).to(dev, dtype).requires_grad_()
    kv = [torch.randn(16, 1, 16, generator=gen).to(dev, dtype).requires_grad_() for _ in range(2)]
    features = _varlen_of(fn)
    kw, _ = varlen_call(features, causal=True, window=None, scale=None, head_dim=16, gqa=False)
    if kw is None:
        return False
    try:
        out = fn(q, kv[0], kv[1], cu, cu, 11, 11, **kw)
        grads = torch.autograd.grad(out.float().sum(), [q, *kv])
        wide = [x.detach().repeat_interleave(2, dim=1).requires_grad_() for x in kv]
        ref = fn(q, wide[0], wide[1], cu, cu, 11, 11, **kw)
        ref_grads = torch.autograd.grad(ref.float().sum(), [q, *wide])
    except (RuntimeError, TypeError, ValueError):
        return False
    same = torch.allclose(out.float(), ref.float(), atol=1e-2) and torch.allclose(
        grads[0].float(), ref_grads[0].float(), atol=1e-2
    )
    for g, w in zip(grads[1:], ref_grads[1:]):  # a shared head's gradient is the sum over the query heads that read it
        same = same and g.shape == (16, 1, 16) and torch.allclose(g.float(), w.float().sum(1, keepdim=True), atol=5e-2)
    return bool(same)


# ------------------------------------------------------------------------------------ other entry points
@cache
def op_arguments(op: str) -> frozenset[str]:
    """The argument names of ``torch.ops.aten.<op>`` over all its overloads (empty where it is absent)."""
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return frozenset()
    try:
        overloads = packet.overloads()
    except (AttributeError, RuntimeError):
        return frozenset()
    return frozenset(a.name for o in overloads for a in getattr(packet, o)._schema.arguments)


def sdpa_gqa() -> bool:
    """``scaled_dot_product_attention(enable_gqa=)``: grouped key/value heads shared, not repeated."""
    return "enable_gqa" in op_arguments("scaled_dot_product_attention")


def flex_attention() -> Callable | None:
    """``flex_attention`` where the release has it (with ``enable_gqa`` and ``block_mask``, as densebatch calls it)."""
    try:
        from torch.nn.attention.flex_attention import flex_attention as fn
    except ImportError:
        return None
    params = inspect.signature(fn).parameters
    return fn if {"block_mask", "score_mod", "scale", "enable_gqa"} <= set(params) else None


def fully_shard() -> Callable | None:
    """FSDP2's ``fully_shard`` (public in ``torch.distributed.fsdp``) with ``mp_policy``; None where absent."""
    try:
        from torch.distributed import fsdp
    except ImportError:
        return None
    fn = getattr(fsdp, "fully_shard", None)
    return fn if fn is not None and "mp_policy" in inspect.signature(fn).parameters else None


@cache
def all_to_all_autograd() -> Callable | None:
    """``torch.distributed._functional_collectives.all_to_all_single_autograd`` (an all-to-all whose backward is
    the reverse exchange: context parallelism's attention) with ``init_device_mesh``; None where absent."""
    try:
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError:
        return None
    fn = getattr(funcol, "all_to_all_single_autograd", None)
    if fn is None or init_device_mesh is None:
        return None
    return fn if {"output_split_sizes", "input_split_sizes", "group"} <= set(inspect.signature(fn).parameters) else None


def dcp_state_dict() -> bool:
    """``torch.distributed.checkpoint.state_dict``'s get/set helpers for model and optimizer, and their options."""
    try:
        from torch.distributed.checkpoint import state_dict as sd
    except ImportError:
        return False
    names = ("get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict")
    return all(hasattr(sd, n) for n in names) and "full_state_dict" in inspect.signature(sd.StateDictOptions).parameters


def autocast_dtype_query() -> bool:
    """``torch.is_autocast_enabled(device_type)`` and ``torch.get_autocast_dtype(device_type)``."""
    return hasattr(torch, "get_autocast_dtype") and hasattr(torch, "is_autocast_enabled")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` now; None outside autocast."""
    if autocast_dtype_query() and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def grad_scaler() -> bool:
    """``torch.amp.GradScaler(device)`` (the device-generic loss scaler)."""
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    return scaler is not None and "device" in inspect.signature(scaler.__init__).parameters


def fused_adamw() -> bool:
    """``torch.optim.AdamW(fused=True)``."""
    return "fused" in inspect.signature(torch.optim.AdamW.__init__).parameters


def nonzero_static() -> bool:
    """``torch.nonzero_static(x, size=)``: indices without a host synchronisation."""
    return "size" in op_arguments("nonzero_static")


_FP32_OUT: dict[str, bool] = {}


def addmm_out_dtype(device: torch.device) -> bool:
    """``torch.addmm(..., out_dtype=torch.float32)`` on bf16 inputs: in the op's schema and running on ``device``
    (CUDA; not CPU in 2.13), tried once per device type."""
    key = torch.device(device).type
    if key not in _FP32_OUT:
        _FP32_OUT[key] = False
        if "out_dtype" in op_arguments("addmm"):
            try:
                a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
                out = torch.addmm(torch.zeros(2, 2, device=device), a, a, out_dtype=torch.float32)
                _FP32_OUT[key] = out.dtype == torch.float32
            except (RuntimeError, NotImplementedError, TypeError):
                pass
    return _FP32_OUT[key]


def allow_tf32() -> str:
    """TF32 tensor cores for fp32 matrix products and convolutions (CUDA), through the ``fp32_precision`` settings
    where the release has them (mixing them with the legacy ``allow_tf32`` flags is an error in the releases that
    have both, and transformers' compile path sets the new ones), else the legacy flags. Returns the API used."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision") and hasattr(torch.backends.cudnn, "conv"):
        matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        return "fp32_precision"
    matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return "allow_tf32"


FEATURES: dict[str, Callable[[], object]] = {
    "varlen_attn": varlen,
    "flex_attention": flex_attention,
    "scaled_dot_product_attention(enable_gqa=)": sdpa_gqa,
    "FSDP2 fully_shard": fully_shard,
    "functional all_to_all_single_autograd": all_to_all_autograd,
    "DCP state_dict helpers": dcp_state_dict,
    "autocast dtype query": autocast_dtype_query,
    "torch.amp.GradScaler": grad_scaler,
    "fused AdamW": fused_adamw,
    "nonzero_static": nonzero_static,
    "addmm(out_dtype=)": lambda: "out_dtype" in op_arguments("addmm"),
}


def missing() -> list[str]:
    """The entry points of ``FEATURES`` this torch lacks (each path falls back or refuses where it is used)."""
    return [name for name, check in FEATURES.items() if not check()]


def require(available: object, what: str, purpose: str) -> None:
    """One line (``ConfigError``) where ``purpose`` needs ``what`` and this torch lacks it."""
    if not available:
        raise ConfigError(f"{purpose} needs {what}, which this torch ({torch.__version__}) lacks; install a newer torch")


# ------------------------------------------------------------------------------- kernels a run used
_KERNELS: Counter = Counter()


def record_kernel(description: str) -> None:
    """Count one layer call of ``description`` (e.g. ``varlen (FlashAttention) bf16``, or a fallback and why)."""
    _KERNELS[description] += 1


def kernels_used() -> dict[str, int]:
    """``{description: layer calls}`` since ``reset_kernels``, most used first."""
    return dict(_KERNELS.most_common())


def reset_kernels() -> None:
    _KERNELS.clear()
