"""Entry @triton.jit kernels (fused, and the cascade pieces) plus their autotune configs.

Grid of every attention kernel: ``(tiles, Hkv)``. The fused kernel's axis-0 ids are split:
ids below ``n_prefix`` run the prefix part (tile shape BLOCK_M_P x BLOCK_N_P), the rest
run the own part (BLOCK_M_O x BLOCK_N_O): horizontal fusion of two differently tiled
problems in one launch. Prefix tiles come first so the long matrix-matrix programs start
early and the short own programs fill in behind them.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

from .prefix_attention import (
    MODE_FUSED,
    MODE_PARTIAL,
    _locate_tile,
    _merge_slots,
    _own_program,
    _prefix_program,
    _splits,
    _tile_rows,
)

INTERPRETED = triton.knobs.runtime.interpret


@triton.jit
def fused_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr,
    cu_q_ptr, kv_len_ptr, bt_ptr, seq_group_ptr,
    prefix_len_ptr, prefix_bt_ptr, gq_start_ptr, gq_end_ptr, group_order_ptr,
    S, G, T, Hq, N_SPLIT, SPLIT_LEN, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_ot, stride_oh, stride_bt, stride_pbt, TUNE_KEY,
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M_P: tl.constexpr, BLOCK_N_P: tl.constexpr,
    BLOCK_M_O: tl.constexpr, BLOCK_N_O: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Prefix part and own part of a ragged batch in one launch; merge in the epilogue."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # prefix programs: (group tile, prefix piece); 0 when G == 0
    n_prefix = tl.minimum(G, 1) * (T // (BLOCK_M_P // GQA_PAD) + G) * N_SPLIT
    if pid < n_prefix:
        _prefix_program(
            pid, kvh, q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr,
            prefix_len_ptr, prefix_bt_ptr, gq_start_ptr, gq_end_ptr, group_order_ptr,
            G, Hq, N_SPLIT, SPLIT_LEN, qk_scale,
            stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp,
            stride_vh, stride_ot, stride_oh, stride_pbt,
            GQA, GQA_PAD, D, D_PAD, PAGE, BLOCK_M_P, BLOCK_N_P, MODE_FUSED, DOT_F32, DOT_PREC,
        )  # fmt: skip
    else:
        _own_program(
            pid - n_prefix, kvh, q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr,
            cu_q_ptr, kv_len_ptr, bt_ptr, seq_group_ptr, prefix_len_ptr,
            S, Hq, N_SPLIT, SPLIT_LEN, qk_scale,
            stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp,
            stride_vh, stride_ot, stride_oh, stride_bt,
            GQA, GQA_PAD, D, D_PAD, PAGE, BLOCK_M_O, BLOCK_N_O, MODE_FUSED, True,
            DOT_F32, DOT_PREC,
        )  # fmt: skip


@triton.jit
def prefix_kernel(
    q_ptr, k_ptr, v_ptr, ws_o_ptr, ws_lse_ptr,
    prefix_len_ptr, prefix_bt_ptr, gq_start_ptr, gq_end_ptr, group_order_ptr,
    G, Hq, N_SPLIT, SPLIT_LEN, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_pbt, TUNE_KEY,
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Cascade step 1: the prefix part alone, partials to workspace slots 1..splits."""
    _prefix_program(
        tl.program_id(0), tl.program_id(1), q_ptr, k_ptr, v_ptr, ws_o_ptr, ws_o_ptr, ws_lse_ptr,
        ws_lse_ptr, prefix_len_ptr, prefix_bt_ptr, gq_start_ptr, gq_end_ptr, group_order_ptr,
        G, Hq, N_SPLIT, SPLIT_LEN, qk_scale, stride_qt, stride_qh, stride_kb, stride_kp,
        stride_kh, stride_vb, stride_vp, stride_vh, 0, 0, stride_pbt,
        GQA, GQA_PAD, D, D_PAD, PAGE, BLOCK_M, BLOCK_N, MODE_PARTIAL, DOT_F32, DOT_PREC,
    )  # fmt: skip


@triton.jit
def own_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_lse_ptr,
    cu_q_ptr, kv_len_ptr, bt_ptr, seq_group_ptr, prefix_len_ptr,
    S, Hq, N_SPLIT, SPLIT_LEN, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_ot, stride_oh, stride_bt, TUNE_KEY,
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_GROUPS: tl.constexpr, DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Cascade step 2 (grouped rows: partial to slot 0), or plain paged attention."""
    _own_program(
        tl.program_id(0), tl.program_id(1), q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_lse_ptr,
        ws_lse_ptr, cu_q_ptr, kv_len_ptr, bt_ptr, seq_group_ptr, prefix_len_ptr,
        S, Hq, N_SPLIT, SPLIT_LEN, qk_scale,
        stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
        stride_ot, stride_oh, stride_bt,
        GQA, GQA_PAD, D, D_PAD, PAGE, BLOCK_M, BLOCK_N, MODE_PARTIAL, HAS_GROUPS,
        DOT_F32, DOT_PREC,
    )  # fmt: skip


@triton.jit
def merge_kernel(
    out_ptr, ws_o_ptr, ws_lse_ptr, prefix_len_ptr, gq_start_ptr, gq_end_ptr, group_order_ptr,
    G, Hq, N_SPLIT, SPLIT_LEN, stride_ot, stride_oh,
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Cascade step 3: merge the own partial and the prefix pieces of every grouped row."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    TOK: tl.constexpr = BLOCK_M // GQA_PAD
    g, q_lo, q_hi, t0 = _locate_tile(tile, gq_start_ptr, gq_end_ptr, group_order_ptr, G, TOK, True)
    if (t0 >= q_lo) & (t0 < q_hi):
        tok, head, row_ok = _tile_rows(t0, q_hi, kvh, GQA, GQA_PAD, BLOCK_M)
        tok = tok.to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        o = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        lse = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        n_parts = 1 + _splits(tl.load(prefix_len_ptr + g), SPLIT_LEN)
        th = tok * Hq + head
        o, lse = _merge_slots(
            o, lse, ws_o_ptr, ws_lse_ptr, th, row_ok, -1, n_parts, N_SPLIT + 1, offs_d, D
        )
        out_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
        mask = row_ok[:, None] & (offs_d[None, :] < D)
        tl.store(out_ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)


# ---- autotuning (GPU only; the interpreter runs INTERPRET_CONFIG) --------------------------

_KEY = ["GQA", "D", "PAGE", "TUNE_KEY"]


def _fused_configs() -> list[triton.Config]:
    shapes = [  # (BLOCK_M_P, BLOCK_N_P, BLOCK_M_O, BLOCK_N_O, warps, stages)
        (128, 64, 16, 64, 8, 3),
        (128, 32, 16, 64, 8, 2),
        (128, 64, 32, 64, 8, 2),
        (128, 128, 16, 32, 8, 2),
        (64, 64, 16, 64, 4, 3),
        (64, 32, 16, 128, 4, 2),
        (64, 64, 32, 32, 4, 3),
        (64, 64, 16, 64, 4, 2),
    ]
    return [
        triton.Config(
            {"BLOCK_M_P": mp, "BLOCK_N_P": np_, "BLOCK_M_O": mo, "BLOCK_N_O": no},
            num_warps=w,
            num_stages=st,
        )
        for mp, np_, mo, no, w, st in shapes
    ]


def _part_configs(pairs: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
        for m, n, w, st in pairs
    ]


def _autotune(configs: list[triton.Config]):
    """triton.autotune on _KEY, its choices kept in Triton's cache folder where the installed
    Triton can (``cache_results``): a later process on the same GPU architecture skips
    benchmarking the configs (on an H100 every new shape benchmarked 8 + 5 + 5 of them)."""
    keep = "cache_results" in inspect.signature(triton.autotune).parameters
    return triton.autotune(configs=configs, key=_KEY, **({"cache_results": True} if keep else {}))


fused_kernel_tuned = _autotune(_fused_configs())(fused_kernel)
prefix_kernel_tuned = _autotune(
    _part_configs(
        [(128, 64, 8, 3), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3)]
    )
)(prefix_kernel)
own_kernel_tuned = _autotune(
    _part_configs([(16, 64, 4, 3), (16, 128, 4, 2), (16, 32, 2, 3), (32, 64, 4, 3), (64, 64, 4, 2)])
)(own_kernel)

# Small tiles under the interpreter: fast, and they exercise multi-tile and masking paths.
INTERPRET_FUSED = {"BLOCK_M_P": 16, "BLOCK_N_P": 16, "BLOCK_M_O": 16, "BLOCK_N_O": 16}
INTERPRET_PART = {"BLOCK_M": 16, "BLOCK_N": 16}
MERGE_BLOCK_M = 32
