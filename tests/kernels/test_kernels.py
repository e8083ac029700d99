"""Triton kernels vs the naive reference (Triton's interpreter on CPU, the real thing on CUDA).

Without CUDA every test here runs with TRITON_INTERPRET=1 (set per test, then restored, so
other modules see the environment they expect). Triton reads the variable when it is first
imported, and importing batchjob.kernels does not import triton, so the first kernel test
imports it in interpreter mode. If something imported triton earlier in this process without
the variable, these tests are skipped and test_rerun_in_fresh_process runs this file in a
fresh process with TRITON_INTERPRET=1 instead.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from batchjob.backends.native.attention.triton import TritonAttention
from batchjob.kernels.reference import (
    BatchSpec,
    PagedBatch,
    SeqSpec,
    build_batch,
    naive_prefix_shared_attention,
    naive_write_kv,
    random_spec,
)
from batchjob.kernels.triton import (
    Workspace,
    cascade_prefix_attention,
    fused_prefix_attention,
    plain_paged_attention,
    plan_attention,
    unshare_kv,
    write_kv,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _triton_compiled_mode() -> bool:
    """Was triton already imported here without the interpreter?"""
    tl = sys.modules.get("triton.language")
    return tl is not None and type(tl.zeros).__name__ != "InterpretedFunction"


NO_KERNEL_LAUNCH = {"test_kernels_compile_for_sm90_without_spills", "test_rerun_in_fresh_process"}


@pytest.fixture(autouse=True)
def _interpret_on_cpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if CUDA or request.node.originalname in NO_KERNEL_LAUNCH:
        return
    if _triton_compiled_mode():
        pytest.skip(
            "triton was imported without TRITON_INTERPRET=1; see test_rerun_in_fresh_process"
        )
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def run_variant(variant: str, b: PagedBatch) -> torch.Tensor:
    if variant == "fused":
        return fused_prefix_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    if variant == "cascade":
        return cascade_prefix_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    return plain_paged_attention(b.q, unshare_kv(b.meta, b.k_cache, b.v_cache), b.scale)


def check(b: PagedBatch, out: torch.Tensor) -> None:
    ref = naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    tol = TOL[b.q.dtype]
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


VARIANTS = ["fused", "cascade", "plain"]

# (seed, dtype, head_dim, Hq, Hkv, block_size, extra random_spec options)
RANDOM_CASES = [
    (0, F32, 64, 4, 2, 16, {"min_groups": 2, "max_groups": 2, "max_members": 3, "max_chunk": 12}),
    (1, F16, 80, 4, 4, 16, {"min_groups": 1, "max_groups": 2}),
    (2, BF16, 96, 8, 2, 32, {"min_groups": 1, "max_groups": 2}),
    (3, F16, 128, 8, 1, 16, {"min_groups": 1, "max_prefix": 40, "max_members": 3}),
    (4, F32, 64, 6, 2, 32, {"min_groups": 1}),  # GQA 3: padded to 4 rows per token
    (5, BF16, 64, 7, 1, 16, {"min_groups": 1, "max_groups": 1}),  # GQA 7
    (6, F16, 64, 2, 2, 16, {"min_groups": 1, "max_members": 6, "prefill_prob": 0.0}),  # decode
    (9, F32, 64, 4, 1, 32, {"min_groups": 1, "max_groups": 1, "max_members": 2, "max_chunk": 40,
                            "prefill_prob": 1.0}),  # long chunks: many own tiles, causal band
]  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "case", RANDOM_CASES, ids=lambda c: f"s{c[0]}-{c[1]}-d{c[2]}-{c[3]}x{c[4]}-b{c[5]}"
)
def test_random_batches(variant: str, case: tuple) -> None:
    seed, dtype, d, hq, hkv, bs, extra = case
    spec = random_spec(
        seed, dtype=dtype, head_dim=d, num_q_heads=hq, num_kv_heads=hkv, block_size=bs, **extra
    )
    b = build_batch(spec, seed, DEVICE)
    check(b, run_variant(variant, b))


def spec_of(seqs: list[SeqSpec], prefix_lens: tuple[int, ...], **kw) -> BatchSpec:
    return BatchSpec(seqs=tuple(seqs), prefix_lens=prefix_lens, **kw)


EDGE_CASES = {
    # one group, all decodes, prefix ending mid-block; one member with only its new token
    "decode-share-all": spec_of([SeqSpec(1, n, 0) for n in (1, 5, 17, 2, 33)], (37,)),
    "group-of-one": spec_of([SeqSpec(1, 4, 0), SeqSpec(5, 9)], (21,)),
    "no-groups": spec_of([SeqSpec(1, 20), SeqSpec(7, 7), SeqSpec(3, 40)], ()),
    # a group prefix being prefilled (ungrouped; a later chunk: kv_len > q_len) beside members
    "prefix-chunk-and-members": spec_of(
        [SeqSpec(19, 35), SeqSpec(3, 3, 0), SeqSpec(1, 12, 0)], (16,)
    ),
    "empty-prefix-and-memberless-group": spec_of([SeqSpec(2, 6, 0), SeqSpec(1, 3, 0)], (0, 9)),
    "aligned-prefixes": spec_of(
        [SeqSpec(1, 3, 1), SeqSpec(4, 8, 1), SeqSpec(1, 1, 0)], (32, 16), block_size=16
    ),
    "block-size-1": spec_of([SeqSpec(2, 5, 0), SeqSpec(1, 2, 0)], (3,), block_size=1),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases(variant: str, name: str) -> None:
    b = build_batch(EDGE_CASES[name], 11, DEVICE)
    check(b, run_variant(variant, b))


@pytest.mark.parametrize("variant", ["fused", "cascade"])
@pytest.mark.parametrize("split_len", [7, 16, 40])
def test_prefix_split_into_pieces(variant: str, split_len: int) -> None:
    """Long prefixes cut into pieces (one program each); the last finisher merges them all."""
    spec = random_spec(13, min_groups=2, max_groups=3, max_prefix=90, max_chunk=6)
    b = build_batch(spec, 13, DEVICE)
    fn = fused_prefix_attention if variant == "fused" else cascade_prefix_attention
    args = (b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    check(b, fn(*args, split_len=split_len))


@pytest.mark.parametrize(
    "config",
    [
        {"BLOCK_M_P": 32, "BLOCK_N_P": 64, "BLOCK_M_O": 16, "BLOCK_N_O": 32},
        {"BLOCK_M_P": 16, "BLOCK_N_P": 32, "BLOCK_M_O": 64, "BLOCK_N_O": 64},
    ],
)
def test_fused_other_tiles(config: dict[str, int]) -> None:
    """Tiles spanning several KV blocks, and tiles of several tokens x GQA heads."""
    spec = random_spec(12, block_size=8, min_groups=1, max_groups=2, max_chunk=24)
    b = build_batch(spec, 12, DEVICE)
    check(b, fused_prefix_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, config=config))


class _LaunchSpy:
    """Stands in for a @triton.jit kernel: records each launch's keywords, then launches."""

    def __init__(self, kernel, calls: list[dict]) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(kw)
            return self.kernel[grid](*args, **kw)

        return launch


@pytest.mark.parametrize("variant", ["fused", "cascade"])
def test_first_config_without_autotune(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BATCHJOB_TRITON_AUTOTUNE=0 launches each kernel's first autotune config (here under the
    interpreter too: its large tiles on CPU), and the result still matches the reference."""
    from batchjob.kernels.triton.checks import jit_module
    from batchjob.kernels.triton.wrappers import first_config

    mod = jit_module("attention_kernels")
    calls: list[dict] = []
    for name in ("fused_kernel", "prefix_kernel", "own_kernel"):
        monkeypatch.setattr(mod, name, _LaunchSpy(getattr(mod, name), calls))
    monkeypatch.setenv("BATCHJOB_TRITON_AUTOTUNE", "0")
    spec = random_spec(
        7, num_q_heads=8, num_kv_heads=2, min_groups=1, max_groups=2, max_chunk=24
    )  # fmt: skip
    b = build_batch(spec, 7, DEVICE)
    check(b, run_variant(variant, b))
    tuned = (
        ["fused_kernel_tuned"]
        if variant == "fused"
        else ["prefix_kernel_tuned", "own_kernel_tuned"]
    )
    want = [first_config(getattr(mod, t)) for t in tuned]  # tiles, warps, stages
    assert [{k: c[k] for k in w} for c, w in zip(calls, want, strict=True)] == want


def test_strided_q_and_out() -> None:
    """q sliced from a packed qkv projection (row stride > Hq * D), out a view as well."""
    b = build_batch(random_spec(21, min_groups=1, max_groups=1, max_chunk=8), 21, DEVICE)
    t, hq, d = b.q.shape
    qkv = torch.randn(t, hq + 4, d, device=DEVICE)
    qkv[:, :hq] = b.q
    out_buf = torch.zeros(t, hq + 1, d, device=DEVICE)
    strided = dataclasses.replace(b, q=qkv[:, :hq])
    out = fused_prefix_attention(
        strided.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out_buf[:, 1:]
    )
    assert out.data_ptr() == out_buf[:, 1:].data_ptr()
    check(b, out)


def test_workspace_reuse_leaves_counters_zero() -> None:
    ws = Workspace()
    for seed in (30, 31, 32):
        b = build_batch(random_spec(seed, min_groups=1, max_groups=2, max_chunk=8), seed, DEVICE)
        args = (b.q, b.k_cache, b.v_cache, b.meta, b.scale)
        check(b, fused_prefix_attention(*args, workspace=ws, split_len=(None, 8, 20)[seed - 30]))
        assert int(ws._cnt.abs().sum()) == 0


@pytest.mark.parametrize("variant", ["auto", "fused", "cascade"])
def test_backend_write_then_attend(variant: str) -> None:
    spec = random_spec(40, dtype=F16, num_q_heads=8, num_kv_heads=2, max_groups=2, max_chunk=8)
    b = build_batch(spec, 40, DEVICE)
    backend = TritonAttention(variant)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    slots = b.meta.slot_mapping
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = float("nan")  # this step's K/V not written yet
    v_cache[slots // bs, slots % bs] = float("nan")
    backend.write_kv(k_cache, v_cache, b.k_new, b.v_new, slots)
    torch.testing.assert_close(k_cache, b.k_cache, equal_nan=True, atol=0, rtol=0)
    for _ in range(2):  # the second call reuses the per-batch plan
        check(b, backend.attend(b.q, k_cache, v_cache, b.meta, b.scale))
    out = torch.full_like(b.q, float("nan"))  # an output buffer of the caller's
    assert backend.attend(b.q, k_cache, v_cache, b.meta, b.scale, out=out) is out
    check(b, out)
    # the next layer's q of another layout: a plan of its own, the same result
    q2 = torch.cat([b.q, b.q], dim=-1)[..., : b.q.shape[-1]]  # a strided view of the same q
    check(b, backend.attend(q2, k_cache, v_cache, b.meta, b.scale))
    plan = plan_attention(b.q, k_cache, v_cache, b.meta, b.scale)
    with pytest.raises(ValueError, match="differ in shape"):
        plan.run(b.q[:, :4], k_cache, v_cache)  # not the q it was checked with
    # a second write of the batch skips the checks, a write of another batch does not
    backend.write_kv(k_cache, v_cache, b.k_new, b.v_new, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        backend.write_kv(k_cache, v_cache, b.k_new, b.v_new, slots[:-1].clone())


def test_engine_selects_triton_and_agrees_with_torch_backend() -> None:
    from batchjob.backends.native.attention.registry import get_attention_backend
    from batchjob.backends.native.attention.torch_path import TorchAttention

    backend = get_attention_backend("triton", DEVICE)
    assert isinstance(backend, TritonAttention) and backend.name == "triton"
    b = build_batch(random_spec(50, dtype=F16, min_groups=1, max_chunk=8), 50, DEVICE)
    want = TorchAttention().attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    got = backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(got, want, atol=TOL[F16], rtol=TOL[F16])


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_write_kv_matches_naive(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(5, 4, 3, 80, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(5, 4, 3, 80, generator=gen).to(dtype).to(DEVICE)
    kv = torch.randn(6, 7, 80, generator=gen).to(dtype).to(DEVICE)
    k, v = kv[:, :3], kv[:, 3:6]  # strided rows, as sliced from a qkv projection
    slots = torch.tensor([0, 19, 7, -1, 4, 13], device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    naive_write_kv(want_k, want_v, k, v, slots)
    write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_write_kv_casts_to_the_cache_dtype() -> None:
    k_cache = torch.zeros(2, 4, 2, 16, dtype=F16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 16, device=DEVICE)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([0, 5, 7], device=DEVICE))
    assert torch.equal(k_cache[1, 1], k[1].half()) and torch.equal(v_cache[1, 3], -k[2].half())


def test_unshare_kv_references_or_copies() -> None:
    aligned = build_batch(EDGE_CASES["aligned-prefixes"], 0, DEVICE)
    ub = unshare_kv(aligned.meta, aligned.k_cache, aligned.v_cache)
    assert not ub.copied and ub.k_cache is aligned.k_cache
    assert ub.kv_len.tolist() == [16 + 3, 16 + 8, 32 + 1]
    mid = build_batch(EDGE_CASES["decode-share-all"], 0, DEVICE)
    ub = unshare_kv(mid.meta, mid.k_cache, mid.v_cache)
    assert ub.copied and ub.k_cache.shape[0] > mid.k_cache.shape[0]


# ---- validation: clear ValueErrors before any launch ------------------------------------------


@pytest.fixture(scope="module")
def small() -> PagedBatch:
    return build_batch(spec_of([SeqSpec(1, 3, 0), SeqSpec(2, 2)], (5,)), 0, DEVICE)


def _with_meta(b: PagedBatch, **changes) -> PagedBatch:
    return dataclasses.replace(b, meta=dataclasses.replace(b.meta, **changes))


BAD_INPUTS = {
    "q-2d": (lambda b: dataclasses.replace(b, q=b.q[:, 0]), "q must be"),
    "dtype-mismatch": (lambda b: dataclasses.replace(b, q=b.q.half()), "share a dtype"),
    "float64": (
        lambda b: dataclasses.replace(
            b, q=b.q.double(), k_cache=b.k_cache.double(), v_cache=b.v_cache.double()
        ),
        "not supported",
    ),
    "q-last-dim-strided": (
        lambda b: dataclasses.replace(b, q=b.q.repeat_interleave(2, -1)[..., ::2]),
        "contiguous in its last",
    ),
    "heads-not-multiple": (lambda b: dataclasses.replace(b, q=b.q[:, :3]), "multiple of kv"),
    "head-dim-mismatch": (lambda b: dataclasses.replace(b, q=b.q[..., :32]), "head dim"),
    "cu_q-int64": (lambda b: _with_meta(b, cu_q=b.meta.cu_q.long()), "cu_q must be torch.int32"),
    "slot-int32": (
        lambda b: _with_meta(b, slot_mapping=b.meta.slot_mapping.int()),
        "slot_mapping must be torch.int64",
    ),
    "seq_group-length": (
        lambda b: _with_meta(b, seq_group=b.meta.seq_group[:1]),
        "seq_group has 1 entries",
    ),
    "group-arrays-length": (
        lambda b: _with_meta(b, group_q_end=b.meta.group_q_end.repeat(2)),
        "group_q_end has 2",
    ),
    "meta-device": (
        lambda b: _with_meta(b, kv_len=torch.empty(2, dtype=torch.int32, device="meta")),
        "is on meta",
    ),
    "block-table-1d": (
        lambda b: _with_meta(b, block_table=b.meta.block_table[:, 0]),
        "block_table must have 2",
    ),
    "bad-scale": (lambda b: dataclasses.replace(b, scale=float("nan")), "scale must be"),
}


@pytest.mark.parametrize("variant", ["fused", "cascade"])
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_validation_errors(small: PagedBatch, variant: str, name: str) -> None:
    mutate, message = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=message):
        run_variant(variant, mutate(small))


def test_out_must_match_q(small: PagedBatch) -> None:
    with pytest.raises(ValueError, match="out must match q"):
        fused_prefix_attention(
            small.q, small.k_cache, small.v_cache, small.meta, 1.0, out=small.q[:1]
        )


def test_auto_variant_is_fused_for_decode_only_batches_and_cascade_with_prefill_chunks() -> None:
    from batchjob.kernels.triton.wrappers import choose_variant

    for seed in range(50, 58):
        b = build_batch(random_spec(seed, max_groups=2, max_chunk=8), seed, DEVICE)
        want = "cascade" if int((b.meta.cu_q[1:] - b.meta.cu_q[:-1]).max()) > 1 else "fused"
        assert choose_variant(b.meta) == want
    decode = build_batch(random_spec(58, max_groups=2, max_chunk=1), 58, DEVICE)
    assert decode.meta.max_q_len == 1 and choose_variant(decode.meta) == "fused"


def test_unknown_backend_variant() -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        TritonAttention("split")


@pytest.mark.skipif(CUDA, reason="checks the CPU-without-interpreter message")
def test_cpu_without_interpreter_is_refused(
    small: PagedBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fused_prefix_attention(small.q, small.k_cache, small.v_cache, small.meta, 1.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (lambda k, v, s: (k[:, :1], v, s), "k and v must both be"),
        (lambda k, v, s: (k, v, s.int()), "slot_mapping must be torch.int64"),
        (lambda k, v, s: (k, v, s[:2]), "slot_mapping has 2 entries"),
        (lambda k, v, s: (k.half(), v, s), "dtypes"),
        (lambda k, v, s: (k.double(), v.double(), s), "not supported"),
        (lambda k, v, s: (k[..., :8], v[..., :8], s), "do not fit cache rows"),
    ],
)
def test_write_kv_validation(args, message: str) -> None:
    k_cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    k = torch.ones(3, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match=message):
        write_kv(k_cache, k_cache.clone(), *args(k, k.clone(), slots))


# ---- compiled for a real GPU target (no GPU needed: Triton's bundled ptxas) --------------------


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    """Interpreter runs skip the compiler; compile the real thing for sm_90 in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "batchjob.kernels.triton.aot_check", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SPILLS" not in proc.stdout, proc.stdout


# ---- GPU only -------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_large_mixture(dtype: torch.dtype, variant: str) -> None:
    spec = random_spec(
        99, dtype=dtype, head_dim=128, num_q_heads=32, num_kv_heads=8, max_groups=6,
        max_members=40, max_ungrouped=20, max_prefix=1500, max_own=700, max_chunk=300,
    )  # fmt: skip
    b = build_batch(spec, 99, DEVICE)
    check(b, run_variant(variant, b))


# ---- fallback when triton was imported in compiled mode before this module ran ---------------


@pytest.mark.skipif(CUDA, reason="CUDA runs the kernels in-process")
def test_rerun_in_fresh_process() -> None:
    if not _triton_compiled_mode():
        pytest.skip("the in-process interpreter runs cover this module")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
