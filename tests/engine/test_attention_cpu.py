"""The C paged-attention kernel (CpuAttention) against the naive reference and the torch path."""

from __future__ import annotations

import pytest
import torch

from batchjob.backends.native.attention.cpu import MAX_ROWS, CpuAttention, build_units
from batchjob.backends.native.attention.torch_path import TorchAttention
from batchjob.kernels import reference as ref

pytestmark = pytest.mark.skipif(not CpuAttention().available, reason="no C compiler")


def _check(spec: ref.BatchSpec, seed: int) -> None:
    b = ref.build_batch(spec, seed=seed)
    backend = CpuAttention(calibrate=False)  # the kernel, whatever calibration would pick
    assert backend.supports(b.q, b.k_cache, b.v_cache)
    out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    again = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)  # cached units
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    assert out.shape == b.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(out, again)


@pytest.mark.parametrize("seed", range(24))
def test_random_batches_match_naive_reference(seed):
    ratio = (1, 2, 4, 8)[seed % 4]
    spec = ref.random_spec(
        seed,
        num_q_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=(16, 64, 80, 96, 128)[seed % 5],
        block_size=(16, 32)[seed % 2],
        max_prefix=150,  # several 16-key chunks, ending mid-block
        max_chunk=90,  # prefill chunks longer than one tile of query rows
        prefill_prob=0.0 if seed % 3 == 0 else 0.6,  # decode-only batches too
    )
    _check(spec, seed)


def test_big_group_and_long_causal_prefill():
    """Many members share one prefix (prefix tiles split across rows) beside a long prefill."""
    seqs = [ref.SeqSpec(1, 1 + i % 7, group=0) for i in range(70)]
    seqs += [ref.SeqSpec(150, 170), ref.SeqSpec(3, 3, group=1)]
    spec = ref.BatchSpec(tuple(seqs), (77, 16), num_q_heads=4, num_kv_heads=4, head_dim=32)
    _check(spec, 7)


def test_units_cover_every_query_row_once():
    spec = ref.random_spec(5, num_q_heads=8, num_kv_heads=8, max_chunk=100, prefill_prob=0.7)
    b = ref.build_batch(spec, seed=5)
    units, _ = build_units(b.meta, 8, 8)
    assert (units[:, 1] <= MAX_ROWS).all()
    # decodes: all heads at once; prefill tiles of 64 rows a head: per head
    assert (units[:, 6] == -1).any() and (units[:, 6] >= 0).any()
    own = torch.zeros(b.q.shape[0], 8, dtype=torch.long)
    for q0, nq, _, _, _, dst, kvh in units.tolist():
        if dst == 0:
            own[q0 : q0 + nq, kvh if kvh >= 0 else slice(None)] += 1
    assert (own == 1).all()


def test_unsupported_inputs_fall_back_to_torch():
    backend = CpuAttention()
    lanes = backend.kernel.lanes if backend.kernel is not None else 4
    # a head dim that is no multiple of this build's lanes (24 is one of AVX2's 8)
    spec = ref.random_spec(2, head_dim=lanes + 2, block_size=16)
    b = ref.build_batch(spec, seed=2)
    assert not backend.supports(b.q, b.k_cache, b.v_cache)
    out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = TorchAttention().attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, want)
