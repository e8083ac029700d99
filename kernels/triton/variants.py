"""Comparison variant without sharing: every sequence attends its full KV through one table.

``unshare_kv`` turns a prefix-shared batch into the layout an engine without prefix sharing
would have (group prefix blocks listed before the sequence's own blocks), and
``plain_paged_attention`` runs ordinary causal paged attention on it. Host-side and
syncing: meant for tests and benchmarks, not for the engine's hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..meta import AttentionMetadata, cdiv
from .wrappers import paged_attention


@dataclass(frozen=True)
class UnsharedKV:
    """Each sequence's full KV (its group prefix, then its own KV) behind one block table."""

    k_cache: torch.Tensor  # [num_blocks', block_size, Hkv, D]: the input caches, or a copy
    v_cache: torch.Tensor
    cu_q: torch.Tensor  # int32 [S + 1]
    kv_len: torch.Tensor  # int32 [S]: prefix_len + own kv_len
    block_table: torch.Tensor  # int32 [S, max_blocks']
    max_q_len: int
    copied: bool  # True when a prefix ending mid-block forced copying KV into new blocks


def _gather(cache: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    """cache: [NB, page, Hkv, D] -> the first n positions of a block list: [n, Hkv, D]."""
    page = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    ids = torch.tensor(blocks, dtype=torch.long, device=cache.device)[pos // page]
    return cache[ids, pos % page]


def unshare_kv(meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> UnsharedKV:
    """Block tables listing prefix blocks then own blocks, per sequence.

    When every used prefix fills whole blocks the tables just point at the existing blocks;
    otherwise (a prefix ends mid-block, so own positions would not line up) each grouped
    sequence's full KV is copied into new blocks appended to copies of the caches.
    """
    page = k_cache.shape[1]
    kv_len, seq_group = meta.kv_len.tolist(), meta.seq_group.tolist()
    prefix_len = meta.prefix_len.tolist()
    own_rows = [r[: cdiv(n, page)] for r, n in zip(meta.block_table.tolist(), kv_len, strict=True)]
    pre_rows = [
        r[: cdiv(p, page)]
        for r, p in zip(meta.prefix_block_table.tolist(), prefix_len, strict=True)
    ]
    copied = any(prefix_len[g] % page for g in set(seq_group) if g >= 0)
    rows: list[list[int]] = []
    lengths: list[int] = []
    new_k: list[torch.Tensor] = []
    new_v: list[torch.Tensor] = []
    next_block = k_cache.shape[0]
    for s, g in enumerate(seq_group):
        p = prefix_len[g] if g >= 0 else 0
        lengths.append(p + kv_len[s])
        if g < 0 or p == 0:
            rows.append(own_rows[s])
        elif not copied:
            rows.append(pre_rows[g] + own_rows[s])
        else:
            n_blocks = cdiv(p + kv_len[s], page)
            for cache, dst in ((k_cache, new_k), (v_cache, new_v)):
                dense = torch.cat(
                    [_gather(cache, pre_rows[g], p), _gather(cache, own_rows[s], kv_len[s])]
                )
                pad = dense.new_zeros(n_blocks * page - dense.shape[0], *dense.shape[1:])
                dst.append(torch.cat([dense, pad]).view(n_blocks, page, *dense.shape[1:]))
            rows.append(list(range(next_block, next_block + n_blocks)))
            next_block += n_blocks
    if new_k:
        k_cache = torch.cat([k_cache, *new_k])
        v_cache = torch.cat([v_cache, *new_v])
    width = max([len(r) for r in rows] + [1])
    table = [r + [0] * (width - len(r)) for r in rows]
    dev = meta.kv_len.device
    return UnsharedKV(
        k_cache=k_cache,
        v_cache=v_cache,
        cu_q=meta.cu_q,
        kv_len=torch.tensor(lengths, dtype=torch.int32, device=dev),
        block_table=torch.tensor(table, dtype=torch.int32, device=dev).reshape(len(rows), width),
        max_q_len=meta.max_q_len,
        copied=bool(new_k),
    )


def plain_paged_attention(
    q: torch.Tensor, unshared: UnsharedKV, scale: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]: causal paged attention over each sequence's full KV."""
    return paged_attention(
        q,
        unshared.k_cache,
        unshared.v_cache,
        unshared.cu_q,
        unshared.kv_len,
        unshared.block_table,
        scale,
        max_q_len=unshared.max_q_len,
        out=out,
    )
