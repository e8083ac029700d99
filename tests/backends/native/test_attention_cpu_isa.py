"""Every ISA build of the C kernel this CPU runs, against the naive reference; ISA selection;
the first-use calibration (kernel vs torch path per shape class) and its on-disk cache."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from batchjob.backends.native.attention import calibrate as calib
from batchjob.backends.native.attention.cpu import (
    MAX_WHOLE_ROWS,
    CpuAttention,
    build_units,
    head_rows,
)
from batchjob.backends.native.attention.torch_path import TorchAttention
from batchjob.kernels import reference as ref
from batchjob.kernels.cpu import build

ISAS = build.cpu_isas()
pytestmark = pytest.mark.skipif(not CpuAttention(calibrate=False).available, reason="no gcc")
HEAD_DIMS = (32, 64, 96, 128, 256)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", range(4))
def test_isa_path_matches_naive_reference(isa, head_dim, case):
    seed = HEAD_DIMS.index(head_dim) * 4 + case
    ratio = (1, 2, 4, 8)[case]  # GQA
    spec = ref.random_spec(
        seed,
        num_q_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=(16, 32)[seed % 2],
        max_prefix=150,  # prefixes ending mid-block, over several 16-key chunks
        max_chunk=70,  # prefill chunks longer than one tile of query rows
        prefill_prob=0.0 if case == 0 else 0.6,  # case 0: decode-only batch
    )
    b = ref.build_batch(spec, seed=seed)
    backend = CpuAttention(isa, calibrate=False)
    assert backend.isa == isa
    assert backend.supports(b.q, b.k_cache, b.v_cache)
    out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", (48, 80))
def test_isa_path_head_dims_off_the_power_of_two_tiles(isa, head_dim):
    """Head dims whose vector count is not a multiple of 4 (3, 5 vectors of 16; 6, 10 of 8):
    the tiles' divisors of D (div_le) take their other values."""
    lanes = build.load_kernel(isa).lanes
    if head_dim % lanes:
        pytest.skip(f"head dim {head_dim} is not a multiple of {lanes} lanes")
    spec = ref.random_spec(
        head_dim, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16,
        max_prefix=150, max_chunk=70, prefill_prob=0.6,
    )  # fmt: skip
    b = ref.build_batch(spec, seed=head_dim)
    out = CpuAttention(isa, calibrate=False).attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", (176, 256))
def test_isa_path_score_tiles_sum_over_head_dim_in_parts(isa, head_dim):
    """Key-major score tiles sum q . k over at most 128 dims at a time (the kernel's DSPLIT):
    176 = 128 + 48 and 256 = 2 x 128, on prefill chunks over a shared prefix and over their
    own KV (causal), grouped-query 8/2."""
    seqs = (*(ref.SeqSpec(30, 30 + 7 * i, group=0) for i in range(3)), ref.SeqSpec(50, 90))
    spec = ref.BatchSpec(seqs, (100,), num_q_heads=8, num_kv_heads=2, head_dim=head_dim)
    b = ref.build_batch(spec, seed=head_dim)
    out = CpuAttention(isa, calibrate=False).attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_isa_path_many_decodes_over_one_prefix(isa):
    """More decode rows than one tile holds, 8 KV heads (whole-block decode units)."""
    seqs = tuple(ref.SeqSpec(1, 1 + 5 * i % 37, group=0) for i in range(40))
    spec = ref.BatchSpec(seqs, (83,), num_q_heads=8, num_kv_heads=8, head_dim=32)
    b = ref.build_batch(spec, seed=3)
    out = CpuAttention(isa, calibrate=False).attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_isa_path_small_groups_take_all_heads_in_one_unit(isa, dtype):
    """Decode over prefixes shared by few rows (row-major dot products: under 8 to 16 rows
    a head, by ISA and head dim) and by more (a key-major tile per head), 4-24 rows: one unit
    per group over all 8 KV heads, read as whole blocks, where all heads' rows fit the
    scratch; a group of 40 rows a head: per head. Equal to the reference."""
    sizes = (4, 5, 7, 8, 13, 24, 40)
    seqs = tuple(
        ref.SeqSpec(1, 3 + 7 * i % 40, group=g) for g, n in enumerate(sizes) for i in range(n)
    )
    prefixes = (150, 97, 300, 64, 200, 33, 120)
    spec = ref.BatchSpec(seqs, prefixes, num_q_heads=8, num_kv_heads=8, head_dim=64, dtype=dtype)
    b = ref.build_batch(spec, seed=5)
    backend = CpuAttention(isa, calibrate=False)
    kn = backend.kernel
    units, _ = build_units(b.meta, 8, 8, kn.max_rows, kn.lanes)
    prefix_units = units[units[:, 5] == 1]  # DST: the groups' prefixes
    tiles = [min(kn.max_rows, n - i) for n in sizes for i in range(0, n, kn.max_rows)]
    whole = [8 * head_rows(np.array(n), kn.lanes) <= MAX_WHOLE_ROWS for n in tiles]
    assert whole[:6] == [True] * 6  # 40 rows: 8 x 64 padded rows > 256 (generic: 32 + 8)
    assert all(whole) == (kn.lanes == 4)
    assert (prefix_units[:, 6] == -1).sum() == sum(whole)  # KVH -1: all heads in one unit
    assert len(prefix_units) == sum(1 if w else 8 for w in whole)
    out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    tol = 3e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128))
def test_isa_path_grouped_query_decode_over_widely_shared_prefixes(isa, head_dim):
    """Decode rows of 4 query heads a KV head over prefixes shared by 9-16 rows: key-major
    tiles of 36-64 rows a head, both KV heads in one unit (each head's next chunk fetched
    while its tile computes), prefixes ending mid-chunk and mid-block. Equal to the
    reference."""
    sizes, prefixes = (16, 16, 12, 10, 9, 9), (203, 190, 170, 150, 100, 77)
    seqs = tuple(
        ref.SeqSpec(1, 2 + 5 * i % 23, group=g) for g, n in enumerate(sizes) for i in range(n)
    )
    spec = ref.BatchSpec(seqs, prefixes, num_q_heads=8, num_kv_heads=2, head_dim=head_dim)
    b = ref.build_batch(spec, seed=head_dim)
    backend = CpuAttention(isa, calibrate=False)
    kn = backend.kernel
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # every group under a thread's share: all-head units
    try:
        units, _ = build_units(b.meta, 8, 2, kn.max_rows, kn.lanes, threads=2)
        out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    finally:
        torch.set_num_threads(threads)
    prefix_units = units[units[:, 5] == 1]
    assert (prefix_units[:, 6] == -1).all()
    assert (prefix_units[:, 1] * 4 > 2 * kn.lanes).any()  # tiles of 4+ row vectors a head
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=3e-5)


def test_all_head_units_keep_threads_balanced():
    """A unit over all KV heads holding more than a thread's share of the batch's work is
    split per head: one group's prefix with 4 threads, not with 1. Nor are key-major tiles
    taken whole where AMX runs them (whole_tiles False)."""
    seqs = tuple(ref.SeqSpec(1, 3 + i % 5, group=0) for i in range(16))
    spec = ref.BatchSpec(seqs, (500,), num_q_heads=8, num_kv_heads=8, head_dim=32)
    b = ref.build_batch(spec, seed=1)
    for threads, tiles, kvh in (
        (1, True, [-1]),
        (4, True, list(range(8))),
        (1, False, list(range(8))),
    ):
        units, _ = build_units(b.meta, 8, 8, 64, 8, threads, whole_tiles=tiles)
        assert sorted(units[units[:, 5] == 1][:, 6].tolist()) == kvh


def test_decode_rows_over_own_kv_run_between_the_tiles():
    """Decode rows over their own KV (few rows a head: memory-bound) are spread evenly
    between the shared-prefix tiles (compute-bound), each kind costliest first, so threads
    taking units in turn overlap the two; the result still equals the reference."""
    seqs = tuple(ref.SeqSpec(1, 20 + 9 * i % 50, group=i // 16) for i in range(48))
    spec = ref.BatchSpec(seqs, (300, 200, 100), num_q_heads=8, num_kv_heads=2, head_dim=32)
    b = ref.build_batch(spec, seed=2)
    units, _ = build_units(b.meta, 8, 2, 64, 16, threads=2)
    stream = units[:, 1] * 4 < 8  # NQ x 4 query heads a KV head: row-major
    assert stream.sum() == 48 and (~stream).sum() >= 3
    where = np.flatnonzero(stream)
    assert where[0] <= 1 and where[-1] == len(units) - 1  # from the start to the end
    gaps = np.diff(np.flatnonzero(~stream))
    assert gaps.max() - gaps.min() <= 1 + 48 // (~stream).sum()  # evenly spread
    work = units[:, 1] * np.minimum(units[:, 2], units[:, 4] + units[:, 1])
    for kind in (stream, ~stream):
        assert (np.diff(work[kind]) <= 0).all()  # costliest first within a kind
    out = CpuAttention(calibrate=False).attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", (32, 128))
@pytest.mark.parametrize("case", range(2))
def test_isa_path_bfloat16_cache(isa, head_dim, case):
    """bfloat16 caches and queries: widened to float32 in the kernel, output in bfloat16."""
    spec = ref.random_spec(
        40 + case,
        num_q_heads=(2, 8)[case],
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=(16, 32)[case],
        max_prefix=150,
        max_chunk=70,
        prefill_prob=0.0 if case == 0 else 0.6,
        dtype=torch.bfloat16,
    )
    b = ref.build_batch(spec, seed=case)
    backend = CpuAttention(isa, calibrate=False)
    assert backend.supports(b.q, b.k_cache, b.v_cache)
    out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)  # within a bf16 rounding


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", (32, 96, 128))
@pytest.mark.parametrize("ratio", (2, 3, 6))
def test_isa_path_bfloat16_grouped_query_decode(isa, head_dim, ratio):
    """bf16 decode rows of 2, 3 and 6 query heads per KV head (row-major: on vdpbf16ps builds
    P.V pairs keys for up to 4 rows at a time, then the rest), odd key counts, head dims of
    2 and 4 vectors of 16 per step."""
    seqs = tuple(ref.SeqSpec(1, 5 + 11 * i, group=i % 2 if i < 4 else -1) for i in range(9))
    spec = ref.BatchSpec(
        tuple(sorted(seqs, key=lambda s: s.group)), (37, 70), num_q_heads=2 * ratio,
        num_kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16,
    )  # fmt: skip
    b = ref.build_batch(spec, seed=ratio)
    backend = CpuAttention(isa, calibrate=False)
    assert backend.isa == isa
    out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)


BF16_TILE_ISAS = [i for i in ("amx", "avx512bf16") if i in ISAS]


@pytest.mark.skipif(not BF16_TILE_ISAS, reason="CPU without AVX512-BF16")
@pytest.mark.parametrize("isa", BF16_TILE_ISAS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", (1, 4))
def test_bf16_tiles_match_naive_reference(isa, head_dim, ratio):
    """bf16 prefill chunks and group prefixes on AMX tiles (amx) or vdpbf16ps tiles
    (avx512bf16: pairs of dims in Q.K, pairs of keys in P.V): prefixes over a 256-key span and
    ending mid-chunk, NaN in every cache slot not written; within a bf16 rounding of the
    reference; and the bf16 tiles did run them (the avx512 build's float32 products differ)."""
    seed = 60 + HEAD_DIMS.index(head_dim) * 2 + ratio
    spec = ref.random_spec(
        seed,
        num_q_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=(16, 32)[seed % 2],
        max_prefix=600,
        max_chunk=90,
        prefill_prob=0.9,
        dtype=torch.bfloat16,
    )
    b = ref.build_batch(spec, seed=seed)
    args = (b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    out = CpuAttention(isa, calibrate=False).attend(*args)
    want = ref.naive_prefix_shared_attention(*args)
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
    assert not torch.equal(out, CpuAttention("avx512", calibrate=False).attend(*args))


def test_isa_selection(monkeypatch):
    assert build.cpu_isas(frozenset())[-1] == "generic"
    if build.platform.machine() == "x86_64":
        assert build.cpu_isas(frozenset({"avx2", "fma"})) == ("avx2", "generic")
        assert build.cpu_isas(frozenset({"avx2"})) == ("generic",)  # AVX2 without FMA
        avx512 = build.ISA_CPU_FLAGS["avx512"]
        assert build.cpu_isas(avx512)[0] == "avx512"  # no AMX: never the amx build
        assert build.cpu_isas(avx512 | {"avx512_bf16"})[:2] == ("avx512bf16", "avx512")
        assert build.cpu_isas(avx512 | {"amx_tile", "amx_bf16", "avx512_bf16"})[:2] == (
            "amx",
            "avx512bf16",
        )
    assert build.select_isa("auto") == ISAS[0]
    assert build.select_isa("generic") == "generic"
    monkeypatch.setenv(build.ISA_ENV, "generic")
    assert CpuAttention(calibrate=False).isa == "generic"
    monkeypatch.setenv(build.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="BATCHJOB_CPU_ISA"):
        build.select_isa()


def test_batch_kind():
    def kind(seqs, prefixes):
        return calib.batch_kind(ref.build_batch(ref.BatchSpec(tuple(seqs), prefixes)).meta)

    assert kind([ref.SeqSpec(1, 40, group=0)] * 3 + [ref.SeqSpec(1, 9)], (100,)) == "decode"
    assert kind([ref.SeqSpec(30, 30, group=0)] * 2 + [ref.SeqSpec(1, 9)], (100,)) == "prefix"
    assert kind([ref.SeqSpec(64, 64), ref.SeqSpec(1, 90)], ()) == "prefill"
    # a chunk late in a long prompt: judged against torch on a long chunk
    assert kind([ref.SeqSpec(512, 1500), ref.SeqSpec(64, 64)], ()) == "prefill_long"
    assert kind([ref.SeqSpec(512, 900), ref.SeqSpec(64, 64)], ()) == "prefill"


def _decode_batch() -> ref.PagedBatch:
    seqs = tuple(ref.SeqSpec(1, 20 + i, group=i % 2) for i in range(6))
    seqs = tuple(sorted(seqs, key=lambda s: s.group))
    spec = ref.BatchSpec(seqs, (40, 50), num_q_heads=4, num_kv_heads=2, head_dim=32)
    return ref.build_batch(spec, seed=1)


def test_calibration_picks_a_backend_and_reuses_its_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHJOB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv(calib.ENV, "1")
    b = _decode_batch()
    backend = CpuAttention()
    assert backend.calibrate
    out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=3e-5)
    cls = backend.shape_class(b.q, b.k_cache, b.meta)
    assert cls.kind == "decode" and cls.head_dim == 32 and cls.gqa == 2
    files = list(tmp_path.glob("*.calibration.json"))
    assert len(files) == 1 and files[0].stem.startswith(backend.kernel.path.stem)
    doc = json.loads(files[0].read_text())
    got = doc["classes"][cls.key]
    assert got["kernel_ms"] > 0 and got["torch_ms"] > 0
    assert backend.uses_kernel(b.q, b.k_cache, b.v_cache, b.meta) == got["use_kernel"]

    # a new process (fresh in-memory state) reads the file and measures nothing
    monkeypatch.setattr(calib, "_CALIBRATIONS", {})

    def no_measure(_cls):
        raise AssertionError("calibrated again despite the cache")

    again = CpuAttention()
    monkeypatch.setattr(again, "_measure", no_measure)
    assert again.decision(b.q, b.k_cache, b.meta) == calib.Decision(**got)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_cached_decision_routes_the_batch(monkeypatch, tmp_path, use_kernel):
    """Whatever the cache says for the class decides which path computes the batch."""
    monkeypatch.setenv("BATCHJOB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(calib, "_CALIBRATIONS", {})
    b = _decode_batch()
    backend = CpuAttention(calibrate=True)
    cls = backend.shape_class(b.q, b.k_cache, b.meta)
    doc = {
        "cpu": build.cpu_model(),
        "torch": torch.__version__,
        "classes": {cls.key: {"use_kernel": use_kernel, "kernel_ms": 1.0, "torch_ms": 1.0}},
    }
    (tmp_path / f"{backend.kernel.path.stem}.calibration.json").write_text(json.dumps(doc))
    out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    kernel = CpuAttention(calibrate=False).attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch_out = TorchAttention().attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    assert torch.equal(out, kernel if use_kernel else torch_out)
    assert not torch.equal(kernel, torch_out)  # the two paths are distinguishable


def _spin(ms: float):
    """An attend-like callable that burns ``ms`` of this thread's CPU time."""

    def run(*_args):
        end = time.thread_time() + ms / 1e3
        while time.thread_time() < end:
            pass

    return run


@pytest.mark.parametrize(
    ("kernel_ms", "torch_ms", "use_kernel"),
    [(4.0, 5.0, True), (4.1, 4.0, True), (5.0, 4.0, False)],  # a near tie stays the kernel's
)
def test_calibration_picks_torch_only_when_clearly_faster(kernel_ms, torch_ms, use_kernel):
    cls = calib.ShapeClass("generic", 32, 1, 2, 16, "float32", "decode")
    d = calib.measure(cls, _spin(kernel_ms), _spin(torch_ms))
    assert d.use_kernel == use_kernel
    assert d.kernel_ms == pytest.approx(kernel_ms, rel=0.2)
    assert d.torch_ms == pytest.approx(torch_ms, rel=0.2)


def test_calibration_env(monkeypatch):
    monkeypatch.setenv(calib.ENV, "0")
    assert not CpuAttention().calibrate
    monkeypatch.setenv(calib.ENV, "maybe")
    with pytest.raises(ValueError, match=calib.ENV):
        CpuAttention()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", (32, 64, 128))
@pytest.mark.parametrize("with_out", (False, True))
def test_bf16_queries_read_in_place_equal_the_widened_copy(isa, head_dim, with_out):
    """bf16 queries read where the qkv projection left them (a strided view) and the output
    rounded to bf16 in the kernel: bit-equal to widening q to a float32 copy first and rounding
    the float32 output with torch (every unit kind: decode rows, prefixes, prefill tiles)."""
    spec = ref.random_spec(
        80 + head_dim, num_q_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16,
        max_prefix=300, max_chunk=90, prefill_prob=0.5, dtype=torch.bfloat16,
    )  # fmt: skip
    b = ref.build_batch(spec, seed=head_dim)
    t, h, d = b.q.shape
    qkv = torch.randn(t, (h + 4) * d).to(torch.bfloat16)  # q, then k and v of 2 KV heads
    q = qkv[:, : h * d].view(t, h, d)
    q.copy_(b.q)
    backend = CpuAttention(isa, calibrate=False)
    out = torch.full((t, h, d), float("nan"), dtype=torch.bfloat16) if with_out else None
    got = backend.attend(q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert got.dtype == torch.bfloat16 and (out is None or got.data_ptr() == out.data_ptr())
    widened = backend.attend(q.float(), b.k_cache, b.v_cache, b.meta, b.scale)
    assert torch.equal(got, widened.to(torch.bfloat16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("case", range(4))
def test_isa_path_sliding_window(isa, dtype, case):
    """A sliding window on every path of the kernel: decode rows, key-major prefill tiles
    (bf16: vdpbf16ps / AMX), all-head and one-head units, over prefixes of up to 150 keys
    whose earliest keys the window hides from some members and all keys from others (their
    prefix units dropped or, within a tile, a zero partial), windows of one key (the query
    alone) to more than a span. The kernel runs it: no fallback to the torch path."""
    window = (1, 13, 40, 100)[case]
    spec = ref.random_spec(
        60 + case, num_q_heads=(2, 8, 4, 8)[case], num_kv_heads=2, head_dim=(32, 64, 128, 64)[case],
        block_size=(16, 32)[case % 2], min_groups=1, max_prefix=150, max_own=120, max_chunk=70,
        prefill_prob=0.0 if case == 0 else 0.6, dtype=dtype,
    )  # fmt: skip
    b = ref.build_batch(spec, seed=case)
    backend = CpuAttention(isa, calibrate=False)
    assert backend.uses_kernel(b.q, b.k_cache, b.v_cache, b.meta)
    backend.fallback = None  # type: ignore[assignment]  # a fallback would raise
    out = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale, window=window)
    want = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, window)
    tol = 3e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    full = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    assert not torch.allclose(want.float(), full.float(), atol=0.05)  # the window hides keys
