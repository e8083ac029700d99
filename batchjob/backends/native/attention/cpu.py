"""The CPU attention backend: prefix-shared paged attention read in place by a C kernel.

``CpuAttention`` turns ``AttentionMetadata`` into work units for kernels/cpu/paged_attention.c
(once per batch; every layer reuses them): each unit is a tile of up to ``max_rows`` query
rows (tokens x the query heads of one KV head) against one key sequence, either a
sequence's own KV (causal) or its group's shared prefix (all the group's queries at once).
Unlike the torch path it never copies KV out of the cache: a decode step reads each shared
prefix once per group and each own KV once. A sliding window is a unit's first visible key
(LO): the kernel starts its walk at that key's chunk and masks the rest.

The kernel is built per ISA (kernels/cpu/build.py: amx, avx512bf16, avx512, avx2, generic; ``isa``
or ``$BATCHJOB_CPU_ISA`` forces a narrower one). Per shape class (head dim, GQA ratio, decode /
prefill / prefix) a first-use calibration (calibrate.py, cached on disk) times the kernel against
``TorchAttention`` and the faster one takes that class's batches, so the backend is never slower
than its own fallback. Caches are float32 or bfloat16 (widened to float32 chunk by chunk in the
kernel; queries and softmax in float32). The avx512bf16 and amx builds multiply a bfloat16 cache's
key-major tiles (prefill, and prefixes shared by 8 or more rows) without widening, on vdpbf16ps or
AMX tiles: bf16 products summed in float32, queries and P rounded to bf16. Cases the kernel does not
take (other cache dtypes, head dims not a multiple of the ISA's vector width or over 256, block
sizes not multiples of 16, no C compiler) go to ``TorchAttention``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from batchjob.backends.native.attention import calibrate as calib
from batchjob.backends.native.attention.base import (
    BatchMemo,
    into,
    token_positions,
    window_applies,
)
from batchjob.backends.native.attention.meta import AttentionMetadata
from batchjob.backends.native.attention.torch_path import TorchAttention
from batchjob.kernels.cpu.build import CpuKernel, load_kernel
from batchjob.plan.intmath import cdiv

MAX_ROWS = 64  # the widest build's (avx512) rows per unit; each build reports its own
# under this many rows a head, a unit's heads are row-major (the kernel's FEW_ROWS); float32
# units at some ISAs and head dims stay row-major up to 16 rows, within the scratch sized here
WHOLE_ROWS = 8
MAX_WHOLE_ROWS = 256  # an all-head unit's scratch rows (the kernel's MAX_WROWS)
KV_DTYPES = (torch.float32, torch.bfloat16)
# unit fields, in the kernel's order
Q0, NQ, NKEYS, BLK, CAUSAL, DST, KVH, LO = FIELD_INDEX = range(8)
FIELDS = len(FIELD_INDEX)
NO_LO = -(1 << 40)  # LO of a unit without a sliding window: below any key


def _tiles(starts: np.ndarray, lens: np.ndarray, tile: int):
    """Split ranges [start, start + len) into tiles of <= ``tile``: (owner, start, length)."""
    n = cdiv(lens, tile)
    owner = np.repeat(np.arange(len(lens)), n)
    first = np.repeat(np.cumsum(n) - n, n)
    off = (np.arange(int(n.sum())) - first) * tile
    return owner, starts[owner] + off, np.minimum(tile, lens[owner] - off), off


def head_rows(rows: np.ndarray, lanes: int) -> np.ndarray:
    """Scratch rows one KV head's ``rows`` query rows take in an all-head unit: row-major
    under ``WHOLE_ROWS``, else a key-major tile of 1, 2, 4 or 8 vectors of ``lanes`` (the
    kernel's batchjob_kernel_head_rows)."""
    nv = np.select([rows <= lanes, rows <= 2 * lanes, rows <= 4 * lanes], [1, 2, 4], 8)
    return np.where(rows < WHOLE_ROWS, rows, nv * lanes)


def tile_tokens(max_rows: int, h: int, hkv: int) -> int:
    """Query tokens in one key-major tile of ``max_rows`` rows: each token brings its
    ``h // hkv`` query heads of a KV head."""
    return max(1, max_rows // (h // hkv))


def build_units(
    meta: AttentionMetadata,
    h: int,
    hkv: int,
    max_rows: int = MAX_ROWS,
    lanes: int = 16,
    threads: int = 1,
    whole_tiles: bool = True,
    max_whole: int = MAX_WHOLE_ROWS,
    window: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(units int64 [U, FIELDS], blocks int32): the kernel's work for one batch, costliest
    first.

    A unit's KVH is one KV head, or -1 for all of them: a tile whose rows of all KV heads fit
    one unit (``head_rows``, ``MAX_WHOLE_ROWS``) reads each KV block as one contiguous stream,
    not one head's rows 4 KiB apart (at 8 x 128): decode rows, and a prefix shared by 8-32
    decoding rows (0.65-0.85x the time of per-head units on such decode shapes, AVX2). Unless
    the unit would hold more than a ``threads``-th of the batch's work: then per head, so the
    threads stay balanced. ``whole_tiles`` False: key-major tiles per head (AMX runs those);
    ``max_whole``: the build's all-head scratch rows (older kernels: their ``max_rows``).

    ``window``: a sliding window (a query sees the keys of its last W positions). Own units
    get their first visible key (LO); a group's prefix unit stays one tile of all its members'
    queries while none of them is past the window, else each member's queries get their own
    prefix units (LO from their positions), and those the window hides the prefix from none."""
    r = h // hkv
    tile = tile_tokens(max_rows, h, hkv)
    cu_q = meta.cu_q.cpu().numpy().astype(np.int64)
    q_len = np.diff(cu_q)
    kv_len = meta.kv_len.cpu().numpy().astype(np.int64)
    table = meta.block_table.cpu().numpy().astype(np.int32)
    p_table = meta.prefix_block_table.cpu().numpy().astype(np.int32)
    s, e = meta.group_q_start.cpu().numpy(), meta.group_q_end.cpu().numpy()
    p_len = meta.prefix_len.cpu().numpy().astype(np.int64)

    def prefix_units(grp, q0, nq, lo) -> np.ndarray:  # [FIELDS, n]: tiles of groups' prefixes
        base = table.size + grp * p_table.shape[1]  # DST 1 (pout); KVH set below
        return np.stack([q0, nq, p_len[grp], base, p_len[grp], 0 * grp + 1, 0 * grp, lo])

    own, q0, nq, off = _tiles(cu_q[:-1], q_len, tile)
    causal = kv_len[own] - q_len[own] + off
    lo = 0 * own + NO_LO if window is None else causal - window + 1
    own_u = np.stack([q0, nq, kv_len[own], own * table.shape[1], causal, 0 * own, 0 * own, lo])
    parts = [own_u]
    g = np.nonzero((p_len > 0) & (e > s))[0]
    split = np.zeros(len(p_len), dtype=bool)  # groups whose members' prefix units are their own
    if len(g) and window is not None:
        pos = token_positions(meta)
        split[g] = [pos[s[i] : e[i]].max() >= window for i in g]
    g = g[~split[g]]
    if len(g):
        gi, q0, nq, _ = _tiles(s[g].astype(np.int64), (e[g] - s[g]).astype(np.int64), tile)
        grp = g[gi]
        parts.append(prefix_units(grp, q0, nq, 0 * grp + NO_LO))
    if split.any():  # each member's own tiles against the prefix: LO by absolute position
        group = meta.seq_group.cpu().numpy().astype(np.int64)[own]
        t = np.nonzero((group >= 0) & split[np.maximum(group, 0)])[0]
        grp, q0, nq = group[t], own_u[Q0, t], own_u[NQ, t]
        lo = pos[q0] - window + 1
        keep = lo < p_len[grp]  # the rest see no prefix key: no partial (lse stays -inf)
        parts.append(prefix_units(grp[keep], q0[keep], nq[keep], lo[keep]))
    u = np.concatenate(parts, axis=1).T  # [n, FIELDS], KVH set below
    # tiles whose rows of all KV heads fit one unit take them all: whole blocks stream
    rows = u[:, NQ] * r
    whole = (hkv * head_rows(rows, lanes) <= max_whole) & (whole_tiles | (rows < WHOLE_ROWS))
    first = np.maximum(u[:, LO], 0)  # a window's first visible key
    keys = np.maximum(np.minimum(u[:, NKEYS], u[:, CAUSAL] + u[:, NQ]) - first, 1)
    work = u[:, NQ] * keys  # query-key pairs a head (at most)
    whole &= work * threads <= work.sum()  # no unit over a thread's share (x hkv both sides)
    # head-major: equal-cost units of one KV head run back to back, its KV stays in L2
    per_head = np.tile(u[~whole], (hkv, 1))
    units = np.concatenate([per_head, u[whole]])
    units[: len(per_head), KVH] = np.repeat(np.arange(hkv), int((~whole).sum()))
    units[len(per_head) :, KVH] = -1
    cost = np.concatenate([np.tile(work[~whole], hkv), work[whole] * hkv])
    units = units[_overlap_order(cost, units[:, NQ] * r < WHOLE_ROWS)]
    return np.ascontiguousarray(units), np.concatenate([table.ravel(), p_table.ravel()])


def _overlap_order(cost: np.ndarray, streams: np.ndarray) -> np.ndarray:
    """The units' run order: each kind costliest first, the ``streams`` (few rows a head:
    decode rows over their own KV, bound by memory) spread evenly between the others (tiles
    bound by compute), so the threads, taking units in turn, overlap the two kinds instead of
    all computing, then all waiting on memory (a decode step's layer call over groups of 16
    sharing 1000 tokens, 8/2 x 128, 2 threads: 5% less time; long documents: even)."""
    order = np.argsort(-cost, kind="stable")
    ns, nc = int(streams.sum()), int((~streams).sum())
    if not ns or not nc:
        return order
    pos = np.empty(len(cost))
    s = streams[order]
    pos[~s] = np.arange(nc)
    pos[s] = (np.arange(ns) + 0.5) * nc / ns
    return order[np.argsort(pos, kind="stable")]


def _work(
    meta: AttentionMetadata,
    h: int,
    hkv: int,
    max_rows: int,
    lanes: int = 16,
    threads: int = 1,
    whole_tiles: bool = True,
    max_whole: int = MAX_WHOLE_ROWS,
    window: int | None = None,
) -> tuple[np.ndarray, np.ndarray, bool]:
    units, blocks = build_units(
        meta, h, hkv, max_rows, lanes, threads, whole_tiles, max_whole, window
    )
    return units, blocks, bool(units[:, DST].any())


def whole_tiles(kn: CpuKernel, kv_bf16: bool) -> bool:
    """Whether ``build_units`` may put a key-major tile's rows of all KV heads in one unit. Not
    where the build multiplies bf16 tiles on AMX: the kernel runs only one-KV-head units there
    (``run_unit_bf16``), so an all-head tile would take the vdpbf16ps path instead."""
    return not (kv_bf16 and kn.isa == "amx")


def kernel_takes(kn: CpuKernel, heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel build ``kn`` runs this attention shape: head dims a multiple of its
    vector width up to 256, blocks a multiple of 16, a KV head's query heads within a unit."""
    return (
        head_dim % kn.lanes == 0
        and head_dim <= 256
        and block_size % 16 == 0
        and heads % kv_heads == 0
        and heads // kv_heads <= kn.max_rows
    )


def run_units(
    kn: CpuKernel,
    q: torch.Tensor,
    k_ptr: int,
    v_ptr: int,
    hkv: int,
    bs: int,
    strides: tuple[int, int, int],
    units: np.ndarray,
    blocks: np.ndarray,
    has_prefix: bool,
    threads: int,
    bf16: bool,
    scale: float,
    out: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_bf16: torch.Tensor | None = None,
) -> torch.Tensor:
    """One batch's work units on the kernel: ``q`` float32 or bfloat16 [T, H, D] with each
    token's heads contiguous (tokens any stride apart: a view of a fused QKV output; bf16
    queries are widened exactly inside the kernel, no float32 copy); the K and V caches at
    ``k_ptr`` / ``v_ptr`` with ``strides`` (a block, a key row, a KV head; in elements); the
    result in ``out`` (float32 contiguous [T, H, D], made if None). ``tokens``: None, or int64
    [T], the units' token t being row ``tokens[t]`` of q and out (the kernel reads and writes
    them in place). ``scratch``: (pout [T, H, D], lse [2, T, H]) float32 to reuse, else made.
    ``out_bf16``: None, or contiguous bfloat16 [T, H, D]: also receives the result rounded
    to bf16 (returned instead of ``out``)."""
    t, h, d = q.shape
    if q.dtype not in KV_DTYPES or q.stride(2) != 1 or q.stride(1) != d:
        raise ValueError(
            "run_units: q must be float32 or bfloat16 with each token's heads contiguous"
        )
    if tokens is not None and (tokens.dtype != torch.int64 or not tokens.is_contiguous()):
        raise ValueError("run_units: tokens must be contiguous int64")
    if out_bf16 is not None and (
        out_bf16.dtype != torch.bfloat16
        or out_bf16.shape != q.shape
        or not out_bf16.is_contiguous()
    ):
        raise ValueError("run_units: out_bf16 must be contiguous bfloat16 of q's shape")
    out = torch.empty(t, h, d, dtype=torch.float32) if out is None else out
    pout, lse = scratch if scratch is not None else (None, None)
    if pout is None or lse is None:
        pout = torch.empty(t, h, d, dtype=torch.float32) if has_prefix else out
        lse = torch.empty(2, t, h, dtype=torch.float32)
    rc = kn.strided(
        q.data_ptr(), k_ptr, v_ptr, blocks.ctypes.data_as(ctypes.c_void_p),
        units.ctypes.data_as(ctypes.c_void_p), len(units), t, h, hkv, d, bs, *strides,
        None if tokens is None else tokens.data_ptr(), q.stride(0), scale,
        out.data_ptr(), pout.data_ptr(), lse.data_ptr(), threads, int(bf16),
        int(q.dtype == torch.bfloat16), None if out_bf16 is None else out_bf16.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"CPU paged attention kernel rejected its arguments (code {rc})")
    return out if out_bf16 is None else out_bf16


def kv_rows_fit(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, hkv: int, d: int
) -> bool:
    """k, v [T, Hkv, D] as ``kv_write.c`` reads them: the cache's dtype, each token's heads
    one contiguous run of Hkv * D values (a row of a fused qkv view is), int64 slots."""
    return (
        k.dtype == v.dtype == dtype
        and slots.dtype == torch.int64
        and all(x.shape[1:] == (hkv, d) and x.stride(2) == 1 and x.stride(1) == d for x in (k, v))
    )


class CpuAttention:
    """Paged prefix-shared attention on the CPU via the C kernel (see module docstring).

    ``isa``: the kernel build (``amx|avx512bf16|avx512|avx2|generic|auto``; default
    ``$BATCHJOB_CPU_ISA`` or auto). ``calibrate``: pick kernel or torch path per shape class by a
    cached first-use measurement (default: ``$BATCHJOB_CPU_CALIBRATE`` != 0); False: the kernel
    takes every batch it supports."""

    name = "cpu"

    def __init__(self, isa: str | None = None, calibrate: bool | None = None) -> None:
        self.kernel: CpuKernel | None = load_kernel(isa)
        self.fallback = TorchAttention()
        self.calibrate = calibrate if calibrate is not None else calib.mode() != "0"
        self._work = BatchMemo()  # (units, blocks, has_prefix) of the current batch
        self._use = BatchMemo()  # kernel or torch path for the current batch

    @property
    def available(self) -> bool:
        return self.kernel is not None

    @property
    def isa(self) -> str | None:
        return self.kernel.isa if self.kernel else None

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        """Each token's K and V rows (all its KV heads: a contiguous run in a qkv view) into
        its slot, in C (kv_write.c); the torch path where dtypes or layouts differ."""
        kn = self.kernel
        nb, bs, hkv, d = k_cache.shape
        fits = (  # contiguous caches of one shape, a slot per token
            kv_rows_fit(k, v, slot_mapping, k_cache.dtype, hkv, d)
            and v_cache.dtype == k_cache.dtype
            and v_cache.shape == k_cache.shape
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and k.shape[0] == v.shape[0] == slot_mapping.shape[0]
            and slot_mapping.is_contiguous()
        )
        if (
            kn is None
            or not fits
            or kn.write_kv(
                k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], nb * bs, hkv * d,
                k.element_size(), torch.get_num_threads(), 0,
            ) != 0  # a slot out of range: the torch path raises the index error
        ):  # fmt: skip
            self.fallback.write_kv(k_cache, v_cache, k, v, slot_mapping)

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        _, bs, hkv, d = k_cache.shape
        kn = self.kernel
        return (
            kn is not None
            and q.device.type == "cpu"
            and q.dtype in KV_DTYPES
            and k_cache.dtype in KV_DTYPES
            and v_cache.dtype == k_cache.dtype
            and kernel_takes(kn, q.shape[1], hkv, d, bs)
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )

    def shape_class(self, q, k_cache, meta: AttentionMetadata) -> calib.ShapeClass:
        _, bs, hkv, d = k_cache.shape
        assert self.kernel is not None
        return calib.ShapeClass(
            self.kernel.isa,
            d,
            q.shape[1] // hkv,
            hkv,
            bs,
            str(k_cache.dtype).removeprefix("torch."),
            calib.batch_kind(meta),
        )

    def _measure(self, cls: calib.ShapeClass) -> calib.Decision:
        kernel_only = CpuAttention(cls.isa, calibrate=False)
        return calib.measure(cls, kernel_only.attend, TorchAttention().attend)

    def decision(self, q, k_cache, meta: AttentionMetadata) -> calib.Decision:
        """Kernel or torch path for this batch's shape class (calibrated on first use)."""
        assert self.kernel is not None
        cal = calib.calibration_for(self.kernel.path)
        return cal.decide(self.shape_class(q, k_cache, meta), self._measure)

    def uses_kernel(self, q, k_cache, v_cache, meta: AttentionMetadata) -> bool:
        if not self.supports(q, k_cache, v_cache):
            return False
        if not self.calibrate:
            return True
        return self._use.get(
            meta, tuple(k_cache.shape[1:]), lambda: self.decision(q, k_cache, meta).use_kernel
        )

    def attend(self, q, k_cache, v_cache, meta, scale, out=None, window=None) -> torch.Tensor:
        if not self.uses_kernel(q, k_cache, v_cache, meta):
            return self.fallback.attend(q, k_cache, v_cache, meta, scale, out, window)
        w = window if window_applies(meta, window) else None
        kn = self.kernel
        assert kn is not None
        _, h, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        threads = torch.get_num_threads()
        bf16 = k_cache.dtype == torch.bfloat16
        whole = whole_tiles(kn, bf16)
        units, blocks, has_prefix = self._work.get(
            meta,
            (h, hkv, kn.max_rows, threads, whole, w),
            lambda: _work(meta, h, hkv, kn.max_rows, kn.lanes, threads, whole, window=w),
        )
        native = (bs * hkv * d, hkv * d, d)  # [num_blocks, BS, Hkv, D]
        # bf16 queries are read in place (a view of the qkv output) and the result written as
        # bf16 by the kernel, into the caller's out when it is contiguous bf16
        in_place = q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == d
        direct = in_place and out is not None and out.dtype == q.dtype and out.is_contiguous()
        o16 = (out if direct else torch.empty(q.shape, dtype=q.dtype)) if in_place else None
        o = run_units(
            kn, q if in_place else q.to(torch.float32).contiguous(), k_cache.data_ptr(),
            v_cache.data_ptr(), hkv, bs, native, units, blocks, has_prefix, threads, bf16, scale,
            out_bf16=o16,
        )  # fmt: skip
        return o if direct else into(out, o.to(q.dtype))
