"""Attention backends: the torch path (CPU, reference speed) and backend selection.

Every backend implements the contract of ``AttentionMetadata`` (read its docstring):
``write_kv`` stores this step's K/V in the paged cache, then ``attend`` computes, per query,
softmax attention over its group's shared prefix KV (all members of a group in one
matrix-matrix product) and over its own KV (causal), the two partial results merged by
log-sum-exp. Softmax statistics and accumulation are float32.

The torch path runs torch's fused CPU flash attention per group prefix, per prefill sequence
and per batch of decodes (see ``TorchAttention``). The index tensors (blocks, masks) depend
only on the metadata, so they are built once per batch and reused by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.backends.native.attention.base import (
    BatchMemo,
    into,
    token_positions,
    window_applies,
)
from batchjob.backends.native.attention.meta import AttentionMetadata
from batchjob.plan.intmath import cdiv


@dataclass(frozen=True)
class _Decodes:
    """Own part of B sequences with q_len == 1: keys [off, off + B*K) of the segment."""

    tokens: torch.Tensor  # int64 [B]: query token of each sequence
    off: int
    keys: int  # K: keys per sequence (its blocks, padded to the tile's widest)
    mask: torch.Tensor | None  # float32 [B, 1, 1, K]: 0, or -inf past kv_len


@dataclass(frozen=True)
class _Prefill:
    """Own part of one sequence with q_len > 1: keys [off, off + kv_len) of the segment."""

    tok: int  # first query token
    q_len: int
    off: int
    kv_len: int
    mask: torch.Tensor | None  # float32 [1, 1, q_len, kv_len] causal; None: top-left is_causal


@dataclass(frozen=True)
class _Prefix:
    """Query tokens [q_start, q_end) of one group against its prefix: keys [off, off + p)."""

    q_start: int
    q_end: int
    off: int
    p: int
    mask: torch.Tensor | None = None  # float32 [1, 1, n, p]: a sliding window's, else None
    blind: torch.Tensor | None = None  # bool [n, 1, 1]: queries the window hides it all from


@dataclass
class _Segment:
    """Work whose KV is gathered by one index_select of whole blocks per layer."""

    blocks: list[np.ndarray]  # int64 block ids, in gather order
    pad: list[np.ndarray]  # int64 key rows (past a decode's kv_len) to zero: may hold NaN
    decodes: list[_Decodes]
    prefills: list[_Prefill]
    prefix: list[_Prefix]
    n_blocks: int = 0
    blocks_t: torch.Tensor | None = None  # int64 [n_blocks], set once built
    pad_t: torch.Tensor | None = None  # int64 [N]


def _size_class(x: np.ndarray, floor: int, per_octave: int) -> np.ndarray:
    """Geometric size classes: padding to the class maximum wastes < 2**(1/per_octave)."""
    return np.ceil(per_octave * np.log2(np.maximum(x, floor))).astype(np.int64)


class TorchAttention:
    """Prefix-shared paged attention in plain torch (any device; the CPU engine's path).

    On CPU each part is one call of torch's fused flash attention, which also returns the
    log-sum-exp (no score matrix is materialised, causal tiles above the diagonal are
    skipped); elsewhere a dense matmul softmax with the same shapes. Per batch: one call per
    group for its prefix (all members' queries x the prefix KV), one per prefill sequence,
    decodes batched by KV size class; the prefix partials are merged once. The KV of all of
    them is gathered by whole blocks in a few segments (one index_select each), so a layer
    runs few, large ops: this matters on a loaded machine, where every parallel op waits.
    Query heads sharing a KV head go on the batch dim with K/V broadcast (stride 0), no copy.

    ``max_gather`` bounds the elements of one segment's gathered K (keys * Hkv * D), so it
    stays in cache. ``max_scores`` bounds the score elements (B*H*Q*K) of one decode or
    prefix call (a memory cap for the dense path): larger ones are split.
    """

    name = "torch"

    def __init__(self, max_scores: int = 1 << 24, max_gather: int = 1 << 23) -> None:
        self.max_scores = max_scores
        self.max_gather = max_gather
        self._plans = BatchMemo()

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        nb, bs, hkv, d = k_cache.shape
        k_cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attend(self, q, k_cache, v_cache, meta, scale, out=None, window=None) -> torch.Tensor:
        t, h, d = q.shape
        _, bs, hkv, _ = k_cache.shape  # [num_blocks, bs, Hkv, D]
        r = h // hkv
        row = hkv * d
        w = window if window_applies(meta, window) else None
        plan = self._plans.get(
            meta, (bs, h, row, w), lambda: self._segment_plan(meta, bs, h, row, w)
        )
        qf = q.float().view(t, hkv, r, d)  # [T, Hkv, R, D]: head = kv_head * R + i
        acc = torch.empty(t, hkv, r, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(t, hkv, r, dtype=torch.float32, device=q.device)
        p_out = p_lse = None
        if any(seg.prefix for seg in plan):
            p_out = torch.zeros_like(acc)  # prefix partials, merged once at the end
            p_lse = torch.full_like(lse, -math.inf)  # tokens of no group weigh nothing
        for seg in plan:
            kg = k_cache.index_select(0, seg.blocks_t).flatten(0, 1)  # [N, Hkv, D]
            vg = v_cache.index_select(0, seg.blocks_t).flatten(0, 1)
            if seg.pad_t is not None:  # masked keys, but stale slots may hold NaN
                kg.index_fill_(0, seg.pad_t, 0.0)
                vg.index_fill_(0, seg.pad_t, 0.0)
            kg, vg = kg.float(), vg.float()
            for dc in seg.decodes:
                b, n = dc.tokens.shape[0], dc.off + dc.tokens.shape[0] * dc.keys
                qd = qf.index_select(0, dc.tokens)  # [B, Hkv, R, D]: the R heads as rows
                kd = kg[dc.off : n].view(b, dc.keys, hkv, d).transpose(1, 2)  # [B, Hkv, K, D]
                vd = vg[dc.off : n].view(b, dc.keys, hkv, d).transpose(1, 2)
                o, l = _attention(qd, kd, vd, dc.mask, False, scale)
                acc.index_copy_(0, dc.tokens, o)  # o: [B, Hkv, R, D]
                lse.index_copy_(0, dc.tokens, l)  # l: [B, Hkv, R]
            for pf in seg.prefills:
                s, e, n = pf.tok, pf.tok + pf.q_len, pf.off + pf.kv_len
                ks, vs = kg[pf.off : n], vg[pf.off : n]  # [kv_len, Hkv, D]
                acc[s:e], lse[s:e] = _heads_attention(
                    qf[s:e], ks, vs, pf.mask, pf.mask is None, scale
                )
            for px in seg.prefix:
                assert p_out is not None and p_lse is not None  # made when any seg.prefix
                s, e, n = px.q_start, px.q_end, px.off + px.p
                kp, vp = kg[px.off : n], vg[px.off : n]  # [P, Hkv, D]
                p_out[s:e], p_lse[s:e] = _heads_attention(qf[s:e], kp, vp, px.mask, False, scale)
                if px.blind is not None:  # no prefix key in their window: they weigh nothing
                    p_out[s:e].masked_fill_(px.blind[..., None], 0.0)
                    p_lse[s:e].masked_fill_(px.blind, -math.inf)
        if p_out is not None and p_lse is not None:
            _merge_into(acc, lse, p_out, p_lse)
        return into(out, acc.view(t, h, d).to(q.dtype))

    # ---- plan: index tensors that depend only on the metadata -----------------------------

    def _segment_plan(
        self, meta: AttentionMetadata, bs: int, h: int, row: int, window: int | None = None
    ) -> list[_Segment]:
        """``row``: elements of one token's K (Hkv * D); ``window``: a sliding window that
        hides keys in this batch (``window_applies``), else None."""
        dev = meta.kv_len.device
        cu_q = meta.cu_q.cpu().numpy().astype(np.int64)
        q_len = np.diff(cu_q)
        kv_len = meta.kv_len.cpu().numpy().astype(np.int64)
        table = meta.block_table.cpu().numpy().astype(np.int64)  # [S, max_blocks]
        seg_blocks = max(1, self.max_gather // (row * bs))
        segs: list[_Segment] = []

        def place(n_blocks: int) -> tuple[_Segment, int]:  # segment and key offset for n_blocks
            if not segs or (segs[-1].n_blocks and segs[-1].n_blocks + n_blocks > seg_blocks):
                segs.append(_Segment([], [], [], [], []))
            seg = segs[-1]
            off = seg.n_blocks * bs
            seg.n_blocks += n_blocks
            return seg, off

        dec = np.nonzero(q_len == 1)[0]
        cls = _size_class(kv_len[dec], 16, 2)
        for c in np.unique(cls):
            seqs = dec[cls == c]
            nk = cdiv(int(kv_len[seqs].max()), bs) * bs  # keys per seq: whole blocks
            step = max(1, min(self.max_scores // (h * nk), self.max_gather // (row * nk)))
            for i in range(0, len(seqs), step):
                self._decodes(seqs[i : i + step], cu_q, kv_len, table, bs, dev, place, window)
        for i in np.nonzero(q_len > 1)[0]:
            ql, kl = int(q_len[i]), int(kv_len[i])
            nblk = cdiv(kl, bs)
            seg, off = place(nblk)
            seg.blocks.append(table[i, :nblk])
            mask = None
            w = window if window is not None and kl > window else None
            if kl > ql or w is not None:  # bottom-right causal: j sees positions <= kl - ql + j
                last = (kl - ql + np.arange(ql))[:, None]  # [q_len, 1]
                vis = np.arange(kl)[None, :] <= last
                if w is not None:  # and, in a window, those above last - W
                    vis &= np.arange(kl)[None, :] > last - w
                m = np.where(vis, 0.0, -np.inf).astype(np.float32)[None, None]
                mask = torch.from_numpy(m).to(dev)  # [1, 1, q_len, kv_len]
            seg.prefills.append(_Prefill(int(cu_q[i]), ql, off, kl, mask))
        p_len = meta.prefix_len.cpu().numpy().astype(np.int64)
        p_table = meta.prefix_block_table.cpu().numpy().astype(np.int64)
        g_start = meta.group_q_start.cpu().numpy().astype(np.int64)
        g_end = meta.group_q_end.cpu().numpy().astype(np.int64)
        # a window's first visible position of each query token (prefix keys are positions 0..)
        first_seen = None if window is None else token_positions(meta) - window + 1
        for gi in range(len(p_len)):
            p, s, e = int(p_len[gi]), int(g_start[gi]), int(g_end[gi])
            if p == 0 or e <= s:
                continue
            nblk = cdiv(p, bs)
            seg, off = place(nblk)
            seg.blocks.append(p_table[gi, :nblk])
            step = max(1, self.max_scores // (h * p))
            for r0 in range(s, e, step):
                r1 = min(e, r0 + step)
                mask = blind = None
                if first_seen is not None and first_seen[r0:r1].max() > 0:
                    lo = first_seen[r0:r1, None]  # [n, 1]
                    m = np.where(np.arange(p)[None, :] >= lo, 0.0, -np.inf).astype(np.float32)
                    mask = torch.from_numpy(m[None, None]).to(dev)  # [1, 1, n, p]
                    blind = torch.from_numpy(lo[:, :, None] >= p).to(dev)  # [n, 1, 1]
                seg.prefix.append(_Prefix(r0, r1, off, p, mask, blind))
        for seg in segs:
            seg.blocks_t = torch.from_numpy(np.concatenate(seg.blocks)).to(dev)
            if seg.pad:
                seg.pad_t = torch.from_numpy(np.concatenate(seg.pad)).to(dev)
        return segs

    @staticmethod
    def _decodes(seqs, cu_q, kv_len, table, bs, dev, place, window=None) -> None:
        kl = kv_len[seqs][:, None]  # [B, 1]
        used = cdiv(kl, bs)  # [B, 1]: blocks holding each seq's KV
        nblk = int(used.max())
        j = np.arange(nblk)[None, :]  # [1, nblk]
        blocks = np.where(j < used, table[seqs, :nblk], table[seqs, :1])  # [B, nblk]
        seg, off = place(blocks.size)
        seg.blocks.append(blocks.reshape(-1))
        past = np.arange(nblk * bs)[None, :] >= kl  # [B, K]: keys past kv_len
        hidden = past
        if window is not None:  # and keys before the window (the query is at kl - 1)
            hidden = past | (np.arange(nblk * bs)[None, :] < kl - window)
        mask = None
        if bool(past.any()):
            seg.pad.append(off + np.flatnonzero(past))
        if bool(hidden.any()):
            m = np.where(hidden, -np.inf, 0.0).astype(np.float32)[:, None, None, :]  # [B,1,1,K]
            mask = torch.from_numpy(m).to(dev)
        tokens = torch.from_numpy(cu_q[seqs]).to(dev)
        seg.decodes.append(_Decodes(tokens, off, nblk * bs, mask))


def _heads_attention(
    q: torch.Tensor,  # [N, Hkv, R, D] float32
    k: torch.Tensor,  # [K, Hkv, D] float32
    v: torch.Tensor,  # [K, Hkv, D] float32
    mask: torch.Tensor | None,  # float32 additive, broadcastable to [1, 1, N, K]
    causal: bool,  # top-left aligned
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All N queries over one KV sequence: out [N, Hkv, R, D], lse [N, Hkv, R] (views).

    The R query heads of a KV head ride the batch dim; K/V are broadcast over it.
    """
    r = q.shape[2]
    qb = q.permute(2, 1, 0, 3)  # [R, Hkv, N, D]
    kb = k.transpose(0, 1)[None].expand(r, -1, -1, -1)  # [R, Hkv, K, D], stride 0
    vb = v.transpose(0, 1)[None].expand(r, -1, -1, -1)
    o, l = _attention(qb, kb, vb, mask, causal, scale)
    return o.permute(2, 1, 0, 3), l.permute(2, 1, 0)


def _attention(
    q: torch.Tensor,  # [B, H, Q, D] float32
    k: torch.Tensor,  # [B, H, K, D] float32
    v: torch.Tensor,  # [B, H, K, D] float32
    mask: torch.Tensor | None,  # float32 additive, broadcastable to [B, H, Q, K]
    causal: bool,  # key j visible to query i iff j <= i (top-left aligned)
    scale: float,
    fused: bool | None = None,  # torch's CPU flash kernel; default: on CPU tensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with its log-sum-exp: out [B, H, Q, D], lse [B, H, Q].

    Every query row must see at least one key.
    """
    if fused is None:
        fused = q.device.type == "cpu"
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=0.0, is_causal=causal, attn_mask=mask, scale=scale
        )
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Q, K]
    if mask is not None:
        s = s + mask
    if causal:
        nq, nk = s.shape[-2:]
        s.masked_fill_(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [B, H, Q]
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def _merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Merge partial (o, l) into (out, lse) in place: out [N, ..., D], lse [N, ...].

    ``lse`` must be finite (the own part always sees a key); ``l`` may be -inf."""
    new = torch.logaddexp(lse, l)
    out.mul_((lse - new).exp_()[..., None]).add_(o * (l - new).exp_()[..., None])
    lse.copy_(new)
