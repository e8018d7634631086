"""densebatch's varlen attention against the recorded ``varlen_attn`` of every torch release pyproject admits.

Each stub below has exactly the parameters of ``torch.nn.attention.varlen.varlen_attn`` in one release
(read from that release's own ``torch/nn/attention/varlen.py``, see ``densebatch.torch_features``) and
computes through a CPU reference, so the keywords densebatch passes, the kernel it picks and the result
are checked on CPU for each release, with grouped-query heads (H=4, Hkv=2) and without. The 2.10 and 2.11
stubs take fewer key/value heads as they are (their wrappers check no heads; aten's FlashAttention divides
them, as 2.12's ``enable_gqa=True`` relies on); ``refuses_grouped_heads`` covers a kernel that would not.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from densebatch import torch_features
from densebatch.batch import segment_bounds
from densebatch.model.attention import PLAIN, AttnOptions, attend, available_backends, plan_attention

varlen_module = pytest.importorskip("torch.nn.attention.varlen")

CALLS: list[dict] = []


def _reference(query, key, value, cu, left: int, right: int, scale: float | None) -> torch.Tensor:
    """Attention within each segment of ``cu`` in float32 on CPU, FlashAttention's window semantics
    ((-1, -1): whole segment; (-1, 0): causal; (w, 0): causal, w keys back). (N, H, D) in query's dtype."""
    H, Hkv, D = query.shape[1], key.shape[1], query.shape[2]
    if H % Hkv:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    out = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[a:b].float().transpose(0, 1) for x in (query, key, value))  # (h, n, D)
        k, v = (x.repeat_interleave(H // Hkv, dim=0) for x in (k, v))
        i = torch.arange(b - a)
        d = i[:, None] - i[None, :]  # q - k
        allowed = torch.ones(b - a, b - a, dtype=torch.bool)
        if left >= 0:
            allowed &= d <= left
        if right >= 0:
            allowed &= -d <= right
        s = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale if scale is not None else D**-0.5)
        out.append(s.transpose(0, 1))
    return torch.cat(out).to(query.dtype)


def _record(release: str, args: tuple, kwargs: dict) -> None:
    if args[0].shape[0] == len(ROWS) * T:  # not torch_features' one-off probe of a kernel's grouped heads
        CALLS.append({"release": release, "dtypes": tuple(x.dtype for x in args[:3]), "kv_heads": args[1].shape[1], **kwargs})


# ---------------------------------------------------------------- the recorded signatures, one per release
def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    _record("2.10", (query, key, value), {"is_causal": is_causal})
    return _reference(query, key, value, cu_seq_q, -1, 0 if is_causal else -1, None)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    _record("2.11", (query, key, value), {"scale": scale, "window_size": window_size})
    return _reference(query, key, value, cu_seq_q, window_size[0], window_size[1], scale)


def _check_heads(query, key, enable_gqa):  # 2.12 and 2.13 alike (varlen.py: "Try setting enable_gqa=True for GQA.")
    if not enable_gqa and query.size(1) != key.size(1):
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got Hq={query.size(1)} and Hkv={key.size(1)}."
        )


def varlen_2_12(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    _check_heads(query, key, enable_gqa)
    _record("2.12", (query, key, value), {"scale": scale, "window_size": window_size, "enable_gqa": enable_gqa})
    return _reference(query, key, value, cu_seq_q, window_size[0], window_size[1], scale)


def varlen_2_13(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    _check_heads(query, key, enable_gqa)
    _record("2.13", (query, key, value), {"scale": scale, "window_size": window_size, "enable_gqa": enable_gqa})
    return _reference(query, key, value, cu_seq_q, window_size[0], window_size[1], scale)


def refuses_grouped_heads(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """2.11's signature over a kernel that cannot share key/value heads (densebatch must expand them)."""
    if query.size(1) != key.size(1):
        raise RuntimeError("this kernel needs as many key/value heads as query heads")
    return varlen_2_11(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale, window_size=window_size
    )


RELEASES = {"2.10": varlen_2_10, "2.11": varlen_2_11, "2.12": varlen_2_12, "2.13": varlen_2_13}
ROWS, T, H, D = [[9, 14, 5], [20, 8], [3, 11, 1, 7]], 28, 4, 8


@pytest.fixture(autouse=True)
def _fresh():
    CALLS.clear()
    torch_features.reset_kernels()
    yield
    torch_features.reset_kernels()


def _positions() -> torch.Tensor:
    out = torch.zeros(len(ROWS), T, dtype=torch.int64)
    for r, lengths in enumerate(ROWS):
        pos = [p for n in lengths for p in range(n)]
        out[r] = torch.tensor(pos + list(range(T - len(pos))))
    return out


def _qkv(kv_heads: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(len(ROWS), H, T, D, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(len(ROWS), kv_heads, T, D, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v


def _run(fn, kv_heads: int, opts: AttnOptions = PLAIN, causal: bool = True, monkeypatch=None):
    monkeypatch.setattr(varlen_module, "varlen_attn", fn)
    pos = _positions()
    cu, longest = segment_bounds(pos)
    q, k, v = _qkv(kv_heads)
    plan = plan_attention(pos, backend="varlen", cu_seqlens=cu, max_seqlen=longest, causal=causal)
    out = attend(q, k=k, v=v, plan=plan, opts=opts)
    used = torch_features.kernels_used()
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref_plan = plan_attention(pos, backend="masked", causal=causal)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = attend(qf, k=kf, v=vf, plan=ref_plan, opts=opts)
    ref_grads = torch.autograd.grad(ref.sum(), (qf, kf, vf))
    assert torch.allclose(out.float(), ref, atol=3e-2), (out.float() - ref).abs().max()
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape and torch.allclose(g.float(), r, atol=6e-2), (g.float() - r).abs().max()
    torch_features.reset_kernels()
    return used


@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("release", list(RELEASES))
def test_each_release_gets_only_the_keywords_it_takes_and_runs_varlen(release, kv_heads, monkeypatch):
    used = _run(RELEASES[release], kv_heads, monkeypatch=monkeypatch)
    assert used == {"varlen (FlashAttention) bf16": 1}
    (call,) = CALLS
    assert call["dtypes"] == (torch.bfloat16,) * 3
    if release == "2.10":
        assert set(call) - {"release", "dtypes", "kv_heads"} == {"is_causal"} and call["is_causal"] is True
    else:
        assert call["window_size"] == (-1, 0) and call["scale"] is None
    if release in ("2.12", "2.13"):
        assert call["enable_gqa"] is (kv_heads != H)  # passed only for grouped heads
    assert call["kv_heads"] == kv_heads  # grouped heads shared, never expanded, where the kernel takes them


@pytest.mark.parametrize("release", list(RELEASES))
def test_encoder_layers_see_their_whole_document(release, monkeypatch):
    used = _run(RELEASES[release], 2, causal=False, monkeypatch=monkeypatch)
    assert used == {"varlen (FlashAttention) bf16": 1}
    call = CALLS[-1]
    assert call["is_causal"] is False if release == "2.10" else call["window_size"] == (-1, -1)


@pytest.mark.parametrize("release", list(RELEASES))
def test_encoder_layers_with_a_sliding_window_see_it_on_both_sides(release, monkeypatch):
    """A bidirectional layer (an encoder's) with a window of 5: FlashAttention's window is 4 keys before and 4 after
    each query, ``(4, 4)``, and the output and gradients equal masked attention's (``_run``); 2.10, which takes no
    window, leaves the layer to the exact segmented path."""
    used = _run(RELEASES[release], 2, opts=AttnOptions(window=5), causal=False, monkeypatch=monkeypatch)
    if release == "2.10":
        assert used == {"segmented (varlen: this torch's varlen_attn takes no window_size) bf16": 1} and not CALLS
    else:
        assert used == {"varlen (FlashAttention) bf16": 1} and CALLS[-1]["window_size"] == (4, 4)


@pytest.mark.parametrize("release", list(RELEASES))
def test_windows_and_scales_go_where_the_release_can_compute_them(release, monkeypatch):
    """A sliding window and a scale other than 1/sqrt(D): 2.10 has neither keyword, so the layer goes to the
    exact segmented path (flex on CUDA), named with the reason; 2.11+ pass them to FlashAttention."""
    opts = AttnOptions(scale=0.2, window=5)
    used = _run(RELEASES[release], 2, opts=opts, monkeypatch=monkeypatch)
    if release == "2.10":
        assert used == {"segmented (varlen: this torch's varlen_attn takes no scale) bf16": 1}
        assert not CALLS
    else:
        assert used == {"varlen (FlashAttention) bf16": 1}
        assert CALLS[-1]["window_size"] == (4, 0) and CALLS[-1]["scale"] == 0.2


def test_the_default_scale_as_transformers_passes_it_is_no_reason_to_leave_varlen(monkeypatch):
    used = _run(varlen_2_10, 2, opts=AttnOptions(scale=1 / math.sqrt(D)), monkeypatch=monkeypatch)
    assert used == {"varlen (FlashAttention) bf16": 1}
    used_window = _run(varlen_2_10, 2, opts=AttnOptions(window=5), monkeypatch=monkeypatch)
    assert "segmented (varlen: this torch's varlen_attn takes no window_size) bf16" in used_window


def test_a_kernel_that_cannot_share_heads_gets_them_expanded(monkeypatch):
    used = _run(refuses_grouped_heads, 2, monkeypatch=monkeypatch)
    assert list(used) == ["varlen (FlashAttention, key/value heads expanded: this torch's varlen_attn takes no enable_gqa) bf16"]
    assert CALLS[-1]["kv_heads"] == H


def test_the_grouped_heads_probe_answers_alike_in_inference_mode_and_under_autocast():
    """The probe runs once per kernel and device: asked first from an evaluation (inference mode, autocast), it
    must not answer False for want of gradients, or training would expand heads for the whole process."""

    def fresh_2_11(*args, **kwargs):  # a new function: the probe's cache has not seen it
        return varlen_2_11(*args, **kwargs)

    fresh_2_11.__signature__ = inspect.signature(varlen_2_11)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_features.varlen_takes_grouped_heads(fresh_2_11, "cpu")
    assert not torch_features.varlen_takes_grouped_heads(refuses_grouped_heads, "cpu")


def test_a_release_without_varlen_makes_auto_pick_the_next_kernel(monkeypatch):
    assert available_backends("cuda")[0] == "varlen"
    monkeypatch.delattr(varlen_module, "varlen_attn")
    assert torch_features.varlen() is None
    assert available_backends("cuda")[0] == ("flex" if torch_features.flex_attention() else "segmented")


def test_the_stubs_are_the_installed_release_s_signature():
    """The recorded signature of the installed release is the real one (names, kinds and defaults)."""
    real = inspect.signature(varlen_module.varlen_attn).parameters
    shape = lambda ps: [(p.name, p.kind, p.default) for p in ps.values()]  # noqa: E731
    matches = [r for r, fn in RELEASES.items() if shape(inspect.signature(fn).parameters) == shape(real)]
    assert matches, f"torch {torch.__version__}'s varlen_attn{inspect.signature(varlen_module.varlen_attn)} is not recorded"
    assert torch.__version__.split("+")[0].rsplit(".", 1)[0] in matches or len(matches) == 1


def test_inside_autocast_a_fp32_query_beside_a_bf16_value_reaches_flash_in_bf16(monkeypatch):
    """transformers' RoPE in the fp32 residual stream makes q and k fp32 beside a bf16 v: the layer still runs
    FlashAttention, in bf16, and the record says so."""
    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_2_13)
    pos = _positions()
    cu, longest = segment_bounds(pos)
    q, k, v = _qkv(2, dtype=torch.float32)
    plan = plan_attention(pos, backend="varlen", cu_seqlens=cu, max_seqlen=longest)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k=k, v=v.to(torch.bfloat16), plan=plan)
    assert CALLS[-1]["dtypes"] == (torch.bfloat16,) * 3 and out.dtype == torch.bfloat16
    assert torch_features.kernels_used() == {"varlen (FlashAttention) bf16": 1}
    torch_features.reset_kernels()
    attend(q, k=k, v=v, plan=plan)  # outside autocast, fp32: FlashAttention has none, and the record says why
    assert torch_features.kernels_used() == {"segmented (varlen: FlashAttention has no fp32) fp32": 1}


def test_a_tiny_llama_under_bf16_autocast_runs_every_layer_on_varlen_in_bf16(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from densebatch.model.hf.attention import PLAN_KEY, register
    from densebatch.testing.models import tiny_config

    register()
    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_2_13)
    torch.manual_seed(0)
    config = tiny_config("llama", num_hidden_layers=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="densebatch")  # fp32 master weights
    pos = _positions()
    ids = torch.randint(3, config.vocab_size, pos.shape)
    cu, longest = segment_bounds(pos)
    outs = {}
    for backend in ("varlen", "masked"):
        plan = plan_attention(pos, backend=backend, cu_seqlens=cu, max_seqlen=longest)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[backend] = model(input_ids=ids, position_ids=pos, use_cache=False, **{PLAN_KEY: plan}).logits.float()
        if backend == "varlen":
            assert torch_features.kernels_used() == {"varlen (FlashAttention) bf16": 2}  # both layers
            assert [c["dtypes"] for c in CALLS] == [(torch.bfloat16,) * 3] * 2 and [c["enable_gqa"] for c in CALLS] == [True] * 2
    assert torch.allclose(outs["varlen"], outs["masked"], atol=5e-2)


# ------------------------------------------------------------------- on a GPU: the installed release itself
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("window", [None, 37], ids=["full", "window"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_cuda_varlen_of_the_installed_release_matches_masked_attention(kv_heads, window):
    """The real varlen_attn, called as its signature allows, gives what masked SDPA gives (forward and
    gradients, bf16), with grouped heads shared as they are where the kernel takes them."""
    torch.manual_seed(0)
    pos = torch.tensor([[*range(100), *range(60), *range(96)]] * 2, device="cuda")
    q = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    opts = AttnOptions(window=window, scale=64**-0.5)
    out = attend(q, k=k, v=v, plan=plan_attention(pos, backend="varlen"), opts=opts)
    used = torch_features.kernels_used()
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref = attend(q, k=k, v=v, plan=plan_attention(pos, backend="masked"), opts=opts)
    ref_grads = torch.autograd.grad(ref.float().sum(), (q, k, v))
    assert (out.float() - ref.float()).abs().max() < 2e-2
    for g, r in zip(grads, ref_grads):
        assert (g.float() - r.float()).abs().max() < 5e-2
    features = torch_features.varlen()
    native = features.enable_gqa or torch_features.varlen_takes_grouped_heads(features.fn, "cuda:0")
    expected = "varlen (FlashAttention) bf16" if native or kv_heads == 4 else next(iter(used))
    assert used == {expected: 1} and expected.startswith("varlen (FlashAttention")
    print(f"torch {torch.__version__}: {expected}; grouped heads as they are: {native}")


@cuda
def test_cuda_llama_under_bf16_autocast_runs_every_layer_on_varlen_in_bf16():
    transformers = pytest.importorskip("transformers")
    from densebatch.model.hf.attention import PLAN_KEY, register
    from densebatch.testing.models import tiny_config

    register()
    torch.manual_seed(0)
    config = tiny_config("llama", num_hidden_layers=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="densebatch").cuda()  # fp32 weights
    pos = _positions().cuda()
    ids = torch.randint(3, config.vocab_size, pos.shape, device="cuda")
    plan = plan_attention(pos, backend="varlen")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids, position_ids=pos, use_cache=False, **{PLAN_KEY: plan}).logits.float().sum().backward()
    assert torch_features.kernels_used() == {"varlen (FlashAttention) bf16": 2}


@cuda
def test_cuda_true_peak_outlives_the_per_step_reset():
    from densebatch.train.observe.monitor import finish_run, resource_usage

    dev = torch.device("cuda", 0)
    finish_run(dev, gather=lambda mine: [mine], write=lambda rec: None, step=0, reason="before")
    big = torch.empty(2**30, dtype=torch.uint8, device=dev)  # 1 GiB during "step 1"
    del big
    step1 = resource_usage(dev)
    small = torch.empty(2**20, dtype=torch.uint8, device=dev)
    step2 = resource_usage(dev)
    del small
    written = []
    finish_run(dev, gather=lambda mine: [mine], write=written.append, step=2, reason="max_steps")
    assert step1["cuda_max_allocated_gb"] >= 1.07 and step2["cuda_max_allocated_gb"] < 0.5
    assert written[0]["cuda_peak_allocated_gb"] >= 1.07 and written[0]["cuda_peak_reserved_gb"] >= 1.07
