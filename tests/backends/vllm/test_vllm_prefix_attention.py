"""batchjob's prefix-shared attention inside vLLM's CPU backend (backends/vllm/prefix_attention.py):
registered in place of vLLM's CPU attention, it writes a layer's KV into vLLM's cache tensor
and attends as dense causal attention does, on shared-document batches with decodes and
prefills mixed, GQA, head dims 64 and 128, float32 and bfloat16 caches."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.backends.vllm.vllm_kit import needs_vllm

pytestmark = [needs_vllm]


@pytest.fixture(scope="module")
def pa():
    from vllm.config import VllmConfig, set_current_vllm_config

    from batchjob.backends.vllm import prefix_attention

    if prefix_attention.kernel() is None:
        pytest.skip("no C compiler: the backend stays vLLM's")
    config = VllmConfig()  # the impls read the model's dtype from it when built
    object.__setattr__(config, "model_config", SimpleNamespace(dtype=torch.float32))
    with set_current_vllm_config(config):
        yield prefix_attention


def test_the_worker_extension_registers_it_in_place_of_vllms_cpu_attention(pa):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from batchjob.backends.vllm import prefix_attention_worker

    assert prefix_attention_worker.PrefixAttentionWorker().batchjob_prefix_attention_stats()

    assert AttentionBackendEnum.CPU_ATTN.get_path() == pa.BACKEND_PATH
    assert AttentionBackendEnum.CPU_ATTN.get_class() is pa.PrefixSharedCpuBackend


def _batch(rng: random.Random, bs: int, nblocks: int):
    """Block tables of requests over 3 shared documents (whole blocks), own blocks after."""
    free = list(range(1, nblocks))
    rng.shuffle(free)
    docs = [[free.pop() for _ in range(rng.randint(1, 6))] for _ in range(3)]
    rows, seq_lens, q_lens = [], [], []
    for i in range(rng.randint(4, 12)):
        doc = docs[0] if i < 2 else rng.choice(docs) if rng.random() < 0.85 else []
        own = rng.randint(1, 3 * bs)
        rows.append(doc + [free.pop() for _ in range(-(-own // bs))])
        seq_lens.append(len(doc) * bs + own)
        q_lens.append(1 if i < 2 or rng.random() < 0.6 else rng.randint(1, own))
    order = list(range(len(rows)))
    rng.shuffle(order)  # the sharing requests anywhere in the batch
    rows, seq_lens, q_lens = ([x[i] for i in order] for x in (rows, seq_lens, q_lens))
    width = max(len(r) for r in rows)
    table = np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)
    return rows, table, np.array(seq_lens), np.concatenate([[0], np.cumsum(q_lens)])


@pytest.mark.parametrize(
    "hq,hkv,d,dtype",
    [
        (8, 8, 128, torch.float32),
        (8, 2, 64, torch.float32),
        (4, 4, 128, torch.bfloat16),
        (8, 2, 64, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("isa", ["auto", "avx2", "generic"])
def test_attends_as_dense_causal_attention(pa, hq, hkv, d, dtype, seed, isa, monkeypatch):
    """Every kernel build this CPU runs: the widest, and the narrower ones a Zen 3 (AVX2) or a
    CPU without AVX gets (``isa`` above the CPU's narrows to what it has)."""
    from batchjob.kernels.cpu.build import load_kernel

    kn = load_kernel(None if isa == "auto" else isa)
    assert kn is not None
    _attend_as_dense(pa, kn, kn, hq, hkv, d, dtype, seed, monkeypatch)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 128), (8, 2, 64), (9, 3, 64)])
@pytest.mark.parametrize("seed", range(3))
def test_bf16_units_for_an_amx_build_take_one_kv_head_a_tile(pa, hq, hkv, d, seed, monkeypatch):
    """An AMX build runs bf16 key-major tiles only in one-KV-head units (run_unit_bf16): the
    backend lays a bf16 step's tiles out so, as the native engine does (``whole_tiles``),
    where other builds put a tile's rows of all KV heads in one unit; those units attend as
    dense attention does (run here by this CPU's build, which takes both layouts)."""
    import dataclasses

    from batchjob.backends.native.attention.cpu import KVH, NQ, WHOLE_ROWS

    kn = pa.kernel()
    amx = dataclasses.replace(kn, isa="amx")  # what step_work sees on an AMX CPU
    work, args = _attend_as_dense(pa, kn, amx, hq, hkv, d, torch.bfloat16, seed, monkeypatch)
    tiles = work.units[work.units[:, NQ] * (hq // hkv) >= WHOLE_ROWS]
    assert len(tiles) and (tiles[:, KVH] >= 0).all()
    own = pa.step_work(kn, *args, kv_bf16=True).units  # this build's own layout
    if kn.isa != "amx" and hkv > 1:
        assert (own[own[:, NQ] * (hq // hkv) >= WHOLE_ROWS, KVH] < 0).any()


def _attend_as_dense(pa, kn, units_for, hq, hkv, d, dtype, seed, monkeypatch):
    """One random step of shared-document requests through the backend's KV update and
    forward on ``kn``, its units built for the build ``units_for``, against dense causal
    attention; returns the step's work and step_work's batch arguments."""
    monkeypatch.setattr(pa, "_KERNEL", [kn])
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs, nblocks = 32, 64
    impl = pa.PrefixSharedImpl(hq, d, d**-0.5, hkv, None, None, "auto")
    cache = torch.full((nblocks, hkv, bs, 2 * d), float("nan"), dtype=dtype)
    rows, table, seq_lens, starts = _batch(rng, bs, nblocks)
    # each block's K/V, written once through the backend's own KV update
    used = sorted({b for r in rows for b in r})
    k_blk = torch.randn(nblocks, bs, hkv, d).to(dtype)
    v_blk = torch.randn(nblocks, bs, hkv, d).to(dtype)
    slots = torch.tensor([b * bs + i for b in used for i in range(bs)])
    # K and V as vLLM passes them: views of one fused projection output (rows strided)
    fused = torch.cat([k_blk[used].flatten(0, 1), v_blk[used].flatten(0, 1)], dim=1)
    impl.do_kv_cache_update(None, fused[:, :hkv], fused[:, hkv:], cache, slots)
    assert impl._native
    t = int(starts[-1])
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)  # the kernel reads it in place (float32)
    bf16 = dtype == torch.bfloat16
    work = pa.step_work(units_for, table, seq_lens, starts, bs, hq, hkv, kv_bf16=bf16)
    assert work.batch.meta.num_groups > 0  # the document really read once per group
    out = torch.zeros(t, hq * d, dtype=dtype)
    meta = SimpleNamespace(num_actual_tokens=t, work=work)
    impl.forward(None, q, None, None, cache, meta, out)
    out = out.view(t, hq, d).float()
    for r, (blocks, n) in enumerate(zip(rows, seq_lens, strict=True)):
        keys = k_blk[blocks].flatten(0, 1)[:n].float().repeat_interleave(hq // hkv, dim=1)
        vals = v_blk[blocks].flatten(0, 1)[:n].float().repeat_interleave(hq // hkv, dim=1)
        qs = q[starts[r] : starts[r + 1]].float()
        ql = len(qs)
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * d**-0.5
        seen = torch.arange(n - ql, n)[:, None] >= torch.arange(n)[None, :]
        ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, -torch.inf).softmax(-1), vals)
        tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out[starts[r] : starts[r + 1]], ref, **tol)
    return work, (table, seq_lens, starts, bs, hq, hkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_layers_take_the_kernel_unless_switched_off(pa, dtype, monkeypatch):
    """float32 and bf16 caches take batchjob's kernel, where vLLM would run its AMX path too;
    ``BATCHJOB_VLLM_PREFIX_ATTENTION=0`` leaves every layer to vLLM's layout and kernel."""
    cache = torch.zeros(4, 2, 32, 2 * 64, dtype=dtype)
    assert pa.PrefixSharedImpl(8, 64, 64**-0.5, 2, None, None, "auto")._uses_native(cache)
    monkeypatch.setattr(pa, "_KERNEL", [])
    monkeypatch.setenv(pa.ENV_SWITCH, "0")
    assert not pa.PrefixSharedImpl(8, 64, 64**-0.5, 2, None, None, "auto")._uses_native(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_update_in_c_writes_the_native_layout(pa, dtype, monkeypatch):
    """The KV update maps vLLM's slots to the native rows in C: the cache equals the one the
    torch path writes (the C call refused), K and V rows of fused-projection views with more
    rows than slots (vLLM pads the batch); a slot out of range raises."""
    hq, hkv, d, bs, nblocks = 8, 2, 64, 32, 6
    impl = pa.PrefixSharedImpl(hq, d, d**-0.5, hkv, None, None, "auto")
    fused = torch.randn(12, 2 * hkv, d).to(dtype)
    k, v = fused[:, :hkv], fused[:, hkv:]
    slots = torch.tensor([0, 31, 32, 33, 64, 100, 191, 150, 5])  # 9 of the 12 rows
    got = torch.full((nblocks, hkv, bs, 2 * d), float("nan"), dtype=dtype)
    want = got.clone()
    impl.do_kv_cache_update(None, k, v, got, slots)
    assert impl._native
    # the torch path: the same slots, not contiguous (the C call takes contiguous ones only)
    wide = torch.stack([slots, slots], dim=1)[:, 0]
    assert not wide.is_contiguous()
    impl.do_kv_cache_update(None, k, v, want, wide)
    assert torch.equal(got.isnan(), want.isnan()) and int((~got.isnan()).sum()) == 9 * 2 * hkv * d
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    view = pa.native_view(got)
    assert torch.equal(view[100 // bs, 0, 100 % bs], k[5]) and torch.equal(view[5, 1, 31], v[6])
    with pytest.raises(IndexError):
        impl.do_kv_cache_update(None, k, v, got, torch.tensor([3, nblocks * bs]))


@pytest.mark.parametrize("hkv,grouped", [(8, 3), (2, 2)])
def test_a_prefill_that_fills_a_tile_alone_joins_no_group(pa, hkv, grouped):
    """Two decodes and a 40-token prefill over one document: with 8 query heads per 8 KV
    heads the prefill's 40 rows a head share the document's tiles with the decodes; with 4
    query heads a KV head its 160 rows fill tiles of their own, and it reads the document
    there."""
    kn = pa.kernel()
    if kn.max_rows != 64:  # AVX-512 and AVX2 builds; the generic one's tiles hold 32 rows
        pytest.skip(f"the cases are sized for 64-row tiles, this build's hold {kn.max_rows}")
    bs = 32
    table = np.array([[3, 4, 5, 0], [3, 4, 6, 0], [3, 4, 7, 8]], dtype=np.int32)
    seq_lens = np.array([70, 70, 104])  # all three: the document's 2 blocks before the queries
    starts = np.array([0, 1, 2, 42])
    work = pa.step_work(kn, table, seq_lens, starts, bs, 8, hkv, kv_bf16=False)
    assert work.batch.meta.num_groups == 1
    assert int((work.batch.meta.seq_group.numpy() >= 0).sum()) == grouped


def test_a_token_map_that_is_not_a_permutation_is_refused(pa):
    """The kernel reads and writes rows through the token map: one out of range is refused
    before anything runs."""
    from batchjob.backends.native.attention.cpu import run_units

    kn = pa.kernel()
    hq = hkv = 2
    d, bs = 64, 32
    cache = torch.zeros(4, hkv, bs, 2 * d)
    table = np.array([[1], [2]], dtype=np.int32)
    work = pa.step_work(
        kn, table, np.array([3, 3]), np.array([0, 1, 2]), bs, hq, hkv, kv_bf16=False
    )
    base = cache.data_ptr()
    args = (base, base + bs * hkv * d * 4, hkv, bs, (2 * bs * hkv * d, hkv * d, d), work.units)
    q = torch.randn(2, hq, d)
    ok = run_units(kn, q, *args, work.blocks, False, 1, False, 1.0, None, torch.tensor([1, 0]))
    assert torch.isfinite(ok).all()
    with pytest.raises(RuntimeError, match="rejected"):
        run_units(kn, q, *args, work.blocks, False, 1, False, 1.0, None, torch.tensor([0, 2]))


def test_layers_the_kernel_cannot_take_keep_vllms_layout_and_kernel(pa):
    """A sliding-window layer stays vLLM's: its KV update writes vLLM's layout (K transposed),
    so nothing of the native layout leaks into a layer vLLM's kernel reads."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    hq = hkv = 2
    d, bs = 64, 32
    ours = pa.PrefixSharedImpl(hq, d, d**-0.5, hkv, None, 128, "auto")
    theirs = CPUAttentionBackendImpl(hq, d, d**-0.5, hkv, None, 128, "auto")
    k, v = torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    slots = torch.tensor([5, 40, 70])
    a, b = torch.zeros(4, hkv, bs, 2 * d), torch.zeros(4, hkv, bs, 2 * d)
    for impl, cache in ((ours, a), (theirs, b)):
        layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
        impl.do_kv_cache_update(layer, k, v, cache, slots)
    assert not ours._native
    assert torch.equal(a, b)
