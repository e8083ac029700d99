"""The naive reference against torch SDPA on dense K/V, and the batch builder's invariants."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.kernels.reference import (
    BatchSpec,
    PagedBatch,
    SeqSpec,
    build_batch,
    naive_prefix_shared_attention,
    naive_write_kv,
    random_spec,
)


def sdpa_dense(batch: PagedBatch) -> torch.Tensor:
    """Per sequence: SDPA over the builder's dense prefix + own K/V (never the paged cache)."""
    spec, q = batch.spec, batch.q.float()
    out = torch.empty_like(q)
    gqa = spec.num_q_heads // spec.num_kv_heads
    a = 0
    for s, sq in enumerate(spec.seqs):
        k, v = batch.own_k[s].float(), batch.own_v[s].float()  # [N, Hkv, D]
        p = 0
        if sq.group >= 0:
            p = spec.prefix_lens[sq.group]
            k = torch.cat([batch.prefix_k[sq.group].float(), k])
            v = torch.cat([batch.prefix_v[sq.group].float(), v])
        q_pos = sq.kv_len - sq.q_len + torch.arange(sq.q_len)  # own position of each query
        key_pos = torch.arange(p + sq.kv_len) - p  # prefix keys get negative positions
        mask = key_pos[None, :] <= q_pos[:, None]  # [L, P + N]
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


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (8, 1)])
def test_reference_matches_sdpa(seed: int, hq: int, hkv: int) -> None:
    batch = build_batch(random_spec(seed, num_q_heads=hq, num_kv_heads=hkv, head_dim=32), seed)
    ref = naive_prefix_shared_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    torch.testing.assert_close(ref, sdpa_dense(batch), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 4, 16, 32]))
def test_reference_matches_sdpa_random(seed: int, block_size: int) -> None:
    spec = random_spec(seed, block_size=block_size, head_dim=16, max_prefix=40, max_own=20)
    batch = build_batch(spec, seed)
    ref = naive_prefix_shared_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    torch.testing.assert_close(ref, sdpa_dense(batch), atol=1e-5, rtol=1e-5)


def test_prefix_changes_the_output() -> None:
    """Guard against a reference that silently ignores the prefix."""
    spec = BatchSpec(seqs=(SeqSpec(1, 3, group=0),), prefix_lens=(20,), head_dim=16)
    batch = build_batch(spec, 0)
    with_prefix = naive_prefix_shared_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    no_group = batch.meta.seq_group.new_full((1,), -1)
    meta = type(batch.meta)(**{**batch.meta.__dict__, "seq_group": no_group})
    without = naive_prefix_shared_attention(
        batch.q, batch.k_cache, batch.v_cache, meta, batch.scale
    )
    assert not torch.allclose(with_prefix, without)


def test_builder_metadata_is_consistent() -> None:
    spec = BatchSpec(
        seqs=(
            SeqSpec(3, 3),  # prefix being prefilled (ungrouped)
            SeqSpec(1, 1, group=1),  # empty distinct part: only this step's token
            SeqSpec(2, 5, group=1),
            SeqSpec(1, 9, group=0),
        ),
        prefix_lens=(17, 5),
        block_size=4,
    )
    meta = build_batch(spec, 0).meta
    assert meta.cu_q.tolist() == [0, 3, 4, 6, 7]
    assert meta.q_len.tolist() == [3, 1, 2, 1]
    assert meta.group_q_start.tolist() == [6, 3]
    assert meta.group_q_end.tolist() == [7, 6]
    assert meta.seq_group.tolist() == [-1, 1, 1, 0]
    assert (meta.max_q_len, meta.max_kv_len, meta.max_prefix_len) == (3, 9, 17)
    assert meta.prefix_block_table.shape == (2, 5)
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.shape == (7,)
    blocks = meta.block_table.flatten().tolist() + meta.prefix_block_table.flatten().tolist()
    used = [
        b for row, n in zip(meta.block_table.tolist(), [1, 1, 2, 3], strict=True) for b in row[:n]
    ]
    assert len(set(used)) == len(used) and all(0 <= b < 64 for b in blocks)


def test_naive_write_kv_restores_the_new_tokens() -> None:
    batch = build_batch(random_spec(3, block_size=8), 3)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    slots = batch.meta.slot_mapping
    k_cache[slots // 8, slots % 8] = 0.0
    v_cache[slots // 8, slots % 8] = 0.0
    naive_write_kv(k_cache, v_cache, batch.k_new, batch.v_new, slots)
    torch.testing.assert_close(k_cache, batch.k_cache, equal_nan=True)
    torch.testing.assert_close(v_cache, batch.v_cache, equal_nan=True)


def test_naive_write_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    k = torch.ones(2, 1, 2)
    naive_write_kv(k_cache, v_cache, k, 2 * k, torch.tensor([5, -1]))
    assert k_cache.sum() == 2 and k_cache[1, 1].sum() == 2 and v_cache[1, 1].sum() == 4
