"""Naive torch reference for prefix-shared paged attention, and random test batches.

The reference is deliberately slow and obvious: one sequence at a time, the full KV
(group prefix then own KV) materialised densely, fp32 scores with an explicit mask.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from .meta import AttentionMetadata, cdiv


def gather_paged(cache: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D] -> first n positions of a block list: [n, Hkv, D]."""
    bs = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    blocks = table_row.long()[pos // bs]
    return cache[blocks, pos % bs]


def naive_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, Hkv, D] into the caches at slot_mapping (int64 [T]); negative slots skipped."""
    bs = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache[slots // bs, slots % bs] = k[keep]
    v_cache[slots // bs, slots % bs] = v[keep]


def naive_prefix_shared_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D] in q's dtype. See AttentionMetadata for the semantics."""
    out = torch.zeros_like(q)
    gqa = q.shape[1] // k_cache.shape[2]
    cu_q, kv_len, seq_group = meta.cu_q.tolist(), meta.kv_len.tolist(), meta.seq_group.tolist()
    prefix_len = meta.prefix_len.tolist()
    for s in range(meta.num_seqs):
        a, b, n, g = cu_q[s], cu_q[s + 1], kv_len[s], seq_group[s]
        if a == b:
            continue
        p = prefix_len[g] if g >= 0 else 0
        parts_k = [gather_paged(k_cache, meta.block_table[s], n)]
        parts_v = [gather_paged(v_cache, meta.block_table[s], n)]
        if g >= 0:
            parts_k.insert(0, gather_paged(k_cache, meta.prefix_block_table[g], p))
            parts_v.insert(0, gather_paged(v_cache, meta.prefix_block_table[g], p))
        k = torch.cat(parts_k).float().repeat_interleave(gqa, dim=1)  # [P + N, Hq, D]
        v = torch.cat(parts_v).float().repeat_interleave(gqa, dim=1)
        qs = q[a:b].float()  # [L, Hq, D]
        q_pos = n - (b - a) + torch.arange(b - a, device=q.device)  # own-KV position of queries
        own_ok = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]  # [L, N]
        allowed = torch.cat([own_ok.new_ones(b - a, p), own_ok], dim=1)  # [L, P + N]
        scores = torch.einsum("lhd,nhd->hln", qs, k) * scale  # [Hq, L, P + N]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[a:b] = torch.einsum("hln,nhd->lhd", probs, v).to(q.dtype)
    return out


# ---- random valid batches -------------------------------------------------------------------


@dataclass(frozen=True)
class SeqSpec:
    q_len: int  # query tokens in this batch (>= 1)
    kv_len: int  # own KV length, this step's tokens included (>= q_len)
    group: int = -1  # index into BatchSpec.prefix_lens, -1 for none


@dataclass(frozen=True)
class BatchSpec:
    seqs: tuple[SeqSpec, ...]  # batch order; a group's members are contiguous
    prefix_lens: tuple[int, ...]  # per group
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class PagedBatch:
    spec: BatchSpec
    q: torch.Tensor  # [T, Hq, D]
    k_new: torch.Tensor  # [T, Hkv, D]: this step's K (already in k_cache at slot_mapping)
    v_new: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]; unused slots hold NaN
    v_cache: torch.Tensor
    meta: AttentionMetadata
    prefix_k: list[torch.Tensor]  # per group: dense [P, Hkv, D]
    prefix_v: list[torch.Tensor]
    own_k: list[torch.Tensor]  # per sequence: dense [kv_len, Hkv, D]
    own_v: list[torch.Tensor]
    scale: float


def _check_spec(spec: BatchSpec) -> None:
    seen: list[int] = []
    for sq in spec.seqs:
        assert 1 <= sq.q_len <= sq.kv_len, sq
        if sq.group >= 0 and (not seen or seen[-1] != sq.group):
            assert sq.group not in seen, f"group {sq.group} members are not contiguous"
            seen.append(sq.group)


def build_batch(spec: BatchSpec, seed: int = 0, device: str | torch.device = "cpu") -> PagedBatch:
    """Dense random K/V per group prefix and per sequence, scattered into shuffled blocks."""
    _check_spec(spec)
    gen = torch.Generator().manual_seed(seed)
    hkv, d, bs, dt = spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dt)

    prefix_k = [rand(p, hkv, d) for p in spec.prefix_lens]
    prefix_v = [rand(p, hkv, d) for p in spec.prefix_lens]
    own_k = [rand(sq.kv_len, hkv, d) for sq in spec.seqs]
    own_v = [rand(sq.kv_len, hkv, d) for sq in spec.seqs]
    lengths = list(spec.prefix_lens) + [sq.kv_len for sq in spec.seqs]
    n_blocks = [max(1, cdiv(n, bs)) for n in lengths]
    total = sum(n_blocks) + 3  # a few never-used blocks
    ids = torch.randperm(total, generator=gen).tolist()
    k_cache = torch.full((total, bs, hkv, d), float("nan")).to(dt)
    v_cache = k_cache.clone()
    tables, cursor = [], 0
    for n, nb, dk, dv in zip(lengths, n_blocks, prefix_k + own_k, prefix_v + own_v, strict=True):
        row = ids[cursor : cursor + nb]
        cursor += nb
        tables.append(row)
        pos = torch.arange(n)
        blk = torch.tensor(row, dtype=torch.long)[pos // bs]
        k_cache[blk, pos % bs], v_cache[blk, pos % bs] = dk, dv
    n_groups = len(spec.prefix_lens)
    spare = ids[-1]  # padding entries of the tables: any valid id

    def table(rows: list[list[int]]) -> torch.Tensor:
        width = max([len(r) for r in rows] + [1])
        padded = [r + [spare] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int32).reshape(len(rows), width)

    cu_q, slots = [0], []
    g_start, g_end = [0] * n_groups, [0] * n_groups
    for s, sq in enumerate(spec.seqs):
        if sq.group >= 0:
            if g_start[sq.group] == g_end[sq.group]:
                g_start[sq.group] = cu_q[-1]
            g_end[sq.group] = cu_q[-1] + sq.q_len
        for j in range(sq.kv_len - sq.q_len, sq.kv_len):
            slots.append(tables[n_groups + s][j // bs] * bs + j % bs)
        cu_q.append(cu_q[-1] + sq.q_len)
    t = cu_q[-1]
    new_idx = [
        (s, j) for s, sq in enumerate(spec.seqs) for j in range(sq.kv_len - sq.q_len, sq.kv_len)
    ]
    k_new = torch.stack([own_k[s][j] for s, j in new_idx]) if t else rand(0, hkv, d)
    v_new = torch.stack([own_v[s][j] for s, j in new_idx]) if t else rand(0, hkv, d)

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=device)

    meta = AttentionMetadata(
        cu_q=i32(cu_q),
        kv_len=i32([sq.kv_len for sq in spec.seqs]),
        block_table=table(tables[n_groups:]).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        seq_group=i32([sq.group for sq in spec.seqs]),
        prefix_len=i32(list(spec.prefix_lens)),
        prefix_block_table=table(tables[:n_groups]).to(device),
        group_q_start=i32(g_start),
        group_q_end=i32(g_end),
        max_q_len=max([sq.q_len for sq in spec.seqs] + [0]),
        max_kv_len=max([sq.kv_len for sq in spec.seqs] + [0]),
        max_prefix_len=max([*spec.prefix_lens, 0]),
    )
    q = rand(t, spec.num_q_heads, d)
    return PagedBatch(
        spec=spec,
        q=q.to(device),
        k_new=k_new.to(device),
        v_new=v_new.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        meta=meta,
        prefix_k=prefix_k,
        prefix_v=prefix_v,
        own_k=own_k,
        own_v=own_v,
        scale=1.0 / math.sqrt(d),
    )


def _random_seq(rng: random.Random, max_own: int, max_chunk: int, prefill_prob: float) -> SeqSpec:
    if rng.random() >= prefill_prob:
        return SeqSpec(q_len=1, kv_len=rng.randint(1, max_own))  # kv_len 1: empty distinct part
    q_len = rng.randint(1, max_chunk)
    return SeqSpec(q_len=q_len, kv_len=q_len + rng.randint(0, max_own))  # chunked prefill


def random_spec(
    seed: int,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    min_groups: int = 0,
    max_groups: int = 3,
    max_members: int = 4,
    max_ungrouped: int = 3,
    max_prefix: int = 70,
    max_own: int = 40,
    max_chunk: int = 20,
    prefill_prob: float = 0.5,
) -> BatchSpec:
    """A random mixture: groups (some of one member, prefixes ending mid-block), ungrouped
    sequences (prefix prefills look like these to attention), decodes and prefill chunks,
    in shuffled order, with group indices not in token order. ``prefill_prob``: chance that a
    sequence is a prefill chunk rather than a decode (0: decode-only batch)."""
    rng = random.Random(seed)
    n_groups = rng.randint(min_groups, max_groups)
    perm = list(range(n_groups))
    rng.shuffle(perm)
    units: list[list[SeqSpec]] = []
    for g in perm:
        members = rng.randint(1, max_members)
        units.append(
            [
                SeqSpec(
                    **{**_random_seq(rng, max_own, max_chunk, prefill_prob).__dict__, "group": g}
                )
                for _ in range(members)
            ]
        )
    for _ in range(rng.randint(0 if n_groups else 1, max_ungrouped)):
        units.append([_random_seq(rng, max_own, max_chunk, prefill_prob)])
    rng.shuffle(units)
    return BatchSpec(
        seqs=tuple(sq for unit in units for sq in unit),
        prefix_lens=tuple(rng.randint(1, max_prefix) for _ in range(n_groups)),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
