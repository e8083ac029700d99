"""The one naive attention reference of the tests, and the batches it runs on.

Two references, deliberately slow and obvious, one sequence at a time:
* ``naive_prefix_shared_attention`` reads the paged cache through the metadata (group prefix
  then own KV gathered densely, fp32 scores with an explicit mask);
* ``dense_reference`` never touches the cache: torch SDPA in float64 over the dense K/V the
  batch was built from, so it also checks what was written to the cache and how.
Batches: ``BatchSpec`` (random ones from ``random_spec``, or hand-written, block ids drawn or
given) -> ``build_batch`` (random K/V in a NaN-filled paged cache + metadata), or
``build_metadata`` alone when a test brings its own cache (the model tests).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

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
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D] in q's dtype. See AttentionMetadata for the semantics;
    ``window``: a query sees only the keys of its last W positions, itself included."""
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
        if window is not None:  # absolute positions: prefix keys 0..P-1, then own ones
            key_abs = torch.arange(p + n, device=q.device)[None, :]
            allowed &= key_abs > (p + q_pos)[:, None] - window
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
    blocks: tuple[int, ...] | None = None  # own KV block ids; None: build_batch draws them


@dataclass(frozen=True)
class BatchSpec:
    seqs: tuple[SeqSpec, ...]  # batch order; a group's members are contiguous
    prefix_lens: tuple[int, ...]  # per group
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    prefix_blocks: tuple[tuple[int, ...], ...] | None = None  # per group; None: drawn

    @property
    def explicit_blocks(self) -> bool:
        given = [sq.blocks is not None for sq in self.seqs] + [self.prefix_blocks is not None]
        assert all(given) or not any(given), "give block ids for every sequence and group or none"
        return all(given)


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
    if spec.explicit_blocks:
        bs = spec.block_size
        assert spec.prefix_blocks is not None and len(spec.prefix_blocks) == len(spec.prefix_lens)
        for sq in spec.seqs:
            assert sq.blocks is not None and len(sq.blocks) * bs >= sq.kv_len, sq
        for p, row in zip(spec.prefix_lens, spec.prefix_blocks, strict=True):
            assert len(row) * bs >= p, (p, row)


def build_metadata(
    seqs: Sequence[SeqSpec],
    block_size: int,
    groups: Sequence[tuple[int, Sequence[int]]] = (),
    device: str | torch.device = "cpu",
    pad_block: int = 0,
) -> AttentionMetadata:
    """The metadata of ``seqs`` (each with its block ids) and ``groups`` ((prefix_len, block
    ids) each, indexed by ``SeqSpec.group``); table padding is ``pad_block``."""
    spec = BatchSpec(
        tuple(seqs),
        tuple(p for p, _ in groups),
        block_size=block_size,
        prefix_blocks=tuple(tuple(blocks) for _, blocks in groups),
    )
    _check_spec(spec)
    assert spec.explicit_blocks and spec.prefix_blocks is not None
    bs, n_groups = block_size, len(groups)

    def table(rows: list[tuple[int, ...]]) -> torch.Tensor:
        width = max([len(r) for r in rows] + [1])
        padded = [list(r) + [pad_block] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int32).reshape(len(rows), width).to(device)

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=device)

    cu_q, slots = [0], []
    g_start, g_end = [0] * n_groups, [0] * n_groups
    for sq in spec.seqs:
        assert sq.blocks is not None
        if sq.group >= 0:
            if g_start[sq.group] == g_end[sq.group]:
                g_start[sq.group] = cu_q[-1]
            g_end[sq.group] = cu_q[-1] + sq.q_len
        slots += [sq.blocks[j // bs] * bs + j % bs for j in range(sq.kv_len - sq.q_len, sq.kv_len)]
        cu_q.append(cu_q[-1] + sq.q_len)
    return AttentionMetadata(
        cu_q=i32(cu_q),
        kv_len=i32([sq.kv_len for sq in spec.seqs]),
        block_table=table([sq.blocks or () for sq in spec.seqs]),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        seq_group=i32([sq.group for sq in spec.seqs]),
        prefix_len=i32(list(spec.prefix_lens)),
        prefix_block_table=table(list(spec.prefix_blocks)),
        group_q_start=i32(g_start),
        group_q_end=i32(g_end),
        max_q_len=max([sq.q_len for sq in spec.seqs] + [0]),
        max_kv_len=max([sq.kv_len for sq in spec.seqs] + [0]),
        max_prefix_len=max([*spec.prefix_lens, 0]),
    )


def build_batch(spec: BatchSpec, seed: int = 0, device: str | torch.device = "cpu") -> PagedBatch:
    """Dense random K/V per group prefix and per sequence, scattered into the spec's blocks
    (shuffled ones when it names none); blocks no sequence uses hold NaN."""
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
    if spec.explicit_blocks:
        assert spec.prefix_blocks is not None
        rows = [list(r) for r in spec.prefix_blocks] + [list(sq.blocks or ()) for sq in spec.seqs]
        total = max([b for r in rows for b in r] + [-1]) + 2
        spare = total - 1  # a never-used block pads the tables
    else:
        n_blocks = [max(1, cdiv(n, bs)) for n in lengths]
        total = sum(n_blocks) + 3  # a few never-used blocks
        ids = torch.randperm(total, generator=gen).tolist()
        rows = [ids[a - n : a] for n, a in zip(n_blocks, accumulate(n_blocks), strict=True)]
        spare = ids[-1]
        n_groups = len(spec.prefix_lens)
        spec = dataclasses.replace(
            spec,
            seqs=tuple(
                dataclasses.replace(sq, blocks=tuple(r))
                for sq, r in zip(spec.seqs, rows[n_groups:], strict=True)
            ),
            prefix_blocks=tuple(tuple(r) for r in rows[:n_groups]),
        )
    k_cache = torch.full((total, bs, hkv, d), float("nan")).to(dt)
    v_cache = k_cache.clone()
    for n, row, dk, dv in zip(lengths, rows, prefix_k + own_k, prefix_v + own_v, strict=True):
        pos = torch.arange(n)
        blk = torch.tensor(row, dtype=torch.long)[pos // bs]
        k_cache[blk, pos % bs], v_cache[blk, pos % bs] = dk, dv
    t = sum(sq.q_len for sq in spec.seqs)
    new_idx = [
        (s, j) for s, sq in enumerate(spec.seqs) for j in range(sq.kv_len - sq.q_len, sq.kv_len)
    ]
    k_new = torch.stack([own_k[s][j] for s, j in new_idx]) if t else rand(0, hkv, d)
    v_new = torch.stack([own_v[s][j] for s, j in new_idx]) if t else rand(0, hkv, d)
    assert spec.prefix_blocks is not None
    groups = list(zip(spec.prefix_lens, spec.prefix_blocks, strict=True))
    meta = build_metadata(spec.seqs, bs, groups, device, pad_block=spare)
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


def dense_reference(batch: PagedBatch, window: int | None = None) -> torch.Tensor:
    """float64 [T, Hq, D]: per sequence, SDPA over the dense prefix ++ own K/V the batch was
    built from (never the paged cache), causal over own positions, the prefix all visible;
    with a sliding ``window``, only the keys of a query's last W positions."""
    spec, q = batch.spec, batch.q.double().cpu()
    out = torch.empty_like(q)
    gqa = spec.num_q_heads // spec.num_kv_heads
    a = 0
    for s, sq in enumerate(spec.seqs):
        k, v = batch.own_k[s].double(), batch.own_v[s].double()  # [N, Hkv, D]
        p = 0
        if sq.group >= 0:
            p = spec.prefix_lens[sq.group]
            k = torch.cat([batch.prefix_k[sq.group].double(), k])
            v = torch.cat([batch.prefix_v[sq.group].double(), v])
        q_pos = sq.kv_len - sq.q_len + torch.arange(sq.q_len)  # own position of each query
        key_pos = torch.arange(p + sq.kv_len) - p  # prefix keys get negative positions
        mask = key_pos[None, :] <= q_pos[:, None]  # [L, P + N]
        if window is not None:
            mask &= key_pos[None, :] > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(
            q[a : a + sq.q_len].transpose(0, 1)[None],  # [1, Hq, L, D]
            k.transpose(0, 1)[None],  # [1, Hkv, P + N, D]
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=batch.scale,
            enable_gqa=gqa > 1,
        )
        out[a : a + sq.q_len] = o[0].transpose(0, 1)
        a += sq.q_len
    return out


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
