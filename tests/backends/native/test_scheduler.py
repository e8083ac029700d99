"""Exact scheduler scenarios with exact block ids (in the style of vLLM's CPU scheduler tests).

Free blocks are handed out from the head of a FIFO queue that starts as 0, 1, 2, ...; a
sequence's blocks return to its tail last block first.
"""

from __future__ import annotations

import pytest

from batchjob.backends.native.kv_cache import KVLayout
from batchjob.backends.native.scheduler.output import SchedulerOutput
from batchjob.backends.native.scheduler.registry import make_scheduler
from batchjob.config import SchedulerConfig
from batchjob.errors import ConfigError
from batchjob.tokenize.prompts import TokenizedPrompts
from tests.backends.native.test_scheduler_properties import make_plan

A = [1, 2, 3, 4, 5]  # prefix of one group
B = [6, 7, 8]  # prefix of another


def rows(out: SchedulerOutput) -> list[tuple]:
    """(seq_id, tokens, kv_start, position_start, block_table, group, is_decode, samples)."""
    return [
        (
            c.seq_id,
            c.token_ids.tolist(),
            c.kv_start,
            c.position_start,
            c.block_table.tolist(),
            c.group,
            c.is_decode,
            c.samples,
        )
        for c in out.chunks
    ]


def prefixes(out: SchedulerOutput) -> list[tuple]:
    return [(p.group, p.prefix_len, p.block_table.tolist()) for p in out.prefixes]


def test_batchllm_two_groups_exact() -> None:
    prompts = TokenizedPrompts.from_lists(
        [[*A, 10, 11], [*B, 20], [*A, 12], [*B, 21, 22, 23]], max_tokens=3
    )
    plan = make_plan(prompts, [(3, [1, 3]), (5, [0, 2])])  # group 0: prefix B; group 1: A
    cfg, kv = SchedulerConfig(chunk_size=6, kv_threshold=1.0), KVLayout(num_blocks=16, block_size=2)
    s = make_scheduler(cfg, kv, prompts, plan)

    # 0: common-prefix queue only: all of B's prefix, then the first chunk of A's
    out = s.schedule()
    assert rows(out) == [
        (-1, [6, 7, 8], 0, 0, [0, 1], -1, False, False),
        (-2, [1, 2, 3], 0, 0, [2, 3], -1, False, False),
    ]
    assert prefixes(out) == [] and out.kv_blocks_used == 4 and out.num_prefill_tokens == 6
    s.update(out, {}, set())

    # 1: B complete, so its members (distinct queue) go before the rest of A's prefix
    out = s.schedule()
    assert rows(out) == [
        (1, [20], 0, 3, [4], 0, False, True),
        (3, [21, 22, 23], 0, 3, [5, 6], 0, False, True),
        (-2, [4, 5], 3, 3, [2, 3, 7], -1, False, False),
    ]
    assert prefixes(out) == [(0, 3, [0, 1])] and out.kv_blocks_used == 8
    s.update(out, {1: 30, 3: 31}, set())

    # 2: decode queue first, then A's members; chunks of a group stay together
    out = s.schedule()
    assert rows(out) == [
        (1, [30], 1, 4, [4], 0, True, True),
        (3, [31], 3, 6, [5, 6], 0, True, True),
        (0, [10, 11], 0, 5, [8], 1, False, True),
        (2, [12], 0, 5, [9], 1, False, True),
    ]
    assert prefixes(out) == [(0, 3, [0, 1]), (1, 5, [2, 3, 7])]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (2, 3)
    assert s.update(out, {1: 32, 3: 33, 0: 34, 2: 35}, {1}) == {1: [30, 32]}
    assert s.output_tokens(3) == [31, 33]  # live: its tokens so far
    assert s.kv_blocks_used == 9  # request 1's block 4 went back to the free queue's tail

    # 3: request 3 needs a third block: the head of the free queue (10), not block 4
    out = s.schedule()
    assert rows(out) == [
        (3, [33], 4, 7, [5, 6, 10], 0, True, True),
        (0, [34], 2, 7, [8, 11], 1, True, True),
        (2, [35], 1, 6, [9], 1, True, True),
    ]
    assert s.update(out, {3: 36, 0: 37, 2: 38}, {3}) == {3: [31, 33, 36]}
    assert s.kv_blocks_used == 6  # group 0 done: its prefix blocks 0, 1 are freed with it
    with pytest.raises(KeyError, match="request 3 is not live"):
        s.output_tokens(3)  # a finished request's state is dropped (update returned it)

    # the rest: requests 0 and 2 hit max_tokens = 3 and finish on their own
    out = s.schedule()
    assert s.update(out, {0: 40, 2: 41}, set()) == {0: [34, 37, 40], 2: [35, 38, 41]}
    assert not s.has_unfinished() and s.num_live == 0 and s.kv_blocks_used == 0
    st = s.stats
    assert (st.prefixes_computed, st.prefix_tokens, st.preemptions) == (2, 8, 0)
    assert (st.iterations, st.peak_blocks) == (5, 11)


def test_batchllm_preemption_then_group_preemption() -> None:
    """7 blocks of 1 token; request 0 decodes long enough to need everything."""
    prompts = TokenizedPrompts.from_lists([[0, 100], [0, 101], [1, 100], [1, 101]], max_tokens=6)
    plan = make_plan(prompts, [(1, [0, 1]), (1, [2, 3])])
    # admission by blocks in use alone (no decode reserve), so that decode growth preempts
    cfg = SchedulerConfig(chunk_size=16, kv_threshold=1.0, decode_reserve=False)
    kv = KVLayout(num_blocks=7, block_size=1)
    s = make_scheduler(cfg, kv, prompts, plan)
    finish_at = {0: 6, 1: 1, 2: 6, 3: 1}
    trace = []
    token = 50
    outputs: dict[int, list[int]] = {}
    while s.has_unfinished():
        out = s.schedule()
        trace.append((out.preempted, out.kv_blocks_used, rows(out)))
        sampled = {}
        for c in out.chunks:
            if c.samples:
                sampled[c.seq_id] = token
                token += 1
        done = {k for k in sampled if len(s.output_tokens(k)) + 1 == finish_at[k]}
        outputs |= s.update(out, sampled, done)
    assert trace[:2] == [
        ((), 2, [(-1, [0], 0, 0, [0], -1, False, False), (-2, [1], 0, 0, [1], -1, False, False)]),
        (
            (),
            6,
            [
                (0, [100], 0, 1, [2], 0, False, True),
                (1, [101], 0, 1, [3], 0, False, True),
                (2, [100], 0, 1, [4], 1, False, True),
                (3, [101], 0, 1, [5], 1, False, True),
            ],
        ),
    ]
    # 2: both decode; 3: request 2 (youngest) cannot grow and preempts itself
    assert trace[2][2] == [
        (0, [50], 1, 2, [2, 6], 0, True, True),
        (2, [52], 1, 2, [4, 3], 1, True, True),
    ]
    assert trace[3] == ((2,), 5, [(0, [54], 2, 3, [2, 6, 5], 0, True, True)])
    # 4: request 2 restarts its recompute with the one block left; 5: preempted again
    assert trace[4][2][1] == (2, [100], 0, 1, [4], 1, False, False)
    assert trace[5] == ((2,), 7, [(0, [57], 4, 5, [2, 6, 5, 3, 4], 0, True, True)])
    # 6: request 0, alone, needs its last block: the idle group 1 loses its prefix
    assert trace[6] == ((-2,), 7, [(0, [58], 5, 6, [2, 6, 5, 3, 4, 1], 0, True, True)])
    # 7: group 1 restarts from its prefix; 8: request 2 recomputes prompt + both outputs
    assert trace[7] == ((), 1, [(-2, [1], 0, 0, [1], -1, False, False)])
    assert trace[8] == ((), 4, [(2, [100, 52, 55], 0, 1, [4, 3, 5], 1, False, True)])
    assert outputs[2][:3] == [52, 55, 60] and len(outputs[2]) == 6
    assert sorted(outputs) == [0, 1, 2, 3] and [len(outputs[k]) for k in range(4)] == [6, 1, 6, 1]
    st = s.stats
    assert (st.preemptions, st.group_preemptions, st.prefixes_computed) == (2, 1, 3)
    assert st.recomputed_tokens == 1 + 2 + 1  # [100] at 4, [100, 52] at 8, B's prefix at 7
    assert s.kv_blocks_used == 0


def test_batchllm_group_starts_only_if_a_member_can_follow() -> None:
    """A's members will need 2 blocks next iteration: B's prefix (+1 member) must wait."""
    prompts = TokenizedPrompts.from_lists([[0, 100], [0, 101], [1, 100], [1, 101]], max_tokens=1)
    plan = make_plan(prompts, [(1, [0, 1]), (1, [2, 3])])
    cfg, kv = SchedulerConfig(chunk_size=16, kv_threshold=1.0), KVLayout(num_blocks=4, block_size=1)
    s = make_scheduler(cfg, kv, prompts, plan)
    out = s.schedule()
    assert rows(out) == [(-1, [0], 0, 0, [0], -1, False, False)]
    s.update(out, {}, set())
    out = s.schedule()  # 3 blocks in use: B's prefix and a member would need 2 more
    assert [r[0] for r in rows(out)] == [0, 1]
    s.update(out, {0: 5, 1: 5}, set())  # both at max_tokens: group 0 and its prefix are freed
    out = s.schedule()
    assert rows(out) == [(-2, [1], 0, 0, [3], -1, False, False)]  # free queue: 3 1 2 0


def test_batchllm_threshold_holds_back_prefill() -> None:
    """kv_threshold 0.5 of 8 blocks: new prefill stops at 4 blocks, decode goes on."""
    prompts = TokenizedPrompts.from_lists([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]], max_tokens=4)
    cfg = SchedulerConfig(chunk_size=16, kv_threshold=0.5, decode_reserve=False)
    kv = KVLayout(num_blocks=8, block_size=2)
    s = make_scheduler(cfg, kv, prompts, None)  # no plan: groups of one in file order
    out = s.schedule()
    assert rows(out) == [
        (0, [1, 2, 3, 4], 0, 0, [0, 1], -1, False, True),
        (1, [5, 6, 7, 8], 0, 0, [2, 3], -1, False, True),
    ]
    s.update(out, {0: 9, 1: 9}, set())
    out = s.schedule()  # decodes may pass the threshold; request 2 still waits
    assert [r[4] for r in rows(out)] == [[0, 1, 4], [2, 3, 5]] and out.kv_blocks_used == 6


def test_batchllm_threshold_lifted_when_nothing_fits() -> None:
    """A prompt longer than the threshold still runs: alone, over the threshold."""
    prompts = TokenizedPrompts.from_lists([[1, 2, 3, 4, 5, 6], [7]], max_tokens=1)
    cfg = SchedulerConfig(chunk_size=16, kv_threshold=0.5, decode_reserve=False)
    kv = KVLayout(num_blocks=4, block_size=2)
    s = make_scheduler(cfg, kv, prompts, None)
    out = s.schedule()
    assert rows(out) == [(0, [1, 2, 3, 4], 0, 0, [0, 1], -1, False, False)]
    assert not out.threshold_lifted
    s.update(out, {}, set())
    out = s.schedule()  # 2 blocks in use = the cap: only the lifted pass fits one chunk
    assert rows(out) == [(0, [5, 6], 4, 4, [0, 1, 2], -1, False, True)] and out.threshold_lifted
    s.update(out, {0: 8}, {0})
    out = s.schedule()
    assert rows(out) == [(1, [7], 0, 0, [3], -1, False, True)]  # free queue: 3 2 1 0
    assert s.stats.threshold_lifted_iterations == 1


def test_baseline_prefix_cache_hit_and_lru_eviction() -> None:
    prompts = TokenizedPrompts.from_lists(
        [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 8, 8], [9] * 11, [1, 2, 3, 4, 7], [1, 2, 3, 4]],
        max_tokens=1,
    )
    cfg, kv = (
        SchedulerConfig(policy="baseline", chunk_size=16, max_num_seqs=1),
        KVLayout(num_blocks=8, block_size=2),
    )
    s = make_scheduler(cfg, kv, prompts, None)

    def step() -> list[tuple]:
        out = s.schedule()
        s.update(out, {c.seq_id: 50 for c in out.chunks if c.samples}, set())
        return rows(out)

    assert step() == [(0, [1, 2, 3, 4, 5], 0, 0, [0, 1, 2], -1, False, True)]
    # freed last block first: free queue 3 4 5 6 7 2 1 0; full blocks 0, 1 stay cached
    assert step() == [(1, [6], 4, 4, [0, 1, 3], -1, False, True)]  # hit: 2 full blocks
    # free queue 4 5 6 7 2 3 1 0
    assert step() == [(2, [8, 8], 2, 2, [0, 4], -1, False, True)]  # hit: block 0 only
    # free queue 5 6 7 2 3 1 4 0: six new blocks evict the least recently used cached
    # block (1: [1 2 | 3 4]) but not the more recent 4 and 0
    assert step() == [(3, [9] * 11, 0, 0, [5, 6, 7, 2, 3, 1], -1, False, True)]
    assert step() == [(4, [3, 4, 7], 2, 2, [0, 4, 1], -1, False, True)]
    # [1 2 | 3 4] is cached again (block 4), but the last prompt token is always recomputed
    assert step() == [(5, [3, 4], 2, 2, [0, 3], -1, False, True)]
    assert s.stats.cache_hit_tokens == 4 + 2 + 2 + 2 and not s.has_unfinished()


def test_baseline_same_step_hit_and_request_cap() -> None:
    """Hits on blocks scheduled earlier in the same batch; max_num_seqs caps admission."""
    prompts = TokenizedPrompts.from_lists([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [8, 9]], max_tokens=2)
    cfg, kv = (
        SchedulerConfig(policy="baseline", chunk_size=16, max_num_seqs=2),
        KVLayout(num_blocks=8, block_size=2),
    )
    s = make_scheduler(cfg, kv, prompts, None)
    out = s.schedule()
    assert rows(out) == [
        (0, [1, 2, 3, 4, 5], 0, 0, [0, 1, 2], -1, False, True),
        (1, [6], 4, 4, [0, 1, 3], -1, False, True),
    ]
    s.update(out, {0: 7, 1: 7}, {1})
    out = s.schedule()  # running request 0 decodes first, then request 2 is admitted
    assert rows(out) == [
        (0, [7], 5, 5, [0, 1, 2], -1, True, True),
        (2, [8, 9], 0, 0, [4], -1, False, True),
    ]


def test_baseline_preempts_youngest_by_recompute() -> None:
    prompts = TokenizedPrompts.from_lists([[1, 2], [3, 4]], max_tokens=3)
    cfg, kv = (
        SchedulerConfig(policy="baseline", chunk_size=16),
        KVLayout(num_blocks=3, block_size=2),
    )
    s = make_scheduler(cfg, kv, prompts, None)
    out = s.schedule()
    assert [r[4] for r in rows(out)] == [[0], [1]]
    s.update(out, {0: 5, 1: 6}, set())
    out = s.schedule()  # 0 takes block 2; 1 finds none and preempts itself
    assert rows(out) == [(0, [5], 2, 2, [0, 2], -1, True, True)] and out.preempted == (1,)
    s.update(out, {0: 7}, set())
    out = s.schedule()  # its full block [3, 4] is still cached: only the output recomputes
    assert rows(out) == [(0, [7], 3, 3, [0, 2], -1, True, True)]
    s.update(out, {0: 8}, set())  # max_tokens: request 0 finishes
    out = s.schedule()
    assert rows(out) == [(1, [6], 2, 2, [1, 2], -1, True, True)]  # only its last token left
    assert s.stats.preemptions == 1 and s.stats.cache_hit_tokens == 2


def test_baseline_admits_nobody_after_a_preemption() -> None:
    prompts = TokenizedPrompts.from_lists([[8], [8]], max_tokens=2)
    cfg, kv = SchedulerConfig(policy="baseline", chunk_size=6), KVLayout(num_blocks=3, block_size=1)
    s = make_scheduler(cfg, kv, prompts, None)
    out = s.schedule()
    assert rows(out) == [
        (0, [8], 0, 0, [0], -1, False, True),
        (1, [8], 0, 0, [1], -1, False, True),
    ]
    s.update(out, {0: 50, 1: 51}, set())
    out = s.schedule()  # 1 preempts itself; it could come back at once, but vLLM waits
    assert rows(out) == [(0, [50], 1, 1, [0, 2], -1, True, True)] and out.preempted == (1,)
    s.update(out, {0: 52}, set())
    out = s.schedule()  # [8] is cached twice (blocks 0 and 1): the oldest copy is reused
    assert rows(out) == [(1, [51], 1, 1, [0, 1], -1, True, True)]


@pytest.mark.parametrize("policy", ["batchllm", "baseline"])
def test_budget_too_small(policy: str) -> None:
    prompts = TokenizedPrompts.from_lists([[1, 2, 3, 9], [1, 2, 3, 4, 5, 6, 7]], max_tokens=4)
    plan = make_plan(prompts, [(3, [0, 1])]) if policy == "batchllm" else None
    cfg, kv = SchedulerConfig(policy=policy), KVLayout(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"prompt 1 .*needs 3 blocks of 4 tokens.*num_blocks is 2"):
        make_scheduler(cfg, kv, prompts, plan)


def test_misuse_is_rejected() -> None:
    prompts = TokenizedPrompts.from_lists([[1, 2], [3]], max_tokens=2)
    s = make_scheduler(SchedulerConfig(), KVLayout(num_blocks=4, block_size=2), prompts, None)
    out = s.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        s.schedule()
    with pytest.raises(ValueError, match="missing"):
        s.update(out, {0: 1}, set())
    with pytest.raises(ValueError, match="did not sample"):
        s.update(out, {0: 1, 1: 1}, {5})
    s.update(out, {0: 1, 1: 1}, set())
    with pytest.raises(ValueError, match="last schedule"):
        s.update(out, {0: 1, 1: 1}, set())


def test_plan_must_match_prompts() -> None:
    prompts = TokenizedPrompts.from_lists([[1, 2, 3], [1, 9, 3]], max_tokens=1)
    cfg, kv = SchedulerConfig(), KVLayout(num_blocks=8, block_size=2)
    with pytest.raises(ValueError, match="differ within the 2-token prefix"):
        make_scheduler(cfg, kv, prompts, make_plan(prompts, [(2, [0, 1])]))
    with pytest.raises(ValueError, match="no distinct token"):
        make_scheduler(cfg, kv, prompts, make_plan(prompts, [(3, [0]), (0, [1])]))
    with pytest.raises(ValueError, match="permutation"):
        make_scheduler(cfg, kv, prompts, make_plan(prompts, [(0, [0]), (0, [0])]))


def test_settings_are_checked_at_load_time() -> None:
    """The scheduler takes SchedulerConfig as is: its checks are the config's (ConfigError)."""
    with pytest.raises(ConfigError, match=r"scheduler\.policy"):
        SchedulerConfig(policy="fifo")
    with pytest.raises(ConfigError, match=r"scheduler\.kv_threshold"):
        SchedulerConfig(kv_threshold=0.0)
    with pytest.raises(ConfigError, match=r"scheduler\.chunk_size"):
        SchedulerConfig(chunk_size=0)
    assert SchedulerConfig(kv_threshold=0.95).kv_cap_blocks(10) == 9
    assert SchedulerConfig().kv_cap_blocks(10) == 9  # unset: 0.95 on the native engine
    assert SchedulerConfig(kv_threshold=0.5).kv_threshold_for("vllm") == 0.5  # the job's wins
    empty = TokenizedPrompts.from_lists([], max_tokens=1)
    s = make_scheduler(SchedulerConfig(kv_threshold=0.95), KVLayout(10, 1), empty, None)
    assert s.kv_cap_blocks == 9


def test_scheduler_runs_to_the_end_without_torch() -> None:
    """Importing is not enough: plan, then run every policy to the last token on numpy
    alone, in a fresh process; torch must never have been imported (lazy imports too)."""
    import subprocess
    import sys
    import textwrap

    from batchjob.backends.names import SCHEDULING_POLICIES

    code = textwrap.dedent(
        """
        import sys
        from batchjob.backends.names import SCHEDULING_POLICIES
        from batchjob.backends.native.kv_cache import KVLayout
        from batchjob.backends.native.scheduler.registry import make_scheduler
        from batchjob.config import SchedulerConfig
        from batchjob.plan.build import build_plan
        from batchjob.tokenize.prompts import TokenizedPrompts

        rows = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 8], [1, 2, 3, 7], [5, 6]]
        prompts = TokenizedPrompts.from_lists(rows, max_tokens=3)
        plan = build_plan(prompts)
        for policy in SCHEDULING_POLICIES:
            cfg = SchedulerConfig(policy=policy, chunk_size=4)
            s = make_scheduler(cfg, KVLayout(num_blocks=32, block_size=2), prompts, plan)
            outputs = {}
            for _ in range(200):
                if not s.has_unfinished():
                    break
                out = s.schedule()
                sampled = {c.seq_id: 50 for c in out.chunks if c.samples}
                done = {i for i in sampled if len(s.output_tokens(i)) == 2}
                outputs.update(s.update(out, sampled, done))
            assert not s.has_unfinished(), policy
            assert [outputs[i] for i in range(4)] == [[50] * 3] * 4, policy
        assert "torch" not in sys.modules, "the scheduler or planner imported torch"
        print("ok", len(SCHEDULING_POLICIES))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ok", str(len(SCHEDULING_POLICIES))]
