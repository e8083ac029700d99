"""Attention backends: the torch path (CPU, reference speed) and backend selection.

Every backend implements the contract of ``AttentionMetadata`` (read its docstring):
``write_kv`` stores this step's K/V in the paged cache, then ``attend`` computes, per query,
softmax attention over its group's shared prefix KV (all members of a group in one
matrix-matrix product) and over its own KV (causal), the two partial results merged by
log-sum-exp. Softmax statistics and accumulation are float32.

The torch path never loops per sequence: sequences are bucketed by (query length, KV length)
size classes, each bucket padded into one batched matmul; the prefix part loops over groups.
The index tensors (slots, masks) depend only on the metadata, so they are built once per
batch and reused by every layer.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from batchjob.engine.attention_meta import AttentionMetadata
from batchjob.errors import ConfigError


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [T, H, D], q's dtype


@dataclass(frozen=True)
class _OwnTile:
    """One padded batched matmul of the own-KV part: B sequences x Q query rows x K keys."""

    q_index: torch.Tensor  # int64 [B, Q]: token of each query row (padding repeats a real one)
    kv_rows: torch.Tensor  # int64 [B*Hkv*K]: row of cache.view(-1, D) per (seq, head, position)
    mask: torch.Tensor  # bool [B, Q, K]: key k visible to query row q (causal, < kv_len)
    rows: torch.Tensor | None  # int64 [N]: real rows in the flat [B*Q]; None when all are real
    dest: torch.Tensor  # int64 [N]: token index of each real row


@dataclass(frozen=True)
class _PrefixTile:
    """Queries [q_start, q_end) of one group against its prefix KV (no mask)."""

    q_start: int
    q_end: int
    kv_rows: torch.Tensor  # int64 [Hkv*P]: row of cache.view(-1, D) per (head, prefix token)


@dataclass(frozen=True)
class _Plan:
    own: list[_OwnTile]
    prefix: list[list[_PrefixTile]]  # per group: row tiles sharing one prefix gather


def _size_class(x: np.ndarray, floor: int, per_octave: int) -> np.ndarray:
    """Geometric size classes: padding to the class maximum wastes < 2**(1/per_octave)."""
    return np.ceil(per_octave * np.log2(np.maximum(x, floor))).astype(np.int64)


class TorchAttention:
    """Prefix-shared paged attention in plain torch (any device; the CPU engine's path).

    ``max_scores`` bounds the float32 score elements of one batched matmul (memory cap):
    larger buckets are split over sequences, then over query rows.
    """

    name = "torch"

    def __init__(self, max_scores: int = 1 << 24) -> None:
        self.max_scores = max_scores
        self._cache: tuple[AttentionMetadata, tuple[int, int, int], _Plan] | None = None

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        nb, bs, hkv, d = k_cache.shape
        k_cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attend(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        t, h, d = q.shape
        nb, bs, hkv, _ = k_cache.shape
        g = h // hkv
        plan = self._get_plan(meta, bs, h, hkv)
        qf = (q.float() * scale).view(t, hkv, g, d)  # [T, Hkv, G, D], pre-scaled
        # gathering (slot, head) rows lays K/V out as [.., Hkv, K, D] with no further copy
        k_rows = k_cache.view(nb * bs * hkv, d)
        v_rows = v_cache.view(nb * bs * hkv, d)
        out = torch.empty(t, hkv, g, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(t, hkv, g, dtype=torch.float32, device=q.device)
        for tile in plan.own:
            b, nq = tile.q_index.shape
            nk = tile.mask.shape[-1]
            qt = qf[tile.q_index].permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Q, D]
            kt = k_rows.index_select(0, tile.kv_rows).view(b, hkv, nk, d).float()  # [B,Hkv,K,D]
            vt = v_rows.index_select(0, tile.kv_rows).view(b, hkv, nk, d).float()  # [B,Hkv,K,D]
            o, l = _partial_attention(qt, kt, vt, tile.mask[:, None, None])
            o = o.permute(0, 3, 1, 2, 4).reshape(b * nq, hkv, g, d)  # [B*Q, Hkv, G, D]
            l = l.permute(0, 3, 1, 2).reshape(b * nq, hkv, g)  # [B*Q, Hkv, G]
            if tile.rows is not None:
                o, l = o[tile.rows], l[tile.rows]
            out.index_copy_(0, tile.dest, o)
            lse.index_copy_(0, tile.dest, l)
        for tiles in plan.prefix:
            rows = tiles[0].kv_rows
            kp = k_rows.index_select(0, rows).view(1, hkv, -1, d).float()  # [1, Hkv, P, D]
            vp = v_rows.index_select(0, rows).view(1, hkv, -1, d).float()  # [1, Hkv, P, D]
            for tile in tiles:
                s, e = tile.q_start, tile.q_end
                qg = qf[s:e].permute(1, 2, 0, 3)[None]  # [1, Hkv, G, Tg, D]
                o, l = _partial_attention(qg, kp, vp, None)
                o = o[0].permute(2, 0, 1, 3)  # [Tg, Hkv, G, D]
                l = l[0].permute(2, 0, 1)  # [Tg, Hkv, G]
                _merge_into(out[s:e], lse[s:e], o, l)
        return out.view(t, h, d).to(q.dtype)

    # ---- plan: index tensors that depend only on the metadata -----------------------------

    def _get_plan(self, meta: AttentionMetadata, bs: int, h: int, hkv: int) -> _Plan:
        c = self._cache
        if c is not None and c[0] is meta and c[1] == (bs, h, hkv):
            return c[2]
        plan = self._build_plan(meta, bs, h, hkv)
        self._cache = (meta, (bs, h, hkv), plan)
        return plan

    def _build_plan(self, meta: AttentionMetadata, bs: int, h: int, hkv: int) -> _Plan:
        dev = meta.kv_len.device
        cu_q = meta.cu_q.cpu().numpy().astype(np.int64)
        q_len = np.diff(cu_q)
        kv_len = meta.kv_len.cpu().numpy().astype(np.int64)
        real = np.nonzero(q_len > 0)[0]
        # bucket key: (query-length class, KV-length class); decodes (q_len 1) form their own
        q_cls = np.where(q_len <= 1, 0, 1 + _size_class(q_len, 1, 1))
        key = q_cls * 1024 + _size_class(kv_len, 16, 2)
        own: list[_OwnTile] = []
        for k in np.unique(key[real]):
            seqs = real[key[real] == k]
            nq, nk = int(q_len[seqs].max()), int(kv_len[seqs].max())
            per_seq = max(1, h * nq * nk)
            step = max(1, self.max_scores // per_seq)
            for i in range(0, len(seqs), step):
                chunk = seqs[i : i + step]
                q_step = nq if len(chunk) > 1 else max(1, self.max_scores // max(1, h * nk))
                for j0 in range(0, nq, q_step):
                    j1 = min(nq, j0 + q_step)
                    tile = self._own_tile(meta, chunk, j0, j1, cu_q, q_len, kv_len, bs, hkv)
                    own.append(tile)
        prefix: list[list[_PrefixTile]] = []
        p_len = meta.prefix_len.cpu().numpy().astype(np.int64)
        g_start = meta.group_q_start.cpu().numpy().astype(np.int64)
        g_end = meta.group_q_end.cpu().numpy().astype(np.int64)
        for gi in range(len(p_len)):
            p, s, e = int(p_len[gi]), int(g_start[gi]), int(g_end[gi])
            if p == 0 or e <= s:
                continue
            pos = torch.arange(p, device=dev)
            slots = meta.prefix_block_table[gi].long()[pos // bs] * bs + pos % bs  # [P]
            heads = torch.arange(hkv, device=dev)[:, None]  # [Hkv, 1]
            kv_rows = (slots[None, :] * hkv + heads).reshape(-1)  # [Hkv*P]
            step = max(1, self.max_scores // (h * p))
            prefix.append([_PrefixTile(r, min(e, r + step), kv_rows) for r in range(s, e, step)])
        return _Plan(own=own, prefix=prefix)

    @staticmethod
    def _own_tile(meta, seqs, j0, j1, cu_q, q_len, kv_len, bs, hkv) -> _OwnTile:
        dev = meta.kv_len.device
        ql, kl = q_len[seqs], kv_len[seqs]  # [B]
        n_keys = int((kl - ql + np.minimum(j1, ql)).max())  # keys the last row may see
        s_t = torch.from_numpy(seqs).to(dev)
        ql_t = torch.from_numpy(ql).to(dev)[:, None]  # [B, 1]
        kl_t = torch.from_numpy(kl).to(dev)[:, None]  # [B, 1]
        j = torch.arange(j0, j1, device=dev)[None, :]  # [1, Q]
        jc = torch.minimum(j, ql_t - 1)  # [B, Q]: padding rows repeat the last real row
        q_index = torch.from_numpy(cu_q[seqs]).to(dev)[:, None] + jc  # [B, Q]
        q_pos = kl_t - ql_t + jc  # [B, Q]: own-KV position of each query
        kpos = torch.arange(n_keys, device=dev)  # [K]
        mask = kpos[None, None, :] <= q_pos[:, :, None]  # [B, Q, K]
        kpos_c = torch.minimum(kpos[None, :], kl_t - 1)  # [B, K]: padding reads a real slot
        blocks = torch.gather(meta.block_table[s_t].long(), 1, kpos_c // bs)  # [B, K]
        slots = blocks * bs + kpos_c % bs  # [B, K]
        heads = torch.arange(hkv, device=dev)[None, :, None]  # [1, Hkv, 1]
        kv_rows = (slots[:, None, :] * hkv + heads).reshape(-1)  # [B*Hkv*K]
        real = (j < ql_t).reshape(-1)  # [B*Q]
        if bool(real.all()):
            return _OwnTile(q_index, kv_rows, mask, None, q_index.reshape(-1))
        rows = torch.nonzero(real).squeeze(1)
        return _OwnTile(q_index, kv_rows, mask, rows, q_index.reshape(-1)[rows])


_NO_KEYS = -1e30  # stand-in max for rows that see no key: exp(-inf - _NO_KEYS) = 0


def _partial_attention(
    q: torch.Tensor,  # [B, Hkv, G, Q, D] float32, pre-scaled
    k: torch.Tensor,  # [B, Hkv, K, D] float32
    v: torch.Tensor,  # [B, Hkv, K, D] float32
    mask: torch.Tensor | None,  # bool, broadcastable to [B, Hkv, G, Q, K]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over k/v: out [B, Hkv, G, Q, D], lse [B, Hkv, G, Q].

    Rows with no visible key get out 0 and lse -inf (they weigh nothing when merged).
    """
    b, hkv, g, nq, d = q.shape
    nk = k.shape[2]
    s = torch.matmul(q.reshape(b, hkv, g * nq, d), k.transpose(-1, -2))  # [B, Hkv, G*Q, K]
    s = s.view(b, hkv, g, nq, nk)
    if mask is not None:
        s.masked_fill_(~mask, -math.inf)
    m = s.amax(dim=-1, keepdim=True).clamp_min(_NO_KEYS)  # [B, Hkv, G, Q, 1], finite
    s.sub_(m).exp_()
    denom = s.sum(dim=-1, keepdim=True)  # [B, Hkv, G, Q, 1]
    o = torch.matmul(s.view(b, hkv, g * nq, nk), v).view(b, hkv, g, nq, d)
    o.div_(denom.clamp_min(torch.finfo(torch.float32).tiny))
    return o, (m + denom.log()).squeeze(-1)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Merge partial (o, l) into (out, lse) in place: out [N, ..., D], lse [N, ...]."""
    m = torch.maximum(lse, l).clamp_min(_NO_KEYS)  # finite
    w_a, w_b = torch.exp(lse - m), torch.exp(l - m)
    total = w_a + w_b
    out.mul_((w_a / total)[..., None]).add_(o * (w_b / total)[..., None])
    lse.copy_(m + total.log())


def _triton_backend() -> AttentionBackend:
    try:
        from batchjob import kernels
    except ImportError as e:
        raise ConfigError(f"attention backend 'triton' is unavailable: {e}") from e
    cls = getattr(kernels, "TritonAttention", None)
    if cls is None:
        raise ConfigError("attention backend 'triton': batchjob.kernels has no TritonAttention")
    return cls()


def get_attention_backend(
    name: str = "auto", device: str | torch.device = "cpu"
) -> AttentionBackend:
    """``torch``; ``triton`` (``batchjob.kernels.TritonAttention``, CUDA, or CPU under
    ``TRITON_INTERPRET=1``); ``auto``: triton on CUDA when it imports, torch otherwise."""
    dev = torch.device(device)
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                f"attention backend 'triton' needs a CUDA device (got {dev}); "
                "use 'torch' or 'auto' on CPU"
            )
        return _triton_backend()
    if name == "auto":
        if dev.type == "cuda":
            try:
                return _triton_backend()
            except ConfigError:
                pass
        return TorchAttention()
    raise ConfigError(f"unknown attention backend {name!r} (use auto, torch or triton)")
