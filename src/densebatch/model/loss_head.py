"""The output head and its per-token cross-entropy, fused and chunked so that full logits never exist.

``head_token_losses(h, labels, weight, bias, num_loss_tokens)`` returns what
``cross_entropy(h[keep] @ weight.T + bias, labels[keep], reduction="none")`` scattered into a
``(rows, T)`` zero tensor returns, with the same gradients, but:

- only positions that carry a target are projected (padding and prompt tokens cost nothing);
- the projection runs ``chunk_tokens`` positions at a time, and each chunk's logits turn into its
  loss *and* its gradient at once (``softmax - onehot``, projected back through the head): at most
  ``chunk_tokens x vocab`` float32 values exist at any moment, never ``rows x T x vocab`` (the plain
  path keeps logits, log-probabilities and their gradients: three such tensors at the peak);
- no host synchronisation on an accelerator: the gather index has a static size (the batch's
  ``num_loss_tokens``) and the backward pass never reads a value back.

Computing the gradient in the forward pass assumes the loss of every token is weighted alike
downstream, which is how the trainer uses it (``losses.sum() / loss_tokens``: its gradient reaches
the head as one value expanded over all positions, which the backward pass sees without reading
it). Any other weighting is still exact: the weight's gradient is then recomputed chunk by chunk
from the saved hidden states (one extra projection; on CPU an equality check, free there, spares
it for weights that happen to be uniform). The head's input gradient is scaled per token either way.

Cost: the same three matrix products per chunk as the plain path's forward and backward, with fewer
passes over the logits (no separate log-softmax, loss and backward tensors), so it is also faster on
CPU; the weight gradient (vocab x width, float32) is held from the forward to the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from densebatch import torch_features
from densebatch.batch import IGNORE_INDEX

# Logits of at most this many bytes (float32) exist at once: the chunk is CHUNK_BYTES / (4 * vocab)
# positions (652 at vocabulary 50,257). Every chunk reads the head's weight twice and adds into its
# (vocab, width) gradient once, so small chunks pay that traffic many times: on CPU, 163-position
# chunks (32 MiB) made the head 11% slower than the plain one, 652 make it 16% faster, and larger
# chunks gain little more (docs/benchmarks.md, "Loss head: speed and memory").
CHUNK_BYTES = 128 * 2**20
# On a GPU each chunk is a handful of kernel launches and two reads of the head: larger chunks (8,192
# positions at a 32k vocabulary) keep the matrix products large. Chosen, not yet measured on a GPU.
DEVICE_CHUNK_BYTES = {"cuda": 1024 * 2**20}
LOSS_HEADS = ("fused", "plain")


def chunk_tokens_for(vocab_size: int, chunk_bytes: int | None = None, device: torch.device | str = "cpu") -> int:
    """Positions per chunk: ``chunk_bytes`` of float32 logits (by default the device's: ``DEVICE_CHUNK_BYTES``,
    else ``CHUNK_BYTES``)."""
    if chunk_bytes is None:
        chunk_bytes = DEVICE_CHUNK_BYTES.get(torch.device(device).type, CHUNK_BYTES)
    return max(16, chunk_bytes // (4 * vocab_size))


def _fp32_out_matmul(device: torch.device) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` runs on bf16/fp16 inputs here (the op's schema
    and a trial on the device: CUDA, not CPU): then the weight gradient is accumulated in fp32 by the product itself."""
    return torch_features.addmm_out_dtype(device)


def _add_product(grad_w: Tensor, d_t: Tensor, hc: Tensor) -> Tensor:
    """``grad_w + d_t @ hc`` into the float32 ``grad_w``: one fp32-output product when the inputs are low
    precision and the device has it (no bf16 rounding of each chunk's product), else the product in the
    inputs' dtype added in fp32."""
    if d_t.dtype == torch.float32:
        return grad_w.addmm_(d_t, hc)
    if _fp32_out_matmul(grad_w.device):
        return torch.addmm(grad_w, d_t, hc, out_dtype=torch.float32)
    return grad_w.add_((d_t @ hc).float())


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype autocast would give the head's matrix product (x's own dtype outside autocast)."""
    low = torch_features.autocast_dtype(x.device.type)
    return x.dtype if low is None else low


# Devices where reading a tensor on the host costs nothing: there, backward checks whether a
# gradient that is not visibly uniform is uniform all the same. Elsewhere it never synchronises.
_CHECK_UNIFORM_ON_HOST = {"cpu"}


class _FusedLinearCE(torch.autograd.Function):
    """losses of all rows of ``h`` (N,), shaped ``shape`` (rows, T): cross-entropy of ``h[idx]`` under the
    head (weight, bias) against ``targets`` (n,) at ``idx``, 0 elsewhere."""

    @staticmethod
    def forward(
        ctx, h: Tensor, weight: Tensor, bias: Tensor | None, idx: Tensor, targets: Tensor, chunk, dtype, need_grad, eps, shape,
        tw: Tensor | None = None, scale: float = 1.0, cap: float | None = None,
    ):  # fmt: skip
        # h: (N, C) all positions; idx: (n,) positions with a target. ``dtype``: what autocast asked
        # for outside; autocast is switched off in here so that every cast below is explicit.
        # ``eps``: label smoothing (the target distribution (1 - eps) onehot + eps / V, as torch's).
        # ``shape``: the losses' shape, (rows, T), N elements. ``tw``: (n,) float32 weights of the targets
        # (None: all 1): the output is tw x CE, and the forward's gradient sums are weighted alike.
        # ``scale``, ``cap``: the logits are cap x tanh(scale x z / cap) (``_logits``; cap None: scale x z).
        ctx.scale, ctx.cap = scale, cap
        with torch.autocast(h.device.type, enabled=False):
            return _FusedLinearCE._forward(ctx, h, weight, bias, idx, targets, chunk, dtype, need_grad, eps, shape, tw)

    @staticmethod
    def _forward(ctx, h, weight, bias, idx, targets, chunk, dtype, need_grad: bool, eps: float, shape, tw) -> Tensor:
        n = idx.numel()
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        losses = torch.empty(n, dtype=torch.float32, device=h.device)  # (n,)
        grad_h = torch.empty((n, h.shape[1]), dtype=h.dtype, device=h.device) if need_grad else None  # (n, C)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_grad else None  # (V, C)
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if need_grad and b is not None else None
        for a in range(0, n, chunk):
            hc = h.index_select(0, idx[a : a + chunk]).to(dtype)  # (c, C)
            yc = targets[a : a + chunk]  # (c,)
            z, t = _logits(hc, w, b, ctx.scale, ctx.cap)  # (c, V) the only logits alive (and tanh's, when capped)
            target_logit = z.gather(1, yc[:, None]).squeeze(1)  # (c,)
            if eps:  # smoothed: (1 - eps) z_y + eps mean(z) is the target's share of the logits
                target_logit = (1.0 - eps) * target_logit + eps * z.mean(dim=1)
            zmax = z.amax(dim=1, keepdim=True)  # (c, 1)
            z.sub_(zmax).exp_()  # (c, V) exp(z - max), in place
            total = z.sum(dim=1, keepdim=True)  # (c, 1)
            losses[a : a + chunk] = (zmax + total.log()).squeeze(1) - target_logit
            if not need_grad:
                continue
            z.div_(total)  # softmax
            _subtract_target(z, yc, eps)  # d loss / d logits
            _chain(z, t, ctx.scale)  # d loss / d (h W^T + b)
            if tw is not None:
                z.mul_(tw[a : a + chunk, None])
            d = z.to(dtype)  # (c, V)
            grad_h[a : a + chunk] = (d @ w).to(h.dtype)
            grad_w = _add_product(grad_w, d.t(), hc)
            if grad_b is not None:
                grad_b += d.sum(0, dtype=torch.float32)
        ctx.chunk, ctx.dtype, ctx.has_bias, ctx.eps = chunk, dtype, bias is not None, eps
        ctx.save_for_backward(h, weight, bias, idx, targets, tw)
        # The forward's gradient sums are this Function's own buffers, held on ctx (not as saved
        # tensors) so that backward can scale them in place and drop them.
        ctx.unit_grads = (grad_h, grad_w, grad_b)
        # Returned in its final shape, not as a view of an (N,) tensor: FSDP2 warns about a module that
        # returns a view (an in-place op on it would drop the pre-backward hook that all-gathers the
        # root's parameters), and the losses are the output of the module every training pass runs.
        out = torch.zeros(shape, dtype=torch.float32, device=h.device)  # (rows, T)
        out.view(-1).index_copy_(0, idx, losses if tw is None else losses * tw)  # (N,) the same storage
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        # grad_out: (rows, T). The trainer's ``losses.sum() / count`` arrives as one value expanded over
        # every position (stride 0): the forward's sums then only need scaling, with no host sync.
        grad_out = grad_out.reshape(-1)  # (N,) an expanded gradient keeps its stride 0
        h, weight, bias, idx, targets, tw = ctx.saved_tensors
        if ctx.unit_grads is None:
            raise RuntimeError("the fused loss head supports one backward pass per forward (no retain_graph)")
        grad_h_unit, grad_w_unit, grad_b_unit = ctx.unit_grads
        ctx.unit_grads = None
        uniform = grad_out.numel() <= 1 or grad_out.stride(0) == 0
        g = None
        if not uniform:
            g = grad_out.float().index_select(0, idx)  # (n,) each token's own weight
            if grad_out.device.type in _CHECK_UNIFORM_ON_HOST:
                uniform = g.numel() == 0 or bool((g == g[0]).all())
        if uniform:
            # (1,) the common weight, still on the device: the targets' own (g) when it was checked, since
            # positions without a target may carry any weight (grad_out[0] is often one of them)
            scale = g[:1] if g is not None and g.numel() else grad_out.reshape(-1)[:1].float()
            grad_w = grad_w_unit.mul_(scale)
            grad_b = grad_b_unit.mul_(scale) if grad_b_unit is not None else None
            grad_h_sel = grad_h_unit.mul_(scale.to(grad_h_unit.dtype))  # (n, C)
        else:  # recompute the weight gradient with each token's own weight (exact, one more projection)
            with torch.autocast(h.device.type, enabled=False):  # the forward's token weights times the incoming ones
                gw = g if tw is None else g * tw
                grad_w, grad_b = _weighted_head_grads(
                    h, weight, bias, idx, targets, gw, ctx.chunk, ctx.dtype, ctx.eps, ctx.scale, ctx.cap
                )
            grad_h_sel = grad_h_unit * g[:, None].to(grad_h_unit.dtype)
        grad_h = None
        if ctx.needs_input_grad[0]:
            grad_h = torch.zeros_like(h).index_copy_(0, idx, grad_h_sel.to(h.dtype))  # (N, C): 0 without a target
        return (
            grad_h,
            grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None,
            grad_b.to(bias.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _logits(hc: Tensor, w: Tensor, b: Tensor | None, scale: float, cap: float | None) -> tuple[Tensor, Tensor | None]:
    """A chunk's float32 logits (c, V) as the architecture computes them: ``scale x z`` (Cohere's logit_scale,
    Granite's 1 / logits_scaling), then soft-capped, ``cap x tanh(. / cap)`` (Gemma 2); with the tanh (c, V)
    when capped (its derivative, 1 - tanh^2, is ``_chain``'s), else None."""
    z = F.linear(hc, w, b).float()  # (c, V)
    if scale != 1.0:
        z.mul_(scale)
    if not cap:
        return z, None
    t = z.div_(cap).tanh_()  # (c, V) in place
    return t * cap, t


def _chain(d: Tensor, t: Tensor | None, scale: float) -> None:
    """``d`` (c, V), the gradient at the final logits, taken back through the cap and the scale, in place
    (``t`` is spent)."""
    if t is not None:
        d.mul_(t.mul_(t).neg_().add_(1.0))  # 1 - tanh^2
    if scale != 1.0:
        d.mul_(scale)


def _subtract_target(probs: Tensor, targets: Tensor, eps: float) -> None:
    """softmax - target distribution, in place: ``(1 - eps)`` at the target, ``eps / V`` everywhere."""
    probs[torch.arange(targets.numel(), device=probs.device), targets] -= 1.0 - eps
    if eps:
        probs.sub_(eps / probs.shape[1])


def _weighted_head_grads(
    h, weight, bias, idx, targets, g, chunk, dtype, eps: float, scale: float = 1.0, cap: float | None = None
) -> tuple[Tensor, Tensor | None]:
    """sum_i g_i (softmax_i - onehot_i)^T [h_i, 1], recomputing each chunk's logits."""
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)  # (V, C)
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if bias is not None else None
    for a in range(0, idx.numel(), chunk):
        hc = h.index_select(0, idx[a : a + chunk]).to(dtype)  # (c, C)
        yc = targets[a : a + chunk]
        z, t = _logits(hc, w, b, scale, cap)
        d = torch.softmax(z, dim=1)  # (c, V)
        _subtract_target(d, yc, eps)
        _chain(d, t, scale)
        d.mul_(g[a : a + chunk, None])
        grad_w = _add_product(grad_w, d.to(dtype).t(), hc)
        if grad_b is not None:
            grad_b += d.sum(0)
    return grad_w, grad_b


def head_token_losses(
    h: Tensor,
    labels: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    num_loss_tokens: int | None = None,
    chunk_tokens: int | None = None,
    label_smoothing: float = 0.0,
    token_weights: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """Cross-entropy per position of ``h`` (rows, T, C) through the head, float32, 0 where the
    label is -100. (rows, T). ``num_loss_tokens`` (the batch's count) spares a host synchronisation;
    ``label_smoothing`` as ``F.cross_entropy``'s (per token, so exact under any batching);
    ``token_weights`` (rows, T): each position's CE times its weight (the forward's gradient sums are
    weighted alike, so a plain sum of the result backpropagates without recomputing the head); ``logit_scale``,
    ``softcap``: the logits are ``softcap x tanh(logit_scale x z / softcap)`` (``softcap`` None: ``logit_scale x z``),
    as architectures with a logit scale or final-logit soft-capping compute them."""
    rows, T, C = h.shape
    flat_labels = labels.reshape(-1)  # (N,)
    keep = flat_labels != IGNORE_INDEX  # (N,)
    if num_loss_tokens is None or not torch_features.nonzero_static():
        idx = torch.nonzero(keep).squeeze(1)  # (n,) found on the host
    else:
        idx = torch.nonzero_static(keep, size=int(num_loss_tokens)).squeeze(1)  # (n,) no host sync
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0], device=h.device)
    # Gradient work happens in the forward pass, so it must know now whether a backward will follow.
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h, weight, bias))
    targets = flat_labels.index_select(0, idx)  # (n,)
    flat, dtype, eps = h.reshape(rows * T, C), _compute_dtype(h), float(label_smoothing)  # flat: (N, C)
    tw = None if token_weights is None else token_weights.reshape(-1).index_select(0, idx).float()  # (n,)
    scale, cap = float(logit_scale), (float(softcap) if softcap else None)
    return _FusedLinearCE.apply(flat, weight, bias, idx, targets, chunk, dtype, need_grad, eps, (rows, T), tw, scale, cap)


def plain_head_token_losses(
    h: Tensor, labels: Tensor, head: torch.nn.Module, label_smoothing: float = 0.0, token_weights: Tensor | None = None
) -> Tensor:
    """The reference path: project the positions with a target, float32 cross-entropy (times
    ``token_weights`` when given). (rows, T)"""
    keep = labels != IGNORE_INDEX  # (rows, T)
    logits = head(h[keep]).float()  # (n, vocab); fp32 even under autocast
    out = torch.zeros(labels.shape, dtype=torch.float32, device=h.device)  # (rows, T)
    ce = F.cross_entropy(logits, labels[keep], reduction="none", label_smoothing=label_smoothing)
    out[keep] = ce if token_weights is None else ce * token_weights[keep].float()
    return out
