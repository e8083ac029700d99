"""Tiny LoRA adapters in PEFT's format, and the base model with one merged in.

``make_lora_adapter(out, base)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` (random A and B; PEFT would start B at zero) for a model
folder written by ``batchjob.testing.tiny_model``; ``merge_lora(base, adapter, out)`` writes
the folder whose weights are W + (alpha / r) B A: greedy outputs of the base model with the
adapter must equal those of the merged one. Needs neither ``peft`` nor ``transformers``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # its fused layers
_PARENT = {
    m: "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
    for m in (*TARGETS, *PHI3_TARGETS)
}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def make_lora_adapter(
    out_dir: str | Path,
    base: str | Path,
    rank: int = 4,
    alpha: float = 8.0,
    targets: Sequence[str] = TARGETS,
    seed: int = 0,
    std: float = 0.2,
) -> Path:
    """A PEFT LoRA adapter of ``base`` (every layer's ``targets``) with random weights."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(base) / "config.json").read_text())
    weights = _weights(Path(base))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for m in targets:
            name = f"model.layers.{i}.{_PARENT[m]}.{m}"
            w = weights[f"{name}.weight"]  # [out, in]
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=gen) * std
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def merge_lora(base: str | Path, adapter: str | Path, out_dir: str | Path) -> Path:
    """A copy of the model folder ``base`` with ``adapter`` merged into its weights."""
    base, out = Path(base), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    lora = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    weights = _weights(base)
    for key, a in lora.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = lora[key.replace("lora_A", "lora_B")]
        w = weights[f"{name}.weight"]
        weights[f"{name}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
