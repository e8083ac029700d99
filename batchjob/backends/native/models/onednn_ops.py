"""oneDNN's matmul on weights it packed once (``torch.ops.mkldnn``): the ops both CPU
packed-weight paths share (``onednn_linear`` in bfloat16, ``cpu_linear`` in float32)."""

from __future__ import annotations

import torch

PACK_ROWS_HINT = 64  # the batch size oneDNN picks the packed layout for (a decode step)


def onednn_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build and CPU run oneDNN's ``dtype`` matmul on packed weights."""
    try:
        ops = torch.ops.mkldnn
        return bool(
            torch.backends.mkldnn.is_available()
            and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def onednn_bf16_available() -> bool:
    return onednn_available(torch.bfloat16)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of ``weight`` [N, K], chosen for ``PACK_ROWS_HINT`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ W^T + bias`` on ``onednn_pack(W)``, any leading dimensions, ``x`` non-empty."""
    lead = x.shape[:-1]
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    if x.stride(1) != 1 or x.stride(0) != x.shape[1]:
        x = x.contiguous()  # oneDNN's source must be dense (the SiLU-mul half is not)
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y if len(lead) == 1 else y.reshape(*lead, out_features)
