"""Input validation for the host wrappers, and the Triton mode helpers.

Every check raises a ValueError naming the offending argument before anything is launched.
Nothing here imports triton at module import: ``import batchjob.kernels`` stays cheap and does
not fix Triton's interpreter setting (TRITON_INTERPRET is read when triton is first imported).
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from ..meta import AttentionMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GQA = 16  # query heads per kv head; the smallest tile has 16 rows
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def interpreting() -> bool:
    """Is TRITON_INTERPRET on right now (Triton's own parsing of the variable)?"""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def jit_module(name: str) -> ModuleType:
    """batchjob.kernels.<name> (jit code); checks it matches the TRITON_INTERPRET setting.

    Triton fixes interpreter-or-compiler when a @triton.jit function is decorated, its own
    library (tl.zeros, tl.sum, ...) included, i.e. when triton is first imported.
    """
    import triton.language as tl

    mod = importlib.import_module(f"{__package__}.{name}")
    built = {type(tl.zeros).__name__ == "InterpretedFunction", bool(mod.INTERPRETED)}
    if built != {interpreting()}:
        _fail(
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} now, but triton was imported "
            "under another setting: set TRITON_INTERPRET before anything imports triton"
        )
    return mod


@dataclass(frozen=True)
class Dims:
    """Problem sizes the kernels are specialised on."""

    num_tokens: int  # T
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    page: int  # KV block size
    gqa: int  # Hq // Hkv
    gqa_pad: int  # gqa rounded up to a power of two
    d_pad: int  # D rounded up to a power of two (at least 16)

    def tok(self, block_m: int) -> int:
        """Query tokens per tile of block_m rows."""
        return block_m // self.gqa_pad


def _fail(msg: str) -> None:
    raise ValueError(msg)


def check_device(device: torch.device) -> None:
    if device.type != "cuda" and not interpreting():
        _fail(
            f"Triton kernels need CUDA tensors (got {device.type}); on CPU set "
            "TRITON_INTERPRET=1 before triton is first imported to use Triton's interpreter"
        )


def check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Dims:
    """q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]."""
    if q.dim() != 3:
        _fail(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        _fail(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        _fail(f"dtype {q.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        _fail(
            f"q, k_cache, v_cache must share a dtype: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if not (q.device == k_cache.device == v_cache.device):
        _fail(f"q, k_cache, v_cache on different devices: {q.device}, {k_cache.device}")
    check_device(q.device)
    t, hq, d = q.shape
    _, page, hkv, d_kv = k_cache.shape
    if d_kv != d:
        _fail(f"head dim of q ({d}) and of the KV cache ({d_kv}) differ")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        _fail(f"head dim {d} outside [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if hkv == 0 or hq % hkv != 0:
        _fail(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if hq // hkv > MAX_GQA:
        _fail(f"{hq // hkv} query heads per kv head; at most {MAX_GQA} supported")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            _fail(f"{name} must be contiguous in its last (head) dim, strides {x.stride()}")
    if page < 1:
        _fail("block_size must be >= 1")
    gqa = hq // hkv
    return Dims(t, hq, hkv, d, page, gqa, next_power_of_2(gqa), max(16, next_power_of_2(d)))


def check_index(name: str, x: torch.Tensor, dims: int, dtype: torch.dtype, device) -> None:
    if x.dtype != dtype:
        _fail(f"metadata {name} must be {dtype}, got {x.dtype}")
    if x.dim() != dims:
        _fail(f"metadata {name} must have {dims} dim(s), got shape {tuple(x.shape)}")
    if x.device != device:
        _fail(f"metadata {name} is on {x.device}, q is on {device}")
    if x.numel() and x.stride(-1) != 1:
        _fail(f"metadata {name} must be contiguous in its last dim, strides {x.stride()}")


def check_sequences(
    dims: Dims, cu_q: torch.Tensor, kv_len: torch.Tensor, block_table: torch.Tensor, device
) -> int:
    """Checks the per-sequence tensors; returns S."""
    check_index("cu_q", cu_q, 1, torch.int32, device)
    check_index("kv_len", kv_len, 1, torch.int32, device)
    check_index("block_table", block_table, 2, torch.int32, device)
    s = kv_len.shape[0]
    if cu_q.shape[0] != s + 1:
        _fail(f"cu_q has {cu_q.shape[0]} entries, expected num_seqs + 1 = {s + 1}")
    if block_table.shape[0] != s or (s and block_table.shape[1] == 0):
        _fail(f"block_table must be [{s}, max_blocks >= 1], got {tuple(block_table.shape)}")
    return s


def check_meta(dims: Dims, meta: AttentionMetadata, device) -> None:
    s = check_sequences(dims, meta.cu_q, meta.kv_len, meta.block_table, device)
    check_index("seq_group", meta.seq_group, 1, torch.int32, device)
    check_index("slot_mapping", meta.slot_mapping, 1, torch.int64, device)
    if meta.seq_group.shape[0] != s:
        _fail(f"seq_group has {meta.seq_group.shape[0]} entries, expected {s}")
    g = meta.prefix_len.shape[0]
    for name in ("prefix_len", "group_q_start", "group_q_end"):
        x = getattr(meta, name)
        check_index(name, x, 1, torch.int32, device)
        if x.shape[0] != g:
            _fail(f"metadata {name} has {x.shape[0]} entries, expected num_groups = {g}")
    pbt = meta.prefix_block_table
    if g == 0:  # never read: any int32 tensor on the device will do
        check_index("prefix_block_table", pbt, pbt.dim(), torch.int32, device)
        return
    check_index("prefix_block_table", pbt, 2, torch.int32, device)
    if pbt.shape[0] != g or pbt.shape[1] == 0:
        _fail(f"prefix_block_table must be [{g}, max_prefix_blocks >= 1], got {tuple(pbt.shape)}")


def check_scale(scale: float) -> float:
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        _fail(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        _fail(f"out must match q: {tuple(out.shape)} {out.dtype} vs {tuple(q.shape)} {q.dtype}")
    if out.stride(-1) != 1:
        _fail("out must be contiguous in its last dim")
    return out
