"""TorchAttention against the shared references (kernels/reference.py) on ragged batches."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.backends.native.attention.base import token_positions
from batchjob.backends.native.attention.cpu import CpuAttention
from batchjob.backends.native.attention.registry import get_attention_backend
from batchjob.backends.native.attention.torch_path import TorchAttention, _attention
from batchjob.errors import ConfigError
from batchjob.kernels import reference as ref
from batchjob.kernels.reference import SeqSpec
from batchjob.plan.intmath import cdiv


def case(seqs, groups, bs, hkv, ratio, d=8, seed=0, dtype=torch.float32, **tiles) -> None:
    """``seqs``: SeqSpecs with their own block ids; ``groups``: (prefix_len, block ids) pairs."""
    spec = ref.BatchSpec(
        seqs=tuple(seqs),
        prefix_lens=tuple(p for p, _ in groups),
        prefix_blocks=tuple(tuple(blocks) for _, blocks in groups),
        num_q_heads=hkv * ratio,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=dtype,
    )
    run_case(ref.build_batch(spec, seed), **tiles)


def run_case(
    b: ref.PagedBatch,
    max_scores: int = 1 << 24,
    max_gather: int = 1 << 21,
    window: int | None = None,
) -> None:
    """History in a NaN cache, this step's K/V through write_kv, then attend: against the
    dense float64 reference (which never reads the cache)."""
    bs, slots = b.spec.block_size, b.meta.slot_mapping
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    k_cache[slots // bs, slots % bs] = float("nan")  # this step's K/V: not cached yet
    v_cache[slots // bs, slots % bs] = float("nan")
    backend = TorchAttention(max_scores=max_scores, max_gather=max_gather)
    backend.write_kv(k_cache, v_cache, b.k_new, b.v_new, slots)
    out = backend.attend(b.q, k_cache, v_cache, b.meta, b.scale, window=window)
    # cached plan (next layer)
    again = backend.attend(b.q, k_cache, v_cache, b.meta, b.scale, window=window)
    assert out.shape == b.q.shape and out.dtype == b.spec.dtype
    tol = 1e-5 if b.spec.dtype == torch.float32 else 2e-2
    want = ref.dense_reference(b, window)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert torch.equal(out, again)


class _Blocks:
    def __init__(self, rng: random.Random) -> None:
        self.free = list(range(1, 400))
        rng.shuffle(self.free)

    def take(self, n_tokens: int, bs: int) -> tuple[int, ...]:
        n = cdiv(n_tokens, bs)
        out, self.free = self.free[:n], self.free[n:]
        return tuple(out)


def random_batch(rng: random.Random, bs: int, n_groups: int, n_loose: int, decode_only: bool):
    """Groups in token order with loose sequences between them; half the chunks have no
    history (first chunk of a prompt)."""
    blocks = _Blocks(rng)
    groups: list[tuple[int, tuple[int, ...]]] = []
    seqs: list[SeqSpec] = []

    def seq(group: int) -> SeqSpec:
        q = 1 if decode_only or rng.random() < 0.5 else rng.randint(1, 12)
        kv = q + rng.choice([0, rng.randint(0, 20)])
        return SeqSpec(q, kv, group, blocks.take(kv, bs))

    for gi in range(n_groups):
        p = rng.randint(1, 30)
        groups.append((p, blocks.take(p, bs)))
        seqs += [seq(gi) for _ in range(rng.randint(1, 4))]
    loose = [seq(-1) for _ in range(n_loose)]
    for s in loose:  # interleave loose sequences between groups
        seqs.insert(rng.choice([i for i in range(len(seqs) + 1) if _between_groups(seqs, i)]), s)
    return seqs, groups


def _between_groups(seqs: list[SeqSpec], i: int) -> bool:
    return i in (0, len(seqs)) or seqs[i - 1].group != seqs[i].group or seqs[i].group < 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    bs=st.sampled_from([1, 4, 16]),
    hkv=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2, 4]),
    n_groups=st.integers(0, 3),
    n_loose=st.integers(0, 3),
    decode_only=st.booleans(),
    tiny_tiles=st.booleans(),
)
def test_random_batches_match_dense(
    seed, bs, hkv, ratio, n_groups, n_loose, decode_only, tiny_tiles
):
    seqs, groups = random_batch(
        random.Random(seed), bs, n_groups, max(n_loose, int(n_groups == 0)), decode_only
    )
    tiny = dict(max_scores=64, max_gather=64) if tiny_tiles else {}  # many calls and segments
    case(seqs, groups, bs, hkv, ratio, seed=seed, **tiny)


def test_empty_group_list_chunked_prefill_and_decodes():
    bs = 4
    seqs = [  # a prefill chunk in the middle of a prompt, a first chunk, decodes
        SeqSpec(5, 11, blocks=(3, 7, 9)),
        SeqSpec(6, 6, blocks=(1, 2)),
        SeqSpec(1, 9, blocks=(4, 5, 6)),
        SeqSpec(1, 1, blocks=(8,)),
    ]
    case(seqs, [], bs, hkv=2, ratio=2)


def test_group_of_one_prefix_ending_mid_block():
    bs = 4
    groups = [(6, (2, 5))]  # 6 tokens: ends mid-block
    seqs = [SeqSpec(3, 3, blocks=(7,)), SeqSpec(1, 5, blocks=(9, 10))]
    case(seqs, groups, bs, hkv=1, ratio=4)
    case([SeqSpec(3, 3, 0, (7,))], groups, bs, hkv=1, ratio=4)


def test_group_members_decode_together_with_loose_prefill():
    bs = 16
    groups = [(40, (1, 2, 3)), (17, (4, 5))]
    seqs = [
        SeqSpec(7, 30, -1, (20, 21)),
        SeqSpec(1, 5, 0, (10,)),
        SeqSpec(1, 9, 0, (11,)),
        SeqSpec(4, 4, 0, (12,)),
        SeqSpec(1, 18, 1, (13, 14)),
        SeqSpec(1, 2, -1, (15,)),
    ]
    for ratio in (1, 2, 4):
        case(seqs, groups, bs, hkv=2, ratio=ratio)


def test_group_without_queries_in_batch_is_ignored():
    groups = [(5, (1, 2)), (3, (3,))]
    case([SeqSpec(2, 4, 1, (4,))], groups, 4, hkv=2, ratio=2)


def test_bfloat16_cache():
    seqs, groups = random_batch(random.Random(3), 4, 2, 2, False)
    case(seqs, groups, 4, hkv=2, ratio=2, dtype=torch.bfloat16)


def test_backend_selection():
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttention)
    auto = get_attention_backend("auto", "cpu")  # the C kernel where it builds
    assert auto.name == ("cpu" if CpuAttention().available else "torch")
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttention)
    with pytest.raises(ConfigError, match="CPU only"):
        get_attention_backend("cpu", "cuda")
    with pytest.raises(ConfigError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")
    with pytest.raises(ConfigError, match="triton"):
        get_attention_backend("triton", "cpu")


@pytest.mark.parametrize("seed", range(12))
def test_matches_shared_naive_reference(seed):
    """The paged naive reference on random_spec batches (shuffled group order, NaN free
    slots), and the dense one on the same batches through write_kv."""
    ratio = (1, 2, 4)[seed % 3]
    spec = ref.random_spec(
        seed,
        num_q_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=32,
        block_size=(4, 16)[seed % 2],
        prefill_prob=0.0 if seed % 4 < 2 else 0.5,  # decode-only batches too
    )
    b = ref.build_batch(spec, seed=seed)
    out = TorchAttention().attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    expected = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    run_case(b)


@pytest.mark.parametrize("seed", range(12))
def test_sliding_window_matches_references(seed):
    """A sliding window shorter than the batch's sequences (prefixes of up to 70 tokens, own
    KV up to 40): keys before it hidden from decodes, prefill chunks and the group prefix,
    whose earliest keys some members' queries no longer see at all; the paged naive
    reference and the dense one agree."""
    window = (1, 5, 17, 33, 64)[seed % 5]
    spec = ref.random_spec(
        seed, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=(4, 16)[seed % 2],
        min_groups=1, prefill_prob=0.0 if seed % 4 < 2 else 0.5,
    )  # fmt: skip
    b = ref.build_batch(spec, seed=seed)
    out = TorchAttention().attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale, window=window)
    expected = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    full = ref.naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    hides = int(token_positions(b.meta).max()) >= window  # a query past the window
    assert hides == (not torch.allclose(out, full, atol=1e-3))
    run_case(b, window=window)
    run_case(b, max_scores=64, max_gather=64, window=window)  # many calls and segments


@pytest.mark.parametrize("causal", [False, True])
def test_fused_cpu_kernel_matches_dense_path(causal):
    """The dense path (non-CPU devices) and the CPU flash kernel agree, masks and LSE too."""
    gen = torch.Generator().manual_seed(1)
    b, h, nq, nk, d = 3, 2, 5, 9 if not causal else 5, 16
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for n in (nq, nk, nk))
    mask = None
    if not causal:  # per-batch key padding, as for decodes
        kl = torch.tensor([9, 4, 1])
        mask = torch.zeros(b, 1, 1, nk).masked_fill(
            torch.arange(nk) >= kl[:, None, None, None], -math.inf
        )
    got = _attention(q, k, v, mask, causal, 0.3, fused=True)
    want = _attention(q, k, v, mask, causal, 0.3, fused=False)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
