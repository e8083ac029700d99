"""kernels/cpu/glue.c: the bf16 RMSNorm (and the residual add fused into it) against HF's
formula in torch ops."""

from __future__ import annotations

import pytest
import torch

from batchjob.backends.native.models import cpu_glue
from batchjob.backends.native.models.llama import RMSNorm, add_rms_norm_

pytestmark = pytest.mark.skipif(cpu_glue.c_library() is None, reason="no C compiler")


def hf_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (300, 896), (2048, 130)])
def test_bf16_norm_equals_hf_formula_to_the_last_bit_almost_everywhere(rows, dim) -> None:
    g = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(dim, generator=g)).bfloat16()
    out = cpu_glue.rms_norm_bf16(x, w, 1e-5)
    assert out is not None
    ref = hf_norm(x, w, 1e-5)
    same = (out == ref).float().mean().item()
    assert same >= 0.999, same  # the mean's float32 summation order may differ
    # where not equal, one bf16 step apart at most
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-30).all()


def test_fused_add_updates_the_residual_exactly_then_normalises() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(33, 576, generator=g).bfloat16()
    d = torch.randn(33, 576, generator=g).bfloat16()
    norm = RMSNorm(576, 1e-6, torch.bfloat16)
    norm.weight.data = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    want_h = h + d
    want = hf_norm(want_h, norm.weight, 1e-6)
    got = add_rms_norm_(h, d, norm)
    assert torch.equal(h, want_h)  # the residual stream: bf16(h + d), bit for bit
    assert (got == want).float().mean().item() >= 0.999


def test_strided_rows_and_the_torch_fallback() -> None:
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 2 * 200, generator=g).bfloat16()
    x = wide[:, :200]  # row stride 400
    w = torch.ones(200, dtype=torch.bfloat16)
    out = cpu_glue.rms_norm_bf16(x, w, 1e-5)
    assert out is not None
    assert (out == hf_norm(x, w, 1e-5)).float().mean().item() >= 0.999
    f32 = torch.randn(4, 200, generator=g)
    assert cpu_glue.rms_norm_bf16(f32, w.float(), 1e-5) is None
    too_wide = torch.randn(2, 20000, generator=g).bfloat16()  # past the kernel's row buffer
    ones = torch.ones(20000, dtype=torch.bfloat16)
    assert cpu_glue.rms_norm_bf16(too_wide, ones, 1e-5) is None
    norm = RMSNorm(20000, 1e-5, torch.bfloat16)
    norm.weight.data = ones
    torch.testing.assert_close(norm(too_wide), hf_norm(too_wide, ones, 1e-5), rtol=0, atol=0)
