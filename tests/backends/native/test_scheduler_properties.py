"""Property tests: full simulated runs of both scheduler policies on random small workloads.

A reference "runner" drives the scheduler, feeds random sampled tokens, finishes requests at
random steps, and keeps a model of the paged KV cache: it writes each chunk's (position,
token) into the slots its block table maps, then checks that every scheduled sequence sees
exactly its own token stream (and its group's prefix) in the cache. That catches wrong
block tables, blocks shared by mistake, blocks reused too early, and wrong positions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchjob.backends.native.kv_cache import KVLayout
from batchjob.backends.native.scheduler.output import SchedulerOutput, prefix_group, prefix_seq_id
from batchjob.backends.native.scheduler.registry import make_scheduler
from batchjob.config import SchedulerConfig
from batchjob.plan.build import build_plan
from batchjob.plan.intmath import cdiv
from batchjob.plan.plan import Plan, PlanStats
from batchjob.tokenize.prompts import TokenizedPrompts


@dataclass
class Workload:
    prompts: TokenizedPrompts
    plan: Plan
    finish_at: list[int]  # the runner finishes request i after finish_at[i] sampled tokens


def make_plan(prompts: TokenizedPrompts, groups: list[tuple[int, list[int]]]) -> Plan:
    """Plan from (prefix_len, member positions) in execution order."""
    sizes = [len(ms) for _, ms in groups]
    members = np.array([m for _, ms in groups for m in ms], dtype=np.int64)
    total = int(prompts.lengths.sum())
    return Plan(
        group_prefix_len=np.array([p for p, _ in groups], dtype=np.int64),
        group_offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        members=members,
        row_ids=prompts.row_ids[members],
        decode_estimate=prompts.max_tokens[members],
        stats=PlanStats(len(members), len(groups), total, total, total, 0.0, 0.0),
    )


@st.composite
def workloads(draw) -> Workload:
    """Groups with a true common prefix (distinct first suffix tokens), shuffled file order."""
    head = draw(st.lists(st.integers(0, 3), max_size=4))  # shared by some groups (baseline)
    spec: list[tuple[list[int], list[list[int]]]] = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(1, 4))
        prefix = draw(st.lists(st.integers(0, 5), min_size=0 if n == 1 else 1, max_size=10))
        if draw(st.booleans()):
            prefix = head + prefix
        if n == 1:
            prefix = []
        suffixes = [
            [100 + j, *draw(st.lists(st.integers(0, 5), max_size=6 if n > 1 else 10))]
            for j in range(n)
        ]
        spec.append((prefix, suffixes))
    seqs = [p + s for p, sufs in spec for s in sufs]
    perm = draw(st.permutations(range(len(seqs))))  # file position of the k-th generated prompt
    file_seqs: list[list[int]] = [[]] * len(seqs)
    for k, pos in enumerate(perm):
        file_seqs[pos] = seqs[k]
    max_tokens = draw(st.lists(st.integers(1, 6), min_size=len(seqs), max_size=len(seqs)))
    prompts = TokenizedPrompts.from_lists(file_seqs, max_tokens=np.array(max_tokens))
    groups, k = [], 0
    for prefix, sufs in spec:
        groups.append((len(prefix), [perm[k + j] for j in range(len(sufs))]))
        k += len(sufs)
    order = draw(st.permutations(range(len(groups))))
    plan = make_plan(prompts, [groups[i] for i in order])
    finish_at = [draw(st.integers(1, m)) for m in max_tokens]
    return Workload(prompts, plan, finish_at)


def min_blocks(wl: Workload, bs: int, policy: str) -> int:
    """Fewest blocks in which every request fits alone (what check_kv_budget demands)."""
    need = 0
    for g in range(wl.plan.num_groups):
        pl = int(wl.plan.group_prefix_len[g]) if policy == "batchllm" else 0
        for m in wl.plan.group_members(g):
            own = len(wl.prompts.row(m)) - pl + int(wl.prompts.max_tokens[m]) - 1
            need = max(need, cdiv(pl, bs) + cdiv(own, bs))
    return need


@dataclass
class Sim:
    """The reference runner's view of one run."""

    wl: Workload
    cfg: SchedulerConfig
    kv: KVLayout
    fed: list[list[int]] = field(default_factory=list)  # sampled tokens fed back per request
    done: set[int] = field(default_factory=set)
    live: dict[int, list[int]] = field(default_factory=dict)  # seq -> own blocks held
    nxt: dict[int, int] = field(default_factory=dict)  # seq -> own KV tokens computed
    cache: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # slot -> (pos, t)
    prefix_ready: set[int] = field(default_factory=set)
    prefix_tokens: dict[int, int] = field(default_factory=dict)
    group_preempted: dict[int, int] = field(default_factory=dict)
    prefix_lost: dict[int, int] = field(default_factory=dict)  # prefix tokens dropped per group
    preempted: int = 0
    ready_drops: int = 0  # group drops that lost a complete prefix
    lifted: int = 0

    def prefix_len(self, g: int) -> int:
        return int(self.wl.plan.group_prefix_len[g])

    def group_of(self, seq: int) -> int:
        return int(np.searchsorted(self.wl.plan.group_offsets, self.pos_in_plan[seq], "right") - 1)

    def __post_init__(self) -> None:
        n = len(self.wl.prompts)
        self.fed = [[] for _ in range(n)]
        self.pos_in_plan = {int(m): k for k, m in enumerate(self.wl.plan.members)}

    def stream(self, seq: int, own_start: int) -> list[int]:
        if seq < 0:
            g = prefix_group(seq)
            m = int(self.wl.plan.group_members(g)[0])
            return self.wl.prompts.row(m)[: self.prefix_len(g)].tolist()
        return self.wl.prompts.row(seq)[own_start:].tolist() + self.fed[seq]


def check_iteration(sim: Sim, out: SchedulerOutput) -> None:
    cfg, bs, batchllm = sim.cfg, sim.kv.block_size, sim.cfg.policy == "batchllm"
    chunks = out.chunks
    assert chunks and sum(c.num_tokens for c in chunks) <= cfg.chunk_size
    assert out.num_decode_tokens + out.num_prefill_tokens == sum(c.num_tokens for c in chunks)
    assert len({c.seq_id for c in chunks}) == len(chunks)
    assert out.kv_blocks_used <= sim.kv.num_blocks
    # chunks of one group are contiguous; every referenced group has its prefix listed
    seen: list[int] = [c.group for c in chunks if c.group >= 0]
    runs = [g for i, g in enumerate(seen) if i == 0 or seen[i - 1] != g]
    assert len(runs) == len(set(runs))
    prefixes = {p.group: p for p in out.prefixes}
    assert set(prefixes) == set(seen)
    for s in out.preempted:
        sim.live.pop(s, None)
        if s < 0:  # a group's prefix KV dropped (last resort): its tokens so far are lost
            g = prefix_group(s)
            sim.ready_drops += g in sim.prefix_ready
            sim.prefix_ready.discard(g)
            sim.group_preempted[g] = sim.group_preempted.get(g, 0) + 1
            sim.prefix_lost[g] = sim.prefix_lost.get(g, 0) + sim.nxt.get(s, 0)
        else:
            sim.preempted += 1
        sim.nxt[s] = 0
    sim.lifted += out.threshold_lifted
    for c in chunks:
        seq = c.seq_id
        assert seq not in sim.done
        if seq >= 0 and batchllm and sim.prefix_len(sim.group_of(seq)) > 0:
            assert c.group == sim.group_of(seq)
        else:
            assert c.group == -1
        own_start = sim.prefix_len(c.group) if c.group >= 0 else 0
        stream = sim.stream(seq, own_start)
        n = c.num_tokens
        if seq in sim.live:
            assert c.kv_start == sim.nxt[seq]
            prev = sim.live[seq]
            assert c.block_table[: len(prev)].tolist() == prev
        elif batchllm:
            assert c.kv_start == 0
        else:  # baseline: a prefix-cache hit covers whole blocks, never the last token
            assert c.kv_start % bs == 0 and c.kv_start < len(stream)
        assert c.token_ids.dtype == np.int32 and c.block_table.dtype == np.int32
        assert c.token_ids.tolist() == stream[c.kv_start : c.kv_start + n]
        assert c.position_start == own_start + c.kv_start
        assert len(c.block_table) == cdiv(c.kv_start + n, bs)
        assert c.samples == (seq >= 0 and c.kv_start + n == len(stream))
        assert c.is_decode == (n == 1 and seq >= 0 and bool(sim.fed[seq]) and c.samples)
        if c.group >= 0:
            assert c.group in sim.prefix_ready  # completed in an earlier iteration
            p = prefixes[c.group]
            assert p.prefix_len == own_start
            assert p.block_table.tolist() == sim.live[prefix_seq_id(c.group)]
        sim.live[seq] = c.block_table.tolist()
        sim.nxt[seq] = c.kv_start + n
        if seq < 0:
            g = prefix_group(seq)
            sim.prefix_tokens[g] = sim.prefix_tokens.get(g, 0) + n
    check_block_sharing(sim)
    # the runner writes every new token's K/V before attention reads
    for c in chunks:
        bt = c.block_table
        for j, tok in enumerate(c.token_ids.tolist()):
            p = c.kv_start + j
            sim.cache[(int(bt[p // bs]), p % bs)] = (c.position_start + j, tok)
    for c in chunks:
        own_start = sim.prefix_len(c.group) if c.group >= 0 else 0
        stream = sim.stream(c.seq_id, own_start)
        for p in range(c.kv_start + c.num_tokens):
            slot = (int(c.block_table[p // bs]), p % bs)
            assert sim.cache.get(slot) == (own_start + p, stream[p])
        if c.group >= 0:
            pre = sim.stream(prefix_seq_id(c.group), 0)
            pbt = prefixes[c.group].block_table
            for p in range(own_start):
                assert sim.cache.get((int(pbt[p // bs]), p % bs)) == (p, pre[p])
    assert out.kv_blocks_used == len({b for bt in sim.live.values() for b in bt})
    if batchllm:
        check_batchllm_admission(sim, out)
    # scheduler.max_num_seqs caps the running requests on both policies
    assert sum(1 for s in sim.live if s >= 0) <= (cfg.max_num_seqs or len(sim.live))


def check_block_sharing(sim: Sim) -> None:
    """batchllm: live sequences never share blocks; baseline: only equal full cached blocks."""
    owner: dict[int, tuple[int, int]] = {}
    bs = sim.kv.block_size
    for seq, bt in sim.live.items():
        for i, b in enumerate(bt):
            if b not in owner:
                owner[b] = (seq, i)
                continue
            assert sim.cfg.policy == "baseline", f"block {b} shared by {seq} and {owner[b][0]}"
            other, j = owner[b]
            assert i == j and sim.nxt[seq] >= (i + 1) * bs and sim.nxt[other] >= (i + 1) * bs
            end = (i + 1) * bs
            assert sim.stream(seq, 0)[:end] == sim.stream(other, 0)[:end]


def check_batchllm_admission(sim: Sim, out: SchedulerOutput) -> None:
    cap = sim.cfg.kv_cap_blocks(sim.kv.num_blocks)
    has_prefill = any(not c.is_decode for c in out.chunks)
    if out.threshold_lifted:
        assert not any(c.is_decode for c in out.chunks)
    elif has_prefill:
        assert out.kv_blocks_used <= cap
    # decode queue first: a request in decode that got no token means decodes filled the budget
    scheduled = {c.seq_id for c in out.chunks}
    for seq in sim.live:
        if seq >= 0 and seq not in scheduled and sim.fed[seq]:
            stream_len = len(sim.stream(seq, 0)) - (sim.prefix_len(sim.group_of(seq)))
            if sim.nxt[seq] == stream_len - 1:
                assert out.num_decode_tokens == sim.cfg.chunk_size


def simulate(cfg: SchedulerConfig, kv: KVLayout, wl: Workload, seed: int = 0) -> Sim:
    sched = make_scheduler(cfg, kv, wl.prompts, wl.plan)
    sim = Sim(wl, cfg, kv)
    rng = random.Random(seed)
    total = int(wl.prompts.lengths.sum()) + sum(wl.finish_at)
    outputs: dict[int, list[int]] = {}  # finished requests' tokens, as update hands them
    for _ in range(50 * total + 100):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_iteration(sim, out)
        sampled, finished = {}, set()
        for c in out.chunks:
            if c.samples:
                tok = rng.randrange(50, 60)
                sampled[c.seq_id] = tok
                sim.fed[c.seq_id].append(tok)
                if len(sim.fed[c.seq_id]) == wl.finish_at[c.seq_id]:
                    finished.add(c.seq_id)
        done = sched.update(out, sampled, finished)
        # finish_at <= max_tokens: exactly the requests the runner finished, each once
        assert done.keys() == finished and not finished & outputs.keys()
        outputs |= done
        for c in out.chunks:  # a prefix completed in this iteration: members may start next
            if c.seq_id < 0 and sim.nxt[c.seq_id] == sim.prefix_len(prefix_group(c.seq_id)):
                sim.prefix_ready.add(prefix_group(c.seq_id))
        for seq in done:
            sim.done.add(seq)
            sim.live.pop(seq, None)
            g = sim.group_of(seq)
            if all(int(m) in sim.done for m in wl.plan.group_members(g)):
                sim.live.pop(prefix_seq_id(g), None)
        assert sched.kv_blocks_used == len({b for bt in sim.live.values() for b in bt})
    assert not sched.has_unfinished(), "no progress: iteration bound exceeded"
    assert sim.done == set(range(len(wl.prompts)))
    assert sched.num_live == 0  # every request's state dropped once finished
    for i in range(len(wl.prompts)):
        assert outputs[i] == sim.fed[i]
        assert len(sim.fed[i]) == wl.finish_at[i]
    assert sched.kv_blocks_used == 0 and not sim.live
    stats = sched.stats
    assert stats.preemptions == sim.preempted
    assert stats.group_preemptions == sum(sim.group_preempted.values())
    assert stats.threshold_lifted_iterations == sim.lifted
    assert stats.peak_blocks <= kv.num_blocks
    if cfg.policy == "batchllm":  # every prefix computed once, plus what a group drop lost
        for g in range(wl.plan.num_groups):
            lost = sim.prefix_lost.get(g, 0)
            assert sim.prefix_tokens.get(g, 0) == sim.prefix_len(g) + lost
        n_prefixed = int(np.count_nonzero(wl.plan.group_prefix_len))
        assert stats.prefixes_computed == n_prefixed + sim.ready_drops
        assert stats.prefix_tokens == sum(sim.prefix_tokens.values())
    return sim


@st.composite
def runs(draw, policy: str) -> tuple[SchedulerConfig, KVLayout, Workload]:
    wl = draw(workloads())
    bs = draw(st.sampled_from([1, 2, 3, 4, 8]))
    kv = KVLayout(num_blocks=min_blocks(wl, bs, policy) + draw(st.integers(0, 6)), block_size=bs)
    cfg = SchedulerConfig(
        policy=policy,
        chunk_size=draw(st.integers(1, 24)),
        kv_threshold=draw(st.sampled_from([0.2, 0.5, 0.8, 1.0])),
        max_num_seqs=draw(st.integers(1, 6)),
    )
    return cfg, kv, wl


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(runs("batchllm"), st.integers(0, 2**16))
def test_batchllm_runs(run: tuple[SchedulerConfig, KVLayout, Workload], seed: int) -> None:
    simulate(*run, seed=seed)


@SETTINGS
@given(runs("baseline"), st.integers(0, 2**16))
def test_baseline_runs(run: tuple[SchedulerConfig, KVLayout, Workload], seed: int) -> None:
    simulate(*run, seed=seed)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs("batchllm"), st.integers(0, 2**16))
def test_batchllm_runs_real_plans(
    run: tuple[SchedulerConfig, KVLayout, Workload], seed: int
) -> None:
    """The same runs on the planner's own groups and order (build_plan)."""
    cfg, kv, wl = run
    wl = Workload(wl.prompts, build_plan(wl.prompts), wl.finish_at)
    need = min_blocks(wl, kv.block_size, "batchllm")
    simulate(cfg, replace(kv, num_blocks=max(kv.num_blocks, need)), wl, seed=seed)
