"""TorchAttention against a dense causal reference on random ragged prefix-shared batches."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.backends.native.attention.cpu import CpuAttention
from batchjob.backends.native.attention.meta import AttentionMetadata
from batchjob.backends.native.attention.registry import get_attention_backend
from batchjob.backends.native.attention.torch_path import TorchAttention, _attention
from batchjob.errors import ConfigError


@dataclass
class SeqSpec:
    q_len: int  # query tokens this step
    kv_len: int  # own KV length, this step's tokens included
    blocks: list[int] = field(default_factory=list)  # own KV blocks
    group: int = -1  # index into the batch's groups


@dataclass
class GroupSpec:
    prefix_len: int
    blocks: list[int]


def build_meta(seqs: list[SeqSpec], groups: list[GroupSpec], block_size: int) -> AttentionMetadata:
    """Metadata for ``seqs`` (members of a group contiguous) in the order given."""
    i32 = torch.int32
    q_lens = [s.q_len for s in seqs]
    cu_q = [0]
    for n in q_lens:
        cu_q.append(cu_q[-1] + n)
    width = max([len(s.blocks) for s in seqs] + [1])
    block_table = torch.zeros(len(seqs), width, dtype=i32)  # padding: block 0, any valid id
    slots = []
    for i, s in enumerate(seqs):
        block_table[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=i32)
        for pos in range(s.kv_len - s.q_len, s.kv_len):
            slots.append(s.blocks[pos // block_size] * block_size + pos % block_size)
    starts, ends = [0] * len(groups), [0] * len(groups)
    for gi in range(len(groups)):
        members = [i for i, s in enumerate(seqs) if s.group == gi]
        if members:
            assert members == list(range(members[0], members[-1] + 1)), "members not contiguous"
            starts[gi], ends[gi] = cu_q[members[0]], cu_q[members[-1] + 1]
    p_width = max([len(g.blocks) for g in groups] + [1])
    prefix_table = torch.zeros(len(groups), p_width, dtype=i32)
    for gi, g in enumerate(groups):
        prefix_table[gi, : len(g.blocks)] = torch.tensor(g.blocks, dtype=i32)
    return AttentionMetadata(
        cu_q=torch.tensor(cu_q, dtype=i32),
        kv_len=torch.tensor([s.kv_len for s in seqs], dtype=i32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_group=torch.tensor([s.group for s in seqs], dtype=i32),
        prefix_len=torch.tensor([g.prefix_len for g in groups], dtype=i32),
        prefix_block_table=prefix_table,
        group_q_start=torch.tensor(starts, dtype=i32),
        group_q_end=torch.tensor(ends, dtype=i32),
        max_q_len=max(q_lens, default=0),
        max_kv_len=max((s.kv_len for s in seqs), default=0),
        max_prefix_len=max((g.prefix_len for g in groups), default=0),
    )


def _slots(blocks: list[int], n: int, bs: int) -> list[int]:
    return [blocks[p // bs] * bs + p % bs for p in range(n)]


def run_case(
    seqs,
    groups,
    bs,
    hkv,
    ratio,
    d=8,
    seed=0,
    max_scores=1 << 24,
    dtype=torch.float32,
    max_gather=1 << 21,
):
    """Fill a NaN cache with history, run write_kv + attend, compare with a dense reference."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = max(
        [b for s in seqs for b in s.blocks] + [b for g in groups for b in g.blocks] + [0]
    )
    k_cache = torch.full((n_blocks + 1, bs, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    prefix_kv, own_kv = [], []
    for g in groups:  # prefix KV already in the cache
        kv = torch.randn(2, g.prefix_len, hkv, d, generator=gen).to(dtype)
        idx = torch.tensor(_slots(g.blocks, g.prefix_len, bs), dtype=torch.long)
        kf[idx], vf[idx] = kv[0], kv[1]
        prefix_kv.append(kv)
    for s in seqs:  # own history already cached; this step's tokens come through write_kv
        kv = torch.randn(2, s.kv_len, hkv, d, generator=gen).to(dtype)
        hist = s.kv_len - s.q_len
        idx = torch.tensor(_slots(s.blocks, hist, bs), dtype=torch.long)
        kf[idx], vf[idx] = kv[0, :hist], kv[1, :hist]
        own_kv.append(kv)
    meta = build_meta(seqs, groups, bs)
    t, h = sum(s.q_len for s in seqs), hkv * ratio
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    new_k = torch.cat(
        [kv[0, s.kv_len - s.q_len :] for kv, s in zip(own_kv, seqs, strict=True)] or [q[:0, :hkv]]
    )
    new_v = torch.cat(
        [kv[1, s.kv_len - s.q_len :] for kv, s in zip(own_kv, seqs, strict=True)] or [q[:0, :hkv]]
    )
    backend = TorchAttention(max_scores=max_scores, max_gather=max_gather)
    backend.write_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping)
    scale = d**-0.5
    out = backend.attend(q, k_cache, v_cache, meta, scale)
    again = backend.attend(q, k_cache, v_cache, meta, scale)  # cached plan (next layer)
    assert out.shape == (t, h, d) and out.dtype == dtype
    ref = _dense_reference(q, seqs, prefix_kv, own_kv, scale, ratio)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert torch.equal(out, again)


def _dense_reference(q, seqs, prefix_kv, own_kv, scale, ratio) -> torch.Tensor:
    """Per sequence: full KV = prefix ++ own, causal over own positions, float64 softmax."""
    out, start = [], 0
    for s, kv in zip(seqs, own_kv, strict=True):
        k, v = kv[0].double(), kv[1].double()  # [kv_len, Hkv, D]
        p = 0
        if s.group >= 0:
            pk = prefix_kv[s.group].double()
            p = pk.shape[1]
            k, v = torch.cat([pk[0], k]), torch.cat([pk[1], v])
        k = k.repeat_interleave(ratio, dim=1)  # [P + kv_len, H, D]
        v = v.repeat_interleave(ratio, dim=1)
        qs = q[start : start + s.q_len].double()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = p + s.kv_len - s.q_len + torch.arange(s.q_len)
        mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]  # [q_len, P + kv_len]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += s.q_len
    return torch.cat(out) if out else q.double()[:0]


class _Blocks:
    def __init__(self, rng: random.Random) -> None:
        self.free = list(range(1, 400))
        rng.shuffle(self.free)

    def take(self, n_tokens: int, bs: int) -> list[int]:
        n = -(-n_tokens // bs)
        out, self.free = self.free[:n], self.free[n:]
        return out


def random_batch(rng: random.Random, bs: int, n_groups: int, n_loose: int, decode_only: bool):
    blocks = _Blocks(rng)
    groups, seqs = [], []

    def seq(group: int) -> SeqSpec:
        q = 1 if decode_only or rng.random() < 0.5 else rng.randint(1, 12)
        kv = q + rng.choice([0, rng.randint(0, 20)])
        return SeqSpec(q, kv, blocks.take(kv, bs), group)

    for gi in range(n_groups):
        p = rng.randint(1, 30)
        groups.append(GroupSpec(p, blocks.take(p, bs)))
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
    run_case(seqs, groups, bs, hkv, ratio, seed=seed, **tiny)


def test_empty_group_list_chunked_prefill_and_decodes():
    bs = 4
    seqs = [  # a prefill chunk in the middle of a prompt, a first chunk, decodes
        SeqSpec(5, 11, [3, 7, 9]),
        SeqSpec(6, 6, [1, 2]),
        SeqSpec(1, 9, [4, 5, 6]),
        SeqSpec(1, 1, [8]),
    ]
    run_case(seqs, [], bs, hkv=2, ratio=2)


def test_group_of_one_prefix_ending_mid_block():
    bs = 4
    groups = [GroupSpec(6, [2, 5])]  # 6 tokens: ends mid-block
    run_case([SeqSpec(3, 3, [7]), SeqSpec(1, 5, [9, 10])], groups, bs, hkv=1, ratio=4)
    run_case([SeqSpec(3, 3, [7], group=0)], groups, bs, hkv=1, ratio=4)


def test_group_members_decode_together_with_loose_prefill():
    bs = 16
    groups = [GroupSpec(40, [1, 2, 3]), GroupSpec(17, [4, 5])]
    seqs = [
        SeqSpec(7, 30, [20, 21], -1),
        SeqSpec(1, 5, [10], 0),
        SeqSpec(1, 9, [11], 0),
        SeqSpec(4, 4, [12], 0),
        SeqSpec(1, 18, [13, 14], 1),
        SeqSpec(1, 2, [15], -1),
    ]
    for ratio in (1, 2, 4):
        run_case(seqs, groups, bs, hkv=2, ratio=ratio)


def test_group_without_queries_in_batch_is_ignored():
    groups = [GroupSpec(5, [1, 2]), GroupSpec(3, [3])]
    run_case([SeqSpec(2, 4, [4], 1)], groups, 4, hkv=2, ratio=2)


def test_bfloat16_cache():
    seqs, groups = random_batch(random.Random(3), 4, 2, 2, False)
    run_case(seqs, groups, 4, hkv=2, ratio=2, dtype=torch.bfloat16)


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
    """Cross-check with the kernels' reference batches (shuffled group order, NaN free slots)."""
    from batchjob.kernels import reference as ref

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
