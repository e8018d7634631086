"""What the device can do, measured and quoted: the bf16 matrix-product ceiling timed in the same call, the spec
sheet's dense bf16 peak by device name, and TF32 for fp32 products (through the release's own API)."""

from __future__ import annotations

import time

import torch

from densebatch import torch_features

# (name substring, dense bf16 TFLOP/s of the spec sheet): the first match wins (NVL / PCIe parts before SXM).
SPEC_TFLOPS = (
    ("H200 NVL", 835),
    ("H200", 989),
    ("H100 NVL", 835),
    ("H100 PCIe", 756),
    ("H100", 989),
    ("GH200", 989),
    ("B200", 2250),
    ("A100", 312),
    ("L40S", 362),
    ("L4", 121),
    ("A10G", 70),
)


def spec_flops(device: torch.device, override_tflops: float | None) -> tuple[float | None, str]:
    """The spec sheet's dense bf16 FLOP/s for this device (``--peak-tflops`` overrides it), and where it came from."""
    if override_tflops:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops}"
    if device.type != "cuda":
        return None, "no spec peak for CPU"
    name = torch.cuda.get_device_name(device)
    for key, tf in SPEC_TFLOPS:
        if key in name:
            return tf * 1e12, f"{name}: spec {tf} TFLOP/s bf16 dense"
    return None, f"{name}: spec peak unknown (pass --peak-tflops)"


def matmul_ceiling(device: torch.device, n: int, reps: int = 10) -> tuple[float, str]:
    """FLOP/s of ``reps`` timed (n x n) @ (n x n) products after two untimed ones: bf16 on CUDA (8192^3 for the
    check), fp32 on CPU (the dry run, small n). The denominator of the second MFU column."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t
    flops = 2.0 * n**3 * reps / seconds
    del a, b
    rate = f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"
    return flops, f"{str(dtype).replace('torch.', '')} matmul {n}^3 x {reps}: {rate} measured"


def tf32_on(device: torch.device) -> str:
    """TF32 for fp32 products on CUDA through the release's API (``torch_features.allow_tf32``); '-' on CPU."""
    return torch_features.allow_tf32() if device.type == "cuda" else "-"
