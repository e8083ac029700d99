"""Which linear layers a CPU packed-weight path swaps, and whether their copies fit.

Both packed-weight paths (``cpu_linear`` in float32, ``onednn_linear`` in bfloat16) keep
packed copies beside or instead of a model's plain weights, so each asks
``linear_targets`` first: the layers of one dtype, the logits weight where it is tied to the
embedding, and None where ``copies`` packed copies would take more than ``MAX_MEMORY_SHARE``
of the memory available at load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

MAX_MEMORY_SHARE = 0.25  # of MemAvailable, for all packed copies together


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class LinearTargets:
    """A model's CPU ``nn.Linear`` modules of one dtype, and its logits weight where it is
    not one of them (tied to the embedding): what a packed-weight path swaps."""

    layers: list[tuple[nn.Module, str, nn.Linear]]
    head: torch.Tensor | None


def linear_targets(model: nn.Module, dtype: torch.dtype, copies: int = 1) -> LinearTargets | None:
    """``model``'s ``dtype`` CPU linear layers, or None (logged) where ``copies`` packed
    copies of them would exceed ``MAX_MEMORY_SHARE`` of the memory available now."""
    head = getattr(model, "logits_weight", None)
    head_w = head() if callable(head) else None
    if head_w is not None and (head_w.dtype != dtype or head_w.device.type != "cpu"):
        head_w = None  # kept on torch, as the layers below
    layers = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.weight is not head_w  # packed once, as model.logits_linear
        and child.weight.dtype == dtype
        and child.weight.device.type == "cpu"
    ]
    elem = torch.finfo(dtype).bits // 8
    need = sum(c.weight.numel() * elem for _, _, c in layers)
    need += head_w.numel() * elem if head_w is not None else 0
    need *= copies
    avail = mem_available()
    if avail is not None and need > MAX_MEMORY_SHARE * avail:
        log.info("linear layers: %d packed copies of the %s weights (%.1f GB) would exceed "
                 "%.0f%% of available memory", copies, dtype, need / 1e9,
                 MAX_MEMORY_SHARE * 100)  # fmt: skip
        return None
    return LinearTargets(layers, head_w)
