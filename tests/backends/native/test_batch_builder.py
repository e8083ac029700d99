"""The numpy batch builder (``build_batch``) against a per-sequence reference builder written
out here (Python, one chunk at a time, each array filled as its definition reads), on random
scheduler outputs and on every iteration of real scheduler runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.backends.native.attention.meta import AttentionMetadata
from batchjob.backends.native.batch_builder import (
    ModelBatch,
    SeqAdapters,
    build_batch,
    lora_tokens,
    upload,
)
from batchjob.backends.native.kv_cache import KVLayout
from batchjob.backends.native.scheduler.output import (
    ScheduledChunk,
    ScheduledPrefix,
    SchedulerOutput,
    prefix_seq_id,
)
from batchjob.backends.native.scheduler.registry import make_scheduler
from batchjob.config import SchedulerConfig
from batchjob.plan.build import build_plan
from batchjob.testing.workloads import make_workload
from batchjob.tokenize.prompts import TokenizedPrompts


def _reference_pad(tables: list[np.ndarray]) -> np.ndarray:
    """Stack ragged int32 block tables into [N, max_len], padding with block 0."""
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


def _reference_build(out: SchedulerOutput, block_size: int, device: torch.device) -> ModelBatch:
    """The reference: every array built in Python, one sequence's chunk at a time."""
    chunks = out.chunks
    lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
    cu_q = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu_q[1:])
    kv_start = np.fromiter((c.kv_start for c in chunks), dtype=np.int64, count=len(chunks))
    pos_start = np.fromiter((c.position_start for c in chunks), dtype=np.int64, count=len(chunks))

    input_ids = np.concatenate([c.token_ids for c in chunks]).astype(np.int64)
    # per token: offset within its chunk, then own-KV and absolute positions
    seq_of_token = np.repeat(np.arange(len(chunks)), lens)
    within = np.arange(len(input_ids)) - cu_q[:-1][seq_of_token]
    own_pos = kv_start[seq_of_token] + within
    positions = pos_start[seq_of_token] + within

    block_table = _reference_pad([c.block_table for c in chunks])
    slot_mapping = (
        block_table[seq_of_token, own_pos // block_size].astype(np.int64) * block_size
        + own_pos % block_size
    )

    group_index = {p.group: i for i, p in enumerate(out.prefixes)}
    seq_group = np.array([group_index.get(c.group, -1) for c in chunks], dtype=np.int32)
    num_groups = len(out.prefixes)
    group_q_start = np.full(num_groups, np.iinfo(np.int32).max, dtype=np.int64)
    group_q_end = np.zeros(num_groups, dtype=np.int64)
    member = seq_group >= 0
    if member.any():
        np.minimum.at(group_q_start, seq_group[member], cu_q[:-1][member])
        np.maximum.at(group_q_end, seq_group[member], cu_q[1:][member])
    group_q_start = np.minimum(group_q_start, group_q_end)  # groups with no query (not expected)
    prefix_len = np.array([p.prefix_len for p in out.prefixes], dtype=np.int32)

    kv_len = kv_start + lens
    sampling = [i for i, c in enumerate(chunks) if c.samples]

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        cu_q=t(cu_q, torch.int32),
        kv_len=t(kv_len, torch.int32),
        block_table=t(block_table, torch.int32),
        slot_mapping=t(slot_mapping, torch.int64),
        seq_group=t(seq_group, torch.int32),
        prefix_len=t(prefix_len, torch.int32),
        prefix_block_table=t(_reference_pad([p.block_table for p in out.prefixes]), torch.int32)[
            :num_groups
        ],
        group_q_start=t(group_q_start, torch.int32),
        group_q_end=t(group_q_end, torch.int32),
        max_q_len=int(lens.max(initial=0)),
        max_kv_len=int(kv_len.max(initial=0)),
        max_prefix_len=int(prefix_len.max(initial=0)),
    )
    # scoring chunks: the logits of their trailing len(score_nodes) tokens, after the sampled
    scored = [(i, c.score_nodes) for i, c in enumerate(chunks) if c.score_nodes is not None]
    rows = [int(cu_q[i + 1]) - len(nd) + j for i, nd in scored for j in range(len(nd))]
    return ModelBatch(
        input_ids=t(input_ids, torch.int64),
        positions=t(positions, torch.int64),
        meta=meta,
        logits_index=t(np.asarray([*(cu_q[1:][sampling] - 1), *rows], np.int64), torch.int64),
        sample_seqs=np.asarray([chunks[i].seq_id for i in sampling], dtype=np.int64),
        score_seqs=np.asarray([chunks[i].seq_id for i, nd in scored for _ in nd], np.int64),
        score_nodes=np.asarray([int(x) for _, nd in scored for x in nd], np.int64),
    )


def assert_same(a: ModelBatch, b: ModelBatch) -> None:
    for f in dataclasses.fields(ModelBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "meta":
            for g in dataclasses.fields(AttentionMetadata):
                u, w = getattr(x, g.name), getattr(y, g.name)
                if isinstance(u, torch.Tensor):
                    assert u.dtype == w.dtype and torch.equal(u, w), g.name
                else:
                    assert u == w, g.name
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y) and x.dtype == y.dtype, f.name
        else:
            assert x == y, f.name


def random_output(seed: int) -> SchedulerOutput:
    """A batch of the contract's shape: groups contiguous, every group's prefix present,
    prefix chunks and singles mixed in, random block tables and positions."""
    rng = np.random.default_rng(seed)
    bs = 4
    chunks: list[ScheduledChunk] = []
    prefixes: list[ScheduledPrefix] = []
    seq = 0
    for g in rng.permutation(int(rng.integers(0, 6))).tolist():
        kind = int(rng.integers(0, 3))
        if kind == 0:  # a group prefix being prefilled
            n, start = int(rng.integers(1, 9)), int(rng.integers(0, 9))
            chunks.append(_chunk(rng, prefix_seq_id(g), n, start, 0, -1, False, bs))
            continue
        pl = int(rng.integers(1, 12))
        prefixes.append(ScheduledPrefix(g, pl, rng.integers(0, 99, -(-pl // bs)).astype(np.int32)))
        for _ in range(int(rng.integers(1, 5))):
            decode = bool(rng.integers(0, 2))
            n = 1 if decode else int(rng.integers(1, 7))
            chunks.append(_chunk(rng, seq, n, int(rng.integers(0, 9)), pl, g, decode, bs))
            seq += 1
    for _ in range(int(rng.integers(0 if chunks else 1, 4))):  # singles (no group)
        chunks.append(
            _chunk(rng, seq, int(rng.integers(1, 6)), int(rng.integers(0, 9)), 0, -1, False, bs)
        )
        seq += 1
    n_dec = sum(c.num_tokens for c in chunks if c.is_decode)
    return SchedulerOutput(
        chunks=tuple(chunks),
        prefixes=tuple(prefixes),
        num_decode_tokens=n_dec,
        num_prefill_tokens=sum(c.num_tokens for c in chunks) - n_dec,
        kv_blocks_used=0,
        kv_blocks_total=99,
        preempted=(),
        iteration=0,
        threshold_lifted=False,
    )


def _chunk(rng, seq_id, n, start, prefix_len, group, decode, bs) -> ScheduledChunk:
    samples = seq_id >= 0 and bool(decode or rng.integers(0, 2))
    scores = seq_id >= 0 and not samples and bool(rng.integers(0, 2))  # scoring: reads logits
    nodes = rng.integers(0, 9, int(rng.integers(1, n + 1))) if scores else None
    return ScheduledChunk(
        seq_id=seq_id,
        token_ids=rng.integers(0, 500, n).astype(np.int32),
        kv_start=start,
        position_start=start + prefix_len,
        block_table=rng.integers(0, 99, -(-(start + n) // bs)).astype(np.int32),
        group=group,
        is_decode=decode,
        samples=samples,
        score_nodes=nodes,
    )


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_numpy_builder_equals_the_per_sequence_builder(seed):
    out = random_output(seed)
    cpu = torch.device("cpu")
    assert_same(build_batch(out, 4, cpu), _reference_build(out, 4, cpu))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_packed_upload_builds_the_same_batch(seed):
    """One buffer per dtype (the GPU path), run here on CPU tensors: the same batch."""
    out = random_output(seed)
    cpu = torch.device("cpu")
    assert_same(build_batch(out, 4, cpu, packed=True), _reference_build(out, 4, cpu))


def test_packed_upload_aligns_every_array_and_keeps_shapes_and_dtypes():
    rng = np.random.default_rng(3)
    arrays = {
        "a": (rng.integers(-5, 9, 7), torch.int32),
        "table": (rng.integers(0, 99, (3, 5)).astype(np.int32), torch.int32),
        "empty": (np.zeros(0, dtype=np.int64), torch.int32),
        "none": (np.zeros((0, 1), dtype=np.int32), torch.int32),
        "b": (rng.integers(0, 2**40, 9), torch.int64),
        "c": (rng.integers(0, 9, 1), torch.int64),
    }
    got = upload(arrays, torch.device("cpu"), packed=True)
    want = upload(arrays, torch.device("cpu"), packed=False)
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
        assert torch.equal(g, w), k
        assert g.data_ptr() % 64 == 0, k
    assert got["a"].untyped_storage().data_ptr() == got["table"].untyped_storage().data_ptr()


@pytest.mark.parametrize("policy", ["batchllm", "baseline"])
def test_equal_on_every_iteration_of_a_run(policy):
    """A natural-qa-shaped run with KV tight enough to preempt: every batch built both ways."""
    t = make_workload("natural-qa", 0.05, 0.3, seed=1, form="ids", vocab_size=500, max_tokens=6)
    prompts = TokenizedPrompts.from_lists(
        t["prompt"].to_pylist(), max_tokens=np.full(t.num_rows, 6)
    )
    plan = build_plan(prompts)
    cfg = SchedulerConfig(policy=policy, chunk_size=96, decode_reserve=False)
    sched = make_scheduler(cfg, KVLayout(40, 8), prompts, plan)
    cpu = torch.device("cpu")
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert_same(build_batch(out, 8, cpu), _reference_build(out, 8, cpu))
        sched.update(out, {c.seq_id: 7 for c in out.chunks if c.samples}, set())
        steps += 1
    assert steps > 10 and sched.stats.decode_tokens > 0
    if policy == "batchllm":
        assert sched.stats.prefixes_computed > 0


def test_lora_tokens_follow_each_sequence_and_group_prefix() -> None:
    """Each adapter's token indices: a request's by its prompt position, a group prefix's
    (seq_id -(g + 1)) by its group's; base-model tokens (-1) in none."""
    adapters = SeqAdapters(rows=np.array([0, -1, 1, 1]), groups=np.array([1, -1]))
    seq_id = np.array([prefix_seq_id(0), 2, 1, 0, prefix_seq_id(1)])
    seq_of_token = np.repeat(np.arange(5), [3, 1, 2, 1, 2])  # 9 tokens
    got = lora_tokens(adapters, seq_id, seq_of_token, torch.device("cpu"))
    assert [(a, idx.tolist()) for a, idx in got] == [(0, [6]), (1, [0, 1, 2, 3])]
    assert lora_tokens(None, seq_id, seq_of_token, torch.device("cpu")) == ()
