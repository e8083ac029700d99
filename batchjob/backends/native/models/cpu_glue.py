"""bf16 RMSNorm in C on the CPU (kernels/cpu/glue.c), the residual add fused into it: one pass
where torch runs six bf16 ops with float32 round trips (8x faster at a prefill chunk).

Returns False where it does not apply (not a CPU bf16 tensor, a row stride it cannot take, no
kernel library) and the caller runs torch's ops.
"""

from __future__ import annotations

import torch

from batchjob.kernels.cpu.build import CpuKernel, load_kernel

_kernel: list[CpuKernel | None] = []  # the C library (RoPE, the norm), loaded on first use


def c_library() -> CpuKernel | None:
    if not _kernel:
        _kernel.append(load_kernel())
    return _kernel[0]


def _takes(*ts: torch.Tensor) -> CpuKernel | None:
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 or t.stride(-1) != 1 for t in ts):
        return None
    return c_library()


def rms_norm_bf16(
    x: torch.Tensor, weight: torch.Tensor, eps: float,
    residual_delta: torch.Tensor | None = None, scale_in_float: bool = False,
) -> torch.Tensor | None:  # fmt: skip
    """RMSNorm(x) * weight as a new [T, D] tensor, x [T, D]; with ``residual_delta``, x += it
    in place first; ``scale_in_float``: the weight scales before the one rounding (OLMo2; a
    float32 weight: Gemma's 1 + w), else after the normalised x is rounded (Llama). None
    (nothing touched) where the C pass does not apply."""
    ts = (x,) if residual_delta is None else (x, residual_delta)
    kn = _takes(*ts)
    if kn is None or x.dim() != 2 or not weight.is_contiguous() or weight.shape != x.shape[1:]:
        return None
    # a float32 weight (Gemma's 1 + w) scales before the rounding: mode 2
    mode = 2 if weight.dtype == torch.float32 else int(scale_in_float)
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if weight.dtype == torch.float32 and not scale_in_float:
        return None
    if residual_delta is not None and residual_delta.shape != x.shape:
        return None
    t, d = x.shape
    out = torch.empty((t, d), dtype=x.dtype)
    dp, ds = (
        (0, 0) if residual_delta is None else (residual_delta.data_ptr(), residual_delta.stride(0))
    )
    rc = kn.rms_norm_bf16(
        x.data_ptr(), x.stride(0), dp or None, ds, weight.data_ptr(), out.data_ptr(),
        out.stride(0), t, d, eps, mode, torch.get_num_threads(),
    )  # fmt: skip
    return out if rc == 0 else None
