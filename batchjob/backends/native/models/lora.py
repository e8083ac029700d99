"""LoRA adapters (``model.adapters``, PEFT format) on the native Llama-family model.

``attach_lora`` wraps every targeted linear layer in a ``LoraLinear``; the fused layers take
each PEFT module on its output slice (q/k/v of ``attn.qkv``, gate/up of ``mlp.gate_up``), or
on all of it (Phi3's ``qkv_proj`` and ``gate_up_proj``).
Per forward, ``LoraRouter.bind`` gets the batch's tokens of each adapter (``ModelBatch.
lora_tokens``); each wrapped layer adds ``scale * (x A^T) B^T`` to those tokens' rows only
(index_select, two small matmuls, index_add), so one forward serves several adapters and
tokens without an adapter get the base weights alone.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from batchjob.backends.native.models.llama import MLP, LlamaForCausalLM
from batchjob.errors import ConfigError

# PEFT's key: base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.default].weight
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
# PEFT module -> (the native layer, which slice of its output: q, k, v, all / gate, up, all /
# all); Phi3's checkpoints, and so its adapters, have the fused qkv_proj and gate_up_proj
_TARGETS = {
    "q_proj": ("attn.qkv", 0),
    "k_proj": ("attn.qkv", 1),
    "v_proj": ("attn.qkv", 2),
    "qkv_proj": ("attn.qkv", 3),
    "o_proj": ("attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up", 0),
    "up_proj": ("mlp.gate_up", 1),
    "gate_up_proj": ("mlp.gate_up", 2),
    "down_proj": ("mlp.down", 0),
}


@dataclass(frozen=True)
class LoraDelta:
    """One adapter's update of one output slice [start, stop) of a layer."""

    start: int
    stop: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [stop - start, r], scale folded in


class LoraRouter:
    """The current batch's tokens of each adapter: (adapter index, int64 token indices)."""

    def __init__(self) -> None:
        self.groups: tuple[tuple[int, torch.Tensor], ...] = ()

    def bind(self, groups: tuple[tuple[int, torch.Tensor], ...]) -> None:
        self.groups = groups


class LoraLinear(nn.Module):
    """``base`` (any [T, in] -> [T, out] module) plus each adapter's delta on its tokens."""

    def __init__(self, base: nn.Module, router: LoraRouter) -> None:
        super().__init__()
        self.base = base
        self.router = router
        self.deltas: dict[int, list[LoraDelta]] = {}  # adapter index -> its slices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for adapter, idx in self.router.groups:
            deltas = self.deltas.get(adapter)
            if not deltas:
                continue
            xs = x.index_select(0, idx)
            for d in deltas:
                y[:, d.start : d.stop].index_add_(0, idx, (xs @ d.a.T) @ d.b.T)
        return y


def _scale(name: str, cfg: dict) -> float:
    """alpha / r (alpha / sqrt(r) with rsLoRA); what this engine cannot apply is refused."""
    key = f"model.adapters.{name}"
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{key}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for field, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if cfg.get(field, ok) != ok:
            raise ConfigError(f"{key}: {field} = {cfg[field]!r} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise ConfigError(f"{key}: LoRA biases and modules_to_save are not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ConfigError(f"{key}: rank_pattern / alpha_pattern are not supported")
    try:
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{key}: adapter_config.json needs r and lora_alpha ({e})") from None
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _slices(model: LlamaForCausalLM, layer: str) -> list[tuple[int, int]]:
    """A native layer's output slices, in the order ``_TARGETS`` numbers them."""
    c = model.cfg
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    if layer == "attn.qkv":
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv), (0, q + 2 * kv)]
    if layer == "mlp.gate_up":
        return [(0, inter), (inter, 2 * inter), (0, 2 * inter)]
    return [(0, c.hidden_size)]


def attach_lora(model: nn.Module, adapters: Sequence[tuple[str, Path]]) -> LoraRouter:
    """Wrap ``model``'s targeted layers; adapter i of ``adapters`` (name, folder) is index i
    (``TokenizedPrompts.adapter``). ConfigError naming the adapter for what it cannot load."""
    if not isinstance(model, LlamaForCausalLM):
        raise ConfigError(f"model.adapters: needs the native Llama-family model, not {type(model)}")
    router = LoraRouter()
    param = model.embed_tokens.weight
    wrapped: dict[tuple[int, str], LoraLinear] = {}
    for index, (name, folder) in enumerate(adapters):
        key = f"model.adapters.{name}"
        scale = _scale(name, json.loads((Path(folder) / "adapter_config.json").read_text()))
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for k, t in load_file(str(Path(folder) / "adapter_model.safetensors")).items():
            m = _KEY.search(k)
            if m is None or m.group(2) not in _TARGETS:
                raise ConfigError(f"{key}: tensor {k!r} is not a LoRA weight of {sorted(_TARGETS)}")
            pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
        for (i, module), ab in sorted(pairs.items()):
            if i >= len(model.layers) or set(ab) != {"A", "B"}:
                raise ConfigError(f"{key}: layer {i} {module}: needs lora_A and lora_B of a layer")
            layer, part = _TARGETS[module]
            start, stop = _slices(model, layer)[part]
            a, b = ab["A"], ab["B"]
            base = model.layers[i].get_submodule(layer)
            if b.shape[0] != stop - start or a.shape[0] != b.shape[1]:
                raise ConfigError(
                    f"{key}: layer {i} {module}: A {tuple(a.shape)}, B {tuple(b.shape)} "
                    "do not fit the model"
                )
            target = wrapped.get((i, layer))
            if target is None:
                target = wrapped[(i, layer)] = LoraLinear(base, router)
                parent_name, _, attr = layer.rpartition(".")
                parent = model.layers[i].get_submodule(parent_name)
                setattr(parent, attr, target)
                if isinstance(parent, MLP):  # the fused SiLU-mul would skip the delta
                    parent.fused_gate_up = None
            delta = LoraDelta(
                start,
                stop,
                a.to(device=param.device, dtype=param.dtype),
                (b.float() * scale).to(device=param.device, dtype=param.dtype),
            )
            target.deltas.setdefault(index, []).append(delta)
    return router
