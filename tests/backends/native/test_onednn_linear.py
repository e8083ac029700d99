"""The bf16 linear layers on weights oneDNN packed once: the same values as F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchjob.backends.native.models.onednn_linear import OneDnnLinear, use_onednn_linear
from batchjob.backends.native.models.onednn_ops import onednn_bf16_available

pytestmark = pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 matmul")


@pytest.mark.parametrize("rows", [1, 7, 64, 300, 2048])
def test_packed_matmul_equals_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    torch.testing.assert_close(OneDnnLinear(w, b)(x), F.linear(x, w, b), rtol=0, atol=0)


def test_strided_rows_other_dtypes_and_shapes_fall_back() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 48, generator=g).bfloat16()
    layer = OneDnnLinear(w, None)
    gate_up = torch.randn(5, 96, generator=g).bfloat16()
    x = gate_up[:, :48]  # the SiLU-mul half: row stride 96
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=0, atol=0)
    x3 = torch.randn(2, 3, 48, generator=g).bfloat16()
    torch.testing.assert_close(layer(x3), F.linear(x3, w), rtol=0, atol=0)


def test_use_onednn_linear_swaps_bf16_layers_and_the_tied_head() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16, dtype=torch.bfloat16)
            self.proj = nn.Linear(16, 16, dtype=torch.bfloat16)
            self.keep = nn.Linear(16, 16)  # float32: not this module's
            self.logits_linear: nn.Module | None = None

        def logits_weight(self) -> torch.Tensor:
            return self.embed.weight

    m = Tiny()
    assert use_onednn_linear(m) == 2
    assert isinstance(m.proj, OneDnnLinear) and isinstance(m.keep, nn.Linear)
    assert isinstance(m.logits_linear, OneDnnLinear)
    x = torch.randn(3, 16).bfloat16()
    torch.testing.assert_close(m.logits_linear(x), F.linear(x, m.embed.weight), rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fused_act_mul_is_within_bf16_rounding_of_the_two_step_mlp(activation) -> None:
    from batchjob.backends.native.models.llama import act_mul_
    from batchjob.backends.native.models.onednn_linear import OneDnnActMul

    g = torch.Generator().manual_seed(3)
    inter = 48
    gate_up = nn.Linear(32, 2 * inter, dtype=torch.bfloat16)
    gate_up.weight.data = (torch.randn(2 * inter, 32, generator=g) * 0.3).bfloat16()
    gate_up.bias.data = torch.randn(2 * inter, generator=g).bfloat16()
    x = torch.randn(70, 32, generator=g).bfloat16()
    want = act_mul_(F.linear(x, gate_up.weight, gate_up.bias), inter, activation).float()
    got = OneDnnActMul(gate_up, inter, activation)(x).float()
    # bf16 keeps 8 bits: the fused epilogue rounds once where HF rounds three times
    assert ((got - want).abs() <= want.abs() * 2**-6 + 2**-9).all()
