"""The paged naive reference against the dense SDPA one, and the batch builder's invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.kernels.reference import (
    BatchSpec,
    SeqSpec,
    build_batch,
    build_metadata,
    dense_reference,
    naive_prefix_shared_attention,
    naive_write_kv,
    random_spec,
)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (8, 1)])
def test_reference_matches_sdpa(seed: int, hq: int, hkv: int) -> None:
    batch = build_batch(random_spec(seed, num_q_heads=hq, num_kv_heads=hkv, head_dim=32), seed)
    ref = naive_prefix_shared_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    torch.testing.assert_close(ref.double(), dense_reference(batch), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 4, 16, 32]))
def test_reference_matches_sdpa_random(seed: int, block_size: int) -> None:
    spec = random_spec(seed, block_size=block_size, head_dim=16, max_prefix=40, max_own=20)
    batch = build_batch(spec, seed)
    ref = naive_prefix_shared_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    torch.testing.assert_close(ref.double(), dense_reference(batch), atol=1e-5, rtol=1e-5)


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


def test_explicit_block_ids_are_used_and_padding_never_read() -> None:
    spec = BatchSpec(
        seqs=(SeqSpec(2, 6, 0, blocks=(7, 3)), SeqSpec(1, 1, blocks=(9,))),
        prefix_lens=(5,),
        prefix_blocks=((4, 1),),
        block_size=4,
        head_dim=16,
    )
    batch = build_batch(spec, 1)
    meta = batch.meta
    assert meta.block_table.tolist() == [[7, 3], [9, 10]]  # 10: a NaN block pads the table
    assert meta.prefix_block_table.tolist() == [[4, 1]]
    assert meta.slot_mapping.tolist() == [3 * 4 + 0, 3 * 4 + 1, 9 * 4]
    assert torch.isnan(batch.k_cache[[0, 2, 5, 6, 8, 10]]).all()
    again = build_metadata(spec.seqs, 4, [(5, (4, 1))])
    assert again.block_table.tolist() == [[7, 3], [9, 0]]
    assert torch.equal(again.slot_mapping, meta.slot_mapping)
    ref = naive_prefix_shared_attention(batch.q, batch.k_cache, batch.v_cache, meta, batch.scale)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ref.double(), dense_reference(batch), atol=1e-5, rtol=1e-5)


def test_block_ids_for_some_sequences_only_are_refused() -> None:
    spec = BatchSpec(seqs=(SeqSpec(1, 2, blocks=(0,)), SeqSpec(1, 1)), prefix_lens=())
    with pytest.raises(AssertionError, match="every sequence"):
        build_batch(spec)
