"""Linear layers on the CPU over weights oneDNN packed once at load (bfloat16; float32 where
the C kernel's packed copies would not fit, see ``cpu_linear``).

``F.linear`` on bf16 CPU tensors calls oneDNN with the weight in its plain [N, K] layout, so
every call first reorders the whole weight into the blocked (VNNI) layout AMX and
AVX512-BF16 multiply from: at a decode step's few rows that reorder reads and writes more
bytes than the product itself. Here the weight is reordered once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU weight freezing and vLLM's
``onednn_mm`` handler do) and each call runs ``torch.ops.mkldnn._linear_pointwise`` on it.
Measured on an AMX Xeon (bench_cpu_linear.py --dtype bfloat16): 1.2-2x at 8-256 rows. In
float32 the same packed product runs 1.6-2.4x faster than ``F.linear`` (MKL) at 16-2,048 rows
on an AVX-512 EPYC (bench_cpu_linear.py).

The plain weight stays (the embedding shares the tied logits weight; other batches fall back
to ``F.linear``), so packing is skipped when the packed copies would exceed
``MAX_MEMORY_SHARE`` of the memory available at load.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from batchjob.backends.native.models.llama import MLP
from batchjob.backends.native.models.onednn_ops import (
    PACK_ROWS_HINT,
    onednn_available,
    onednn_linear,
    onednn_pack,
)
from batchjob.backends.native.models.packed_weights import linear_targets

log = logging.getLogger(__name__)


class OneDnnLinear(nn.Module):
    """``F.linear(x, weight, bias)`` on the packed weight for inputs of the weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # shared with the module this replaces
        self.out_features, self.in_features = weight.shape
        self.packed = onednn_pack(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 2 and x.dtype == self.weight.dtype and x.numel() > 0:
            return onednn_linear(x, self.packed, self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)


# the MLP's activation -> oneDNN's post-op (name, algorithm)
_POST_OPS = {"silu": ("swish", ""), "gelu_tanh": ("gelu", "tanh")}


class OneDnnActMul(nn.Module):
    """``act(x Wg^T + bg) * (x Wu^T + bu)`` for bf16 2-D inputs (act: SiLU, or Gemma's
    tanh-approximated GELU): the gate and up halves of a fused gate_up weight packed apart,
    the activation and the product done in oneDNN's epilogues (no pass over the [T, 2I]
    intermediate: 28% of the MLP's first half at a 2,048-row chunk of SmolLM2's shape, AMX
    Xeon). Rounding differs from HF's (the activation is applied before the gate is rounded
    to bf16) within bf16's precision."""

    def __init__(self, gate_up: nn.Linear, inter: int, activation: str = "silu") -> None:
        super().__init__()
        self.post_op, self.algorithm = _POST_OPS[activation]
        w = gate_up.weight.detach()
        b = gate_up.bias.detach() if gate_up.bias is not None else None
        self.gate_b = None if b is None else b[:inter].contiguous()
        self.up_b = None if b is None else b[inter:].contiguous()
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.gate = reorder(w[:inter].contiguous(), PACK_ROWS_HINT)
        self.up = reorder(w[inter:].contiguous(), PACK_ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.mkldnn
        x = x.contiguous()
        g = ops._linear_pointwise(x, self.gate, self.gate_b, self.post_op, [], self.algorithm)
        return ops._linear_pointwise(x, g, self.up, self.up_b, "mul")


def use_onednn_linear(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Swap ``model``'s ``dtype`` CPU ``nn.Linear`` modules (and its logits projection,
    through ``model.logits_linear``) for ``OneDnnLinear``; returns how many (0 where oneDNN's
    path is missing or the packed copies would not fit ``MAX_MEMORY_SHARE``)."""
    if not onednn_available(dtype):
        return 0
    found = linear_targets(model, dtype)
    if found is None:
        return 0
    targets, head_w = found.layers, found.head
    for parent, name, child in targets:
        if name == "gate_up" and isinstance(parent, MLP) and dtype == torch.bfloat16:
            parent.fused_gate_up = OneDnnActMul(child, parent.inter, parent.activation)
            continue  # the gate_up module stays for other inputs (never bf16 2-D here)
        setattr(parent, name, OneDnnLinear(child.weight, child.bias))
    n = len(targets)
    if head_w is not None:
        model.logits_linear = OneDnnLinear(head_w, None)
        n += 1
    return n
