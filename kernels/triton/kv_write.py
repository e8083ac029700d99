"""@triton.jit paged KV write (host wrapper: wrappers.write_kv)."""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED = triton.knobs.runtime.interpret


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcp, stride_kch, stride_vcb, stride_vcp, stride_vch,
    H: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
):  # fmt: skip
    """One program per token: k[t], v[t] ([H, D]) -> cache slot slot_mapping[t] (cast)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # negative slot: padding token, nothing to store
        blk = slot // PAGE
        off = slot % PAGE
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < H) & (d < D)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        kc = kc_ptr + blk * stride_kcb + off * stride_kcp + h * stride_kch + d
        vc = vc_ptr + blk * stride_vcb + off * stride_vcp + h * stride_vch + d
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)
