"""The C paged-attention kernel (CpuAttention) against the naive reference and the torch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchjob.backends.native.attention.base import seq_arrays, token_positions
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


@pytest.mark.parametrize("window", [None, 9])
def test_units_cover_every_query_row_once(window):
    """Own units cover every query row once; prefix units at most once, and, with a window,
    exactly the rows whose window still holds a prefix key."""
    spec = ref.random_spec(5, num_q_heads=8, num_kv_heads=8, max_chunk=100, prefill_prob=0.7)
    b = ref.build_batch(spec, seed=5)
    units, _ = build_units(b.meta, 8, 8, window=window)
    assert (units[:, 1] <= MAX_ROWS).all()
    # decodes: all heads at once; prefill tiles of 64 rows a head: per head
    assert (units[:, 6] == -1).any() and (units[:, 6] >= 0).any()
    own = torch.zeros(b.q.shape[0], 8, dtype=torch.long)
    pre = torch.zeros(b.q.shape[0], 8, dtype=torch.long)
    for q0, nq, _, _, _, dst, kvh, _ in units.tolist():
        (pre if dst else own)[q0 : q0 + nq, kvh if kvh >= 0 else slice(None)] += 1
    assert (own == 1).all()
    cu_q, _, _, prefix = seq_arrays(b.meta)
    seq = np.repeat(np.arange(len(prefix)), np.diff(cu_q))
    sees = prefix[seq] > 0  # a group member's token
    if window is not None:  # and its window still holds a prefix key
        sees &= token_positions(b.meta) - window + 1 < prefix[seq]
        assert sees.any() and (prefix[seq] > 0).sum() > sees.sum()
    assert (pre == torch.from_numpy(sees)[:, None].long()).all()


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


class _Spy:
    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 700])  # a decode batch; a prefill chunk over 1 MiB
def test_write_kv_in_c_equals_torch_path(dtype, tokens):
    """K and V as the model passes them (views of one qkv output, rows of Hkv * D), slots in
    shuffled order: the C write fills exactly the torch path's cache."""
    import dataclasses

    hkv, d, nb, bs = 4, 128, 64, 16
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (8 + 2 * hkv) * d, generator=g).to(dtype)
    k = qkv[:, 8 * d : (8 + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (8 + hkv) * d :].view(tokens, hkv, d)
    slots = torch.randperm(nb * bs, generator=g)[:tokens]
    backend = CpuAttention()
    spy = _Spy(backend.kernel.write_kv)
    backend.kernel = dataclasses.replace(backend.kernel, write_kv=spy)
    got = [torch.full((nb, bs, hkv, d), float("nan"), dtype=dtype) for _ in range(2)]
    want = [x.clone() for x in got]
    backend.write_kv(*got, k, v, slots)
    TorchAttention().write_kv(*want, k, v, slots)
    assert spy.calls == 1
    for a, b in zip(got, want, strict=True):  # NaN where nothing was written, in both
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    written = ~torch.isnan(got[0]).flatten(0, 1).flatten(1).any(-1)
    assert int(written.sum()) == tokens


def test_write_kv_falls_back_where_c_cannot():
    """A float32 k into a bf16 cache (a conversion) and a slot out of range take the torch
    path: the conversion is written, the bad slot raises its index error."""
    k = torch.randn(2, 2, 32)
    caches = [torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
    backend = CpuAttention()
    backend.write_kv(*caches, k, k, torch.tensor([5, 9]))
    assert torch.equal(caches[0].view(64, 2, 32)[[5, 9]], k.to(torch.bfloat16))
    same = [torch.zeros(4, 16, 2, 32) for _ in range(2)]
    with pytest.raises(IndexError):
        backend.write_kv(*same, k, k, torch.tensor([5, 64]))
