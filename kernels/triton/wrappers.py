"""Host wrappers: validate inputs (checks.py), then launch the jit kernels.

``prefix_attention`` is the entry: variant "fused" (one launch) or "cascade" (three
launches), also named ``fused_prefix_attention`` and ``cascade_prefix_attention``;
``choose_variant`` picks the faster for a batch (the engine's default). ``paged_attention``
(no sharing; variants.py builds its inputs) is the comparison variant; ``write_kv`` stores
new K/V in the paged caches. On CPU tensors the kernels run under Triton's interpreter,
which needs TRITON_INTERPRET=1 set before triton is first imported.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache, partial
from types import ModuleType

import torch

from ..meta import AttentionMetadata, cdiv
from .checks import (
    SUPPORTED_DTYPES,
    Dims,
    _fail,
    check_device,
    check_index,
    check_meta,
    check_out,
    check_qkv,
    check_scale,
    check_sequences,
    interpreting,
    jit_module,
    next_power_of_2,
)


def autotuning() -> bool:
    """BATCHJOB_TRITON_AUTOTUNE=0 launches each kernel's first autotune config instead: no
    benchmarking of 5-8 configs, each compiled, per new shape (the CUDA tests and
    compute-sanitizer runs; aot_check compiles that config for sm_90 in CI)."""
    return os.environ.get("BATCHJOB_TRITON_AUTOTUNE", "1") != "0"


def first_config(tuned) -> dict[str, int]:
    """An autotuned kernel's first config as launch keywords (tiles, warps, stages)."""
    cfg = tuned.configs[0]
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def fixed_configs(tuned, interpret_config: dict[str, int]) -> list[dict[str, int]] | None:
    """The configs a kernel launches with instead of autotuning, the first that fits the GPU
    (``launch_fitting``): its autotune list in order with BATCHJOB_TRITON_AUTOTUNE=0, the
    interpreter's small tiles when interpreting; None: autotune."""
    if not autotuning():
        return [
            {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
            for c in tuned.configs
        ]
    return [interpret_config] if interpreting() else None


def launch_fitting(kernel, grid, args: tuple, consts: dict, configs: list[dict[str, int]]) -> None:
    """``kernel`` launched with the first of ``configs`` this GPU has the shared memory and
    registers for (the autotuner drops those that do not fit; a fixed list must too: float32
    tiles of the first config need more than an H200's 227 KiB). ``grid``: config -> grid."""
    from triton.runtime.errors import OutOfResources  # a launch has imported triton

    for cfg in configs[:-1]:
        try:
            kernel[grid(cfg)](*args, **consts, **cfg)
            return
        except OutOfResources:
            continue
    kernel[grid(configs[-1])](*args, **consts, **configs[-1])


def tune_key(max_q_len: int, has_groups: bool) -> int:
    """Autotune bucket: decode-only / short chunks / long chunks, with or without groups."""
    bucket = 0 if max_q_len <= 1 else 1 if max_q_len <= 16 else 2 if max_q_len <= 128 else 3
    return bucket * 2 + int(has_groups)


def dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """DOT_F32 works around the interpreter's broken bf16 tl.dot; fp32 dots use tf32x3
    (three tf32 tensor-core products: about fp32 accuracy without FMA-loop dots)."""
    return {
        "DOT_F32": interpreting() and dtype == torch.bfloat16,
        "DOT_PREC": "tf32x3" if dtype == torch.float32 else "tf32",
    }


def group_order(meta: AttentionMetadata) -> torch.Tensor:
    """int32 [G]: groups sorted by their first query token (the prefix tiles' numbering)."""
    return torch.argsort(meta.group_q_start).to(torch.int32)


@dataclass(frozen=True)
class Split:
    """How the prefix is cut into pieces, each one program (see prefix_attention.py)."""

    pieces: int  # N_SPLIT: the most pieces any group has
    length: int  # SPLIT_LEN: prefix keys per piece


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_split(dims: Dims, meta: AttentionMetadata, split_len: int | None = None) -> Split:
    """Cut long prefixes when there are too few prefix tiles to fill the GPU.

    ``split_len`` (keys per piece) overrides the heuristic: about two waves of prefix
    programs, pieces of at least 256 keys, at most 16 pieces.
    """
    longest = max(1, meta.max_prefix_len)
    if split_len is None:
        split_len = longest
        if meta.num_groups and meta.prefix_len.is_cuda:
            tiles = (dims.num_tokens // max(1, 64 // dims.gqa_pad) + meta.num_groups) * (
                dims.num_kv_heads
            )
            want = cdiv(2 * _num_sms(meta.prefix_len.device.index or 0), tiles)
            pieces = max(1, min(want, 16, longest // 256))
            split_len = cdiv(longest, pieces)
    split_len = max(1, split_len)
    return Split(cdiv(longest, split_len), split_len)


class Workspace:
    """Scratch for partial (o, lse) results and the fused kernel's merge counters.

    Counters are zero when allocated and every fused launch leaves them zero, so one
    workspace serves any number of launches on one stream (not concurrent ones).
    """

    def __init__(self) -> None:
        self._o: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None
        self._cnt: torch.Tensor | None = None

    def get(
        self, dims: Dims, slots: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ws_o fp32 [T, Hq, slots, D], ws_lse fp32 [T, Hq, slots], counters int32 [T, Hq]
        (flat, possibly longer)."""
        th = max(1, dims.num_tokens * dims.num_q_heads)
        need = th * slots * dims.head_dim
        if self._o is None or self._o.device != device or self._o.numel() < need:
            self._o = torch.empty(need, dtype=torch.float32, device=device)
        if self._lse is None or self._lse.device != device or self._lse.numel() < th * slots:
            self._lse = torch.empty(th * slots, dtype=torch.float32, device=device)
        if self._cnt is None or self._cnt.device != device or self._cnt.numel() < th:
            self._cnt = torch.zeros(th, dtype=torch.int32, device=device)
        return self._o, self._lse, self._cnt


def _kv_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


def _consts(dims: Dims, dtype: torch.dtype) -> dict[str, object]:
    return {
        "GQA": dims.gqa,
        "GQA_PAD": dims.gqa_pad,
        "D": dims.head_dim,
        "D_PAD": dims.d_pad,
        "PAGE": dims.page,
        **dot_flags(dtype),
    }


def _prefix_tiles(dims: Dims, num_groups: int, block_m: int) -> int:
    return dims.num_tokens // dims.tok(block_m) + num_groups if num_groups else 0


def _own_tiles(dims: Dims, num_seqs: int, block_m: int) -> int:
    return dims.num_tokens // dims.tok(block_m) + num_seqs


VARIANTS = ("fused", "cascade")  # how prefix_attention launches (see its docstring)


def choose_variant(meta: AttentionMetadata) -> str:
    """The faster launch for a batch: fused for decode-only batches, cascade once any
    sequence brings a prefill chunk. Measured (H200, bf16, 32/8 heads x 128, the paper's
    Figure 8 shapes, ``bench_kernels.py``): with 7 chunks of 512 beside 256 decodes the cascade
    took 0.61-0.81x the fused kernel's time in all five prefix settings, eagerly launched and
    replayed alike; on decode-only batches the fused kernel was 6-17% faster at 32 requests
    and, launched eagerly as the engine launches it, as fast or faster at 256."""
    return "cascade" if meta.max_q_len > 1 else "fused"


def _signature(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """What a plan's checks of q and the caches depend on: shapes, strides, dtypes, device."""
    return (
        q.shape, q.stride(), q.dtype, q.device,
        k_cache.shape, k_cache.stride(), k_cache.dtype, v_cache.shape, v_cache.stride(),
        v_cache.dtype, v_cache.device, k_cache.device,
    )  # fmt: skip


@dataclass(frozen=True)
class AttentionPlan:
    """One batch's prefix-shared attention, checked and derived once (``plan_attention``) and
    launched for every layer (``run``): the per-layer host work is the launch itself."""

    meta: AttentionMetadata
    dims: Dims
    signature: tuple  # _signature of the q and caches it was checked with
    qk_scale: float  # scale * log2(e)
    split: Split
    ws: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ws_o, ws_lse, counters
    order: torch.Tensor
    variant: str
    config: dict[str, int] | None

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """out [T, Hq, D] for this layer's q and caches (same shapes, strides and dtypes as the
        plan's: a ValueError otherwise)."""
        if _signature(q, k_cache, v_cache) != self.signature:
            _fail("q or the KV caches differ in shape, strides, dtype or device from the plan's")
        out = check_out(out, q)
        if self.dims.num_tokens == 0 or self.meta.num_seqs == 0:
            return out
        if self.variant == "fused":
            _launch_fused(self, q, k_cache, v_cache, out)
        else:
            _launch_cascade(self, q, k_cache, v_cache, out)
        return out


def plan_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    variant: str = "fused",
    workspace: Workspace | None = None,
    order: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    split_len: int | None = None,
) -> AttentionPlan:
    """Checks the inputs and derives what every layer of the batch shares (the arguments are
    ``prefix_attention``'s); ``AttentionPlan.run`` launches it."""
    if variant not in VARIANTS:
        _fail(f"unknown variant {variant!r}; choose one of {VARIANTS}")
    if config is not None and variant != "fused":
        _fail(f"config is for the fused variant only, got variant {variant!r}")
    dims = check_qkv(q, k_cache, v_cache)
    check_meta(dims, meta, q.device)
    qk_scale = check_scale(scale) * math.log2(math.e)
    split = choose_split(dims, meta, split_len)
    ws = (workspace or Workspace()).get(dims, split.pieces + 1, q.device)
    order = group_order(meta) if order is None else order
    return AttentionPlan(
        meta, dims, _signature(q, k_cache, v_cache), qk_scale, split, ws, order, variant, config
    )


def prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    variant: str = "fused",
    workspace: Workspace | None = None,
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    split_len: int | None = None,
) -> torch.Tensor:
    """Prefix-shared paged attention. q: [T, Hq, D] -> out: [T, Hq, D].

    ``variant="fused"`` runs prefix part, own part and merge in ONE launch; ``"cascade"`` in
    three (prefix, own, merge: FlashInfer-cascade style) with the same tiles, prefix pieces
    and partials. ``choose_variant(meta)`` says which is faster for a batch.
    ``order`` (int32 [G], from ``group_order(meta)``) may be passed to reuse it across layers.
    ``config`` (fused only: BLOCK_M_P, BLOCK_N_P, BLOCK_M_O, BLOCK_N_O, optional num_warps,
    num_stages) fixes the tiles instead of autotuning (or of the interpreter's small tiles).
    ``split_len`` fixes the prefix keys per program (default: choose_split's heuristic).
    For many layers of one batch, ``plan_attention`` once and ``AttentionPlan.run`` per layer.
    """
    plan = plan_attention(
        q, k_cache, v_cache, meta, scale,
        variant=variant, workspace=workspace, order=order, config=config, split_len=split_len,
    )  # fmt: skip
    return plan.run(q, k_cache, v_cache, out)


fused_prefix_attention = partial(prefix_attention, variant="fused")
cascade_prefix_attention = partial(prefix_attention, variant="cascade")


def _launch_fused(
    c: AttentionPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
) -> None:
    meta, dims, split, config = c.meta, c.dims, c.split, c.config
    s, g, (ws_o, ws_lse, cnt) = meta.num_seqs, meta.num_groups, c.ws
    mod = jit_module("attention_kernels")

    def grid(c: dict) -> tuple[int, int]:
        n = _prefix_tiles(dims, g, c["BLOCK_M_P"]) * split.pieces
        return (n + _own_tiles(dims, s, c["BLOCK_M_O"]), dims.num_kv_heads)

    args = (
        q, k_cache, v_cache, out, ws_o, ws_lse, cnt,
        meta.cu_q, meta.kv_len, meta.block_table, meta.seq_group,
        meta.prefix_len, meta.prefix_block_table, meta.group_q_start, meta.group_q_end, c.order,
        s, g, dims.num_tokens, dims.num_q_heads, split.pieces, split.length, c.qk_scale,
        q.stride(0), q.stride(1), *_kv_strides(k_cache, v_cache), out.stride(0), out.stride(1),
        meta.block_table.stride(0), meta.prefix_block_table.stride(0),
        tune_key(meta.max_q_len, g > 0),
    )  # fmt: skip
    configs = [config] if config is not None else None
    if configs is None:
        configs = fixed_configs(mod.fused_kernel_tuned, mod.INTERPRET_FUSED)
    if configs is None:
        mod.fused_kernel_tuned[grid](*args, **_consts(dims, q.dtype))
        return
    least = max(16, dims.gqa_pad)  # a tile holds at least one token's GQA query rows
    fits = [c for c in configs if min(c["BLOCK_M_P"], c["BLOCK_M_O"]) >= least]
    if not fits:
        _fail(f"config {configs[0]}: BLOCK_M_P and BLOCK_M_O must be >= max(16, GQA)")
    launch_fitting(mod.fused_kernel, grid, args, _consts(dims, q.dtype), fits)


def _launch_cascade(
    c: AttentionPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
) -> None:
    meta, dims, split = c.meta, c.dims, c.split
    s, g, (ws_o, ws_lse, _) = meta.num_seqs, meta.num_groups, c.ws
    mod = jit_module("attention_kernels")
    consts = _consts(dims, q.dtype)
    hq, key = dims.num_q_heads, tune_key(meta.max_q_len, g > 0)
    kv_strides = _kv_strides(k_cache, v_cache)
    if g:
        args = (
            q, k_cache, v_cache, ws_o, ws_lse, meta.prefix_len, meta.prefix_block_table,
            meta.group_q_start, meta.group_q_end, c.order, g, hq, split.pieces, split.length,
            c.qk_scale, q.stride(0), q.stride(1), *kv_strides, meta.prefix_block_table.stride(0),
            key,
        )  # fmt: skip
        tiles = lambda bm: _prefix_tiles(dims, g, bm) * split.pieces  # noqa: E731
        _launch_part(mod, "prefix_kernel", args, consts, tiles, dims)
    args = (
        q, k_cache, v_cache, out, ws_o, ws_lse, meta.cu_q, meta.kv_len, meta.block_table,
        meta.seq_group, meta.prefix_len, s, hq, split.pieces, split.length, c.qk_scale,
        q.stride(0), q.stride(1), *kv_strides, out.stride(0), out.stride(1),
        meta.block_table.stride(0), key,
    )  # fmt: skip
    consts_own = {**consts, "HAS_GROUPS": g > 0}
    _launch_part(mod, "own_kernel", args, consts_own, lambda bm: _own_tiles(dims, s, bm), dims)
    if g:
        bm = max(mod.MERGE_BLOCK_M, dims.gqa_pad)
        mod.merge_kernel[(_prefix_tiles(dims, g, bm), dims.num_kv_heads)](
            out, ws_o, ws_lse, meta.prefix_len, meta.group_q_start, meta.group_q_end, c.order,
            g, hq, split.pieces, split.length, out.stride(0), out.stride(1),
            GQA=dims.gqa, GQA_PAD=dims.gqa_pad, D=dims.head_dim, D_PAD=dims.d_pad, BLOCK_M=bm,
        )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    kv_len: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain causal paged attention, no sharing: each sequence's full KV is in block_table."""
    dims = check_qkv(q, k_cache, v_cache)
    s = check_sequences(dims, cu_q, kv_len, block_table, q.device)
    scale = check_scale(scale)
    out = check_out(out, q)
    if dims.num_tokens == 0 or s == 0:
        return out
    mod = jit_module("attention_kernels")
    args = (
        q, k_cache, v_cache, out, out, out, cu_q, kv_len, block_table, kv_len, kv_len,
        s, dims.num_q_heads, 1, 1, scale * math.log2(math.e),
        q.stride(0), q.stride(1), *_kv_strides(k_cache, v_cache), out.stride(0), out.stride(1),
        block_table.stride(0), tune_key(max_q_len, False),
    )  # fmt: skip
    consts = {**_consts(dims, q.dtype), "HAS_GROUPS": False}
    _launch_part(mod, "own_kernel", args, consts, lambda bm: _own_tiles(dims, s, bm), dims)
    return out


def _launch_part(mod: ModuleType, name: str, args: tuple, consts: dict, tiles, dims: Dims) -> None:
    """Launch prefix_kernel / own_kernel: autotuned, or with ``fixed_configs``."""
    tuned = getattr(mod, name + "_tuned")
    configs = fixed_configs(tuned, mod.INTERPRET_PART)
    grid = lambda c: (tiles(c["BLOCK_M"]), dims.num_kv_heads)  # noqa: E731
    if configs is None:
        tuned[grid](*args, **consts)
    else:
        launch_fitting(getattr(mod, name), grid, args, consts, configs)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    checked: bool = False,
) -> None:
    """k, v: [T, Hkv, D] -> k_cache, v_cache: [num_blocks, block_size, Hkv, D] at slot_mapping.

    slot_mapping: int64 [T], slot = block * block_size + offset; negative slots are skipped.
    k, v are cast to the caches' dtype. ``checked``: ``check_write_kv`` already passed on
    tensors of these shapes, strides, dtypes and devices (every layer of a batch after the
    first).
    """
    if not checked:
        check_write_kv(k_cache, v_cache, k, v, slot_mapping)
    t, h, d = k.shape
    if t == 0:
        return
    mod = jit_module("kv_write")
    mod.write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        H=h, D=d, H_PAD=next_power_of_2(h), D_PAD=next_power_of_2(d), PAGE=k_cache.shape[1],
    )  # fmt: skip


def kv_signature(k_cache, v_cache, k, v) -> tuple:
    """What ``check_write_kv`` depends on besides slot_mapping."""
    return (
        k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device,
        k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
        v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
    )  # fmt: skip


def check_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``write_kv``'s arguments: shapes, dtypes, devices, strides (a ValueError naming it)."""
    if k.dim() != 3 or v.shape != k.shape:
        _fail(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        _fail(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[2:] != k.shape[1:]:
        _fail(f"k rows {tuple(k.shape[1:])} do not fit cache rows {tuple(k_cache.shape[2:])}")
    if k.dtype != v.dtype or k_cache.dtype != v_cache.dtype:
        _fail(f"k/v dtypes ({k.dtype}, {v.dtype}) or cache dtypes differ")
    for x in (k, k_cache):
        if x.dtype not in SUPPORTED_DTYPES:
            _fail(f"dtype {x.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    devices = {k.device, v.device, k_cache.device, v_cache.device}
    if len(devices) != 1:
        _fail(f"k, v and the caches must be on one device, got {devices}")
    check_index("slot_mapping", slot_mapping, 1, torch.int64, k.device)
    if slot_mapping.shape[0] != k.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            _fail(f"{name} must be contiguous in its last dim, strides {x.stride()}")
    check_device(k.device)
