"""@triton.jit code for prefix-shared paged attention (host wrappers live in wrappers.py).

Conventions shared by every kernel here (docs/kernels.md has the full story):

* A tile is TOK query tokens x GQA_PAD query heads of one kv head, flattened to
  BLOCK_M = TOK * GQA_PAD rows: row r is token ``r // GQA_PAD`` of the tile and query head
  ``kvh * GQA + r % GQA_PAD`` (GQA packing: heads sharing a kv head share each K/V tile).
* Scores are kept in log2 units: ``qk_scale = scale * log2(e)``, ``exp2`` everywhere, and the
  partial log-sum-exp (lse) is stored in log2 units too.
* Tiles of ragged units (sequences, or groups) are numbered ``start // TOK + unit`` where
  ``start`` is the unit's first query token: monotone in the unit, at least
  ``cdiv(len, TOK)`` ids per unit, at most ``T // TOK + n_units`` ids in all, so a program
  finds its unit by binary search and the grid size needs no device-to-host sync.
* Split prefix: a group's prefix is cut into ``splits(g) = max(1, cdiv(prefix_len, SPLIT_LEN))``
  pieces, each its own program, so a few long prefixes still fill the GPU (N_SPLIT: the most
  pieces any group has). A grouped query row thus has ``1 + splits(g)`` partial results.
* Workspace: ``ws_o`` fp32 [T, Hq, N_SPLIT + 1, D] and ``ws_lse`` fp32 [T, Hq, N_SPLIT + 1]
  hold partial results (slot 0: own part, slot 1 + j: prefix piece j). ``counters`` int32
  [T, Hq] count the finished partials of each (token, head) in the fused kernel; the program
  that finishes last merges them all and resets the counter to 0, so counters are all zero
  between launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Was this module's @triton.jit code built for the interpreter? (checked before launches)
INTERPRETED = triton.knobs.runtime.interpret

# How a part finishes its rows.
MODE_STORE = tl.constexpr(0)  # final output: write o to out
MODE_PARTIAL = tl.constexpr(1)  # write (o, lse) to its workspace slot; a later launch merges
MODE_FUSED = tl.constexpr(2)  # write the partial, count it; the last finisher merges all


@triton.jit
def _find_unit(tile, starts_ptr, order_ptr, n_units, TOK: tl.constexpr, ORDERED: tl.constexpr):
    """Largest unit i whose first tile id ``start(i) // TOK + i`` is <= tile (0 if none).

    start(i) = starts[order[i]] when ORDERED, else starts[i].
    """
    lo = 0
    hi = n_units
    while hi - lo > 1:
        mid = (lo + hi) // 2
        unit = mid
        if ORDERED:
            unit = tl.load(order_ptr + mid)
        if tl.load(starts_ptr + unit) // TOK + mid <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _locate_tile(
    tile, starts_ptr, ends_ptr, order_ptr, n_units, TOK: tl.constexpr, ORDERED: tl.constexpr
):
    """A tile's unit and query tokens: (unit, q_lo, q_hi, t0), the unit's queries [q_lo, q_hi)
    and the tile's first token t0; the tile has no rows unless q_lo <= t0 < q_hi."""
    i = _find_unit(tile, starts_ptr, order_ptr, n_units, TOK, ORDERED)
    unit = i
    if ORDERED:
        unit = tl.load(order_ptr + i)
    q_lo = tl.load(starts_ptr + unit)
    q_hi = tl.load(ends_ptr + unit)
    return unit, q_lo, q_hi, q_lo + (tile - (q_lo // TOK + i)) * TOK


@triton.jit
def _tile_rows(t0, q_hi, kvh, GQA: tl.constexpr, GQA_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """int32 [BLOCK_M] each: global query token and query head of each row, and real rows."""
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GQA_PAD
    head = kvh * GQA + rows % GQA_PAD
    return tok, head, (tok < q_hi) & (rows % GQA_PAD < GQA)


@triton.jit
def _start_tile(
    q_ptr, t0, q_hi, kvh, stride_qt, stride_qh,
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """A tile's rows, its q [BLOCK_M, D_PAD] in the dot input dtype and an empty online
    softmax: (tok, head, row_ok, q, acc, m_i, l_i)."""
    tok, head, row_ok = _tile_rows(t0, q_hi, kvh, GQA, GQA_PAD, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    ptrs = q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(ptrs + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if DOT_F32:  # interpreter workaround: its tl.dot mishandles bf16 operands
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return tok, head, row_ok, q, acc, m_i, l_i


@triton.jit
def _attend(
    q,  # [BLOCK_M, D_PAD], already in the dot input dtype
    acc,  # fp32 [BLOCK_M, D_PAD]: running sum of p @ v
    m_i,  # fp32 [BLOCK_M]: running max (log2 units)
    l_i,  # fp32 [BLOCK_M]: running sum of p
    q_pos,  # int32 [BLOCK_M]: own-KV position of each row (used when CAUSAL)
    k_ptr,
    v_ptr,
    table_ptr,  # this unit's row of a block table
    kvh,
    n_lo,
    n_hi,  # keys [n_lo, n_hi) are visited; positions >= n_hi are masked
    qk_scale,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_vb,
    stride_vp,
    stride_vh,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online-softmax accumulation of q against paged keys [n_lo, n_hi) of one kv head."""
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_hi
        blk = tl.load(table_ptr + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % PAGE
        k_off = blk * stride_kb + slot * stride_kp + kvh * stride_kh  # [BLOCK_N]
        v_off = blk * stride_vb + slot * stride_vp + kvh * stride_vh
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:  # interpreter workaround: its tl.dot mishandles bf16 operands
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _merge_two(o_a, lse_a, o_b, lse_b):
    """Log-sum-exp merge of two normalised partials (lse in log2 units; either may be -inf)."""
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp2(lse_a - m)
    w_b = tl.exp2(lse_b - m)
    w = w_a + w_b
    w_use = tl.where(w == 0.0, 1.0, w)
    o = (o_a * w_a[:, None] + o_b * w_b[:, None]) / w_use[:, None]
    return o, tl.where(w == 0.0, float("-inf"), m + tl.log2(w_use))


@triton.jit
def _merge_slots(
    o, lse, ws_o_ptr, ws_lse_ptr, th, rows, skip, n_parts, NSLOT, offs_d, D: tl.constexpr
):
    """Merge workspace slots [0, n_parts) but ``skip`` of rows ``th`` (mask ``rows``) into o."""
    d_ok = offs_d[None, :] < D
    for slot in range(0, n_parts):
        if slot != skip:
            idx = th * NSLOT + slot
            o_b = tl.load(
                ws_o_ptr + idx[:, None] * D + offs_d[None, :], mask=rows[:, None] & d_ok, other=0.0
            )
            lse_b = tl.load(ws_lse_ptr + idx, mask=rows, other=float("-inf"))
            o, lse = _merge_two(o, lse, o_b, lse_b)
    return o, lse


@triton.jit
def _finish(
    acc, m_i, l_i,
    tok,  # int32 [BLOCK_M]: global query token of each row
    head,  # int32 [BLOCK_M]: query head of each row
    row_ok,  # [BLOCK_M]: real rows (not padding)
    out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr, Hq, NSLOT, stride_ot, stride_oh,
    slot,  # this part's workspace slot
    n_parts,  # partial results of each of these rows (1 + splits of the group)
    MODE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """Normalise a part's rows and finish them as MODE says."""
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d[None, :] < D
    l_use = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_use[:, None]  # [BLOCK_M, D_PAD]
    tok64 = tok.to(tl.int64)
    out_ptrs = out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if MODE == MODE_STORE:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_use))
        th = tok64 * Hq + head  # [BLOCK_M]: (token, head) index
        mine = th * NSLOT + slot
        tl.store(ws_o_ptr + mine[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None] & d_ok)
        tl.store(ws_lse_ptr + mine, lse, mask=row_ok)
        if MODE == MODE_FUSED:
            # Publish the partial (barrier: every thread's stores precede the release), count
            # it, and if it was the last one merge all partials of the row.
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + th, 1, mask=row_ok, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            last = row_ok & (done == n_parts - 1)
            if tl.max(last.to(tl.int32), 0) > 0:
                o, lse = _merge_slots(
                    o, lse, ws_o_ptr, ws_lse_ptr, th, last, slot, n_parts, NSLOT, offs_d, D
                )
                tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=last[:, None] & d_ok)
                tl.store(cnt_ptr + th, 0, mask=last)  # all partials are in: re-arm


@triton.jit
def _splits(prefix_len, SPLIT_LEN):
    """Prefix pieces of a group (at least one, so an empty prefix still reports)."""
    return tl.maximum((prefix_len + SPLIT_LEN - 1) // SPLIT_LEN, 1)


@triton.jit
def _prefix_program(
    pid, kvh, q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr,
    prefix_len_ptr, prefix_bt_ptr, gq_start_ptr, gq_end_ptr, group_order_ptr,
    G, Hq, N_SPLIT, SPLIT_LEN, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_ot, stride_oh, stride_pbt,
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Prefix part: TOK of a group's queries x one piece of the group's prefix (no mask)."""
    TOK: tl.constexpr = BLOCK_M // GQA_PAD
    tile = pid // N_SPLIT
    piece = pid % N_SPLIT
    g, q_lo, q_hi, t0 = _locate_tile(tile, gq_start_ptr, gq_end_ptr, group_order_ptr, G, TOK, True)
    n_prefix = tl.load(prefix_len_ptr + g)
    splits = _splits(n_prefix, SPLIT_LEN)
    if (t0 >= q_lo) & (t0 < q_hi) & (piece < splits):
        tok, head, row_ok, q, acc, m_i, l_i = _start_tile(
            q_ptr, t0, q_hi, kvh, stride_qt, stride_qh, GQA, GQA_PAD, D, D_PAD, BLOCK_M, DOT_F32
        )
        n_lo = piece * SPLIT_LEN
        n_hi = tl.minimum(n_prefix, n_lo + SPLIT_LEN)
        acc, m_i, l_i = _attend(
            q, acc, m_i, l_i, tok, k_ptr, v_ptr, prefix_bt_ptr + g.to(tl.int64) * stride_pbt,
            kvh, n_lo, n_hi, qk_scale, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp,
            stride_vh, D, D_PAD, PAGE, BLOCK_N, False, DOT_F32, DOT_PREC,
        )  # fmt: skip
        _finish(
            acc, m_i, l_i, tok, head, row_ok, out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr, Hq,
            N_SPLIT + 1, stride_ot, stride_oh, 1 + piece, 1 + splits, MODE, D, D_PAD,
        )  # fmt: skip


@triton.jit
def _own_program(
    tile, kvh, q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr,
    cu_q_ptr, kv_len_ptr, bt_ptr, seq_group_ptr, prefix_len_ptr,
    S, Hq, N_SPLIT, SPLIT_LEN, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUPED_MODE: tl.constexpr, HAS_GROUPS: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Own part: TOK queries of one sequence x its own paged KV, causal."""
    TOK: tl.constexpr = BLOCK_M // GQA_PAD
    s, q_lo, q_hi, t0 = _locate_tile(tile, cu_q_ptr, cu_q_ptr + 1, cu_q_ptr, S, TOK, False)
    if (t0 >= q_lo) & (t0 < q_hi):
        kv_len = tl.load(kv_len_ptr + s)
        pos0 = kv_len - (q_hi - q_lo)  # own-KV position of the sequence's first query
        tok, head, row_ok, q, acc, m_i, l_i = _start_tile(
            q_ptr, t0, q_hi, kvh, stride_qt, stride_qh, GQA, GQA_PAD, D, D_PAD, BLOCK_M, DOT_F32
        )
        q_pos = pos0 + tok - q_lo
        table = bt_ptr + s.to(tl.int64) * stride_bt
        # Keys every row of the tile may see need no causal mask; the rest (the diagonal
        # band, up to the tile's last query) do.
        first = pos0 + t0 - q_lo
        last = pos0 + tl.minimum(t0 + TOK, q_hi) - 1 - q_lo
        n_full = (first + 1) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend(
            q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, table, kvh, 0, n_full, qk_scale,
            stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
            D, D_PAD, PAGE, BLOCK_N, False, DOT_F32, DOT_PREC,
        )  # fmt: skip
        acc, m_i, l_i = _attend(
            q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, table, kvh, n_full, last + 1, qk_scale,
            stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
            D, D_PAD, PAGE, BLOCK_N, True, DOT_F32, DOT_PREC,
        )  # fmt: skip
        g = -1
        if HAS_GROUPS:
            g = tl.load(seq_group_ptr + s)
        if g >= 0:
            n_parts = 1 + _splits(tl.load(prefix_len_ptr + g), SPLIT_LEN)
            _finish(
                acc, m_i, l_i, tok, head, row_ok, out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr, Hq,
                N_SPLIT + 1, stride_ot, stride_oh, 0, n_parts, GROUPED_MODE, D, D_PAD,
            )  # fmt: skip
        else:
            _finish(
                acc, m_i, l_i, tok, head, row_ok, out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr, Hq,
                N_SPLIT + 1, stride_ot, stride_oh, 0, 1, MODE_STORE, D, D_PAD,
            )  # fmt: skip
