"""Admission with a decode-growth reserve (batchllm): on a decode-heavy, memory-bound batch
the projected-peak admission never preempts where admitting by blocks in use alone did."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from batchjob.backends.decode_lengths import RemainingTable
from batchjob.backends.kv_projection import prefix_peaks, projected_peak_blocks
from batchjob.backends.native.kv_cache import KVLayout
from batchjob.backends.native.scheduler.batchllm import BatchLLMScheduler, _Projection
from batchjob.config import SchedulerConfig
from batchjob.tokenize.prompts import TokenizedPrompts
from tests.backends.native.test_scheduler_properties import Workload, make_plan, simulate


def _decode_heavy() -> tuple[TokenizedPrompts, list[int]]:
    rng = np.random.default_rng(0)
    lens = rng.integers(3, 9, 12)
    seqs = [[100 + i, *rng.integers(0, 50, int(n) - 1).tolist()] for i, n in enumerate(lens)]
    max_tokens = rng.integers(20, 41, 12)
    return TokenizedPrompts.from_lists(seqs, max_tokens=max_tokens), max_tokens.tolist()


def _run(cfg: SchedulerConfig, kv: KVLayout, prompts: TokenizedPrompts, reserve: bool) -> tuple:
    # reserve off: the admission before it, new prefill whenever its blocks fit under the cap
    sched = BatchLLMScheduler(replace(cfg, decode_reserve=reserve), kv, prompts, None)
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {c.seq_id: 7 for c in out.chunks if c.samples}
        sched.update(out, sampled, set())
    st = sched.stats
    return st.preemptions, st.peak_blocks, st.iterations


def test_reserve_never_preempts_where_blocks_in_use_admission_did() -> None:
    prompts, _ = _decode_heavy()
    cfg = SchedulerConfig(chunk_size=64, kv_threshold=0.9)
    for num_blocks in (16, 24, 40, 64):
        kv = KVLayout(num_blocks=num_blocks, block_size=4)
        old_pre, _, _ = _run(cfg, kv, prompts, False)
        new_pre, new_peak, _ = _run(cfg, kv, prompts, True)
        assert old_pre > 0, f"{num_blocks} blocks: the old admission should preempt here"
        assert new_pre == 0, f"{num_blocks} blocks: {new_pre} preemptions with the reserve"
        assert new_peak <= cfg.kv_cap_blocks(num_blocks)


def test_reserve_keeps_the_batch_full_when_memory_is_ample() -> None:
    prompts, _ = _decode_heavy()
    cfg = SchedulerConfig(chunk_size=64, kv_threshold=0.9)
    kv = KVLayout(num_blocks=1000, block_size=4)  # everything fits: the reserve costs nothing
    assert _run(cfg, kv, prompts, True) == _run(cfg, kv, prompts, False)


def test_reserve_run_passes_the_kv_cache_model_checks() -> None:
    prompts, max_tokens = _decode_heavy()
    wl = Workload(prompts, make_plan(prompts, [(0, [i]) for i in range(len(prompts))]), max_tokens)
    sim = simulate(SchedulerConfig(chunk_size=16, kv_threshold=0.9), KVLayout(24, 4), wl)
    assert sim.preempted == 0


def test_projected_peak_equals_a_step_by_step_simulation() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        n, bs = int(rng.integers(1, 12)), int(rng.choice([4, 16]))
        tok, rem = rng.integers(1, 100, n), rng.integers(1, 40, n)
        shared = np.minimum(rng.integers(0, 3, n), tok // bs)
        sim = max(
            sum(-(-(tok[i] + t) // bs) - shared[i] for i in range(n) if rem[i] > t)
            for t in range(int(rem.max()))
        )
        assert projected_peak_blocks(tok, rem, shared, bs) == sim


def test_prefix_peaks_equal_projected_peak_blocks_of_each_prefix() -> None:
    """The vLLM scheduler's one-pass peaks of every prefix of its candidates, against
    ``projected_peak_blocks`` of each prefix on its own (shared prefixes above a request's
    own blocks included: its load is then 0)."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n, bs = int(rng.integers(1, 30)), int(rng.choice([4, 16, 32]))
        tok, rem = rng.integers(1, 200, n), rng.integers(1, 60, n)
        shared = rng.integers(0, 8, n)
        got = prefix_peaks(tok, rem, shared, bs)
        want = [projected_peak_blocks(tok[:m], rem[:m], shared[:m], bs) for m in range(1, n + 1)]
        assert got.tolist() == want
    assert len(prefix_peaks(*(np.zeros(0, np.int64),) * 3, 16)) == 0


def test_incremental_projection_equals_projected_peak_blocks() -> None:
    """The scheduler's per-pass projection (built once, one request added at a time) gives
    ``projected_peak_blocks`` of the whole set, with and without each candidate."""
    rng = np.random.default_rng(2)
    for _ in range(100):
        n, bs = int(rng.integers(0, 12)), int(rng.choice([1, 4, 16]))
        tok, rem = rng.integers(1, 100, n), rng.integers(1, 40, n)
        proj = _Projection(tok.copy(), rem.copy(), bs)
        for _ in range(int(rng.integers(1, 8))):
            t, r = int(rng.integers(1, 100)), int(rng.integers(1, 40))
            want = projected_peak_blocks(
                np.append(tok, t), np.append(rem, r), np.zeros(n + 1, np.int64), bs
            )
            assert proj.peak_with(t, r) == want
            if rng.integers(0, 2):
                proj.add(t, r)
                tok, rem, n = np.append(tok, t), np.append(rem, r), n + 1


def _stopping_early() -> tuple[TokenizedPrompts, np.ndarray]:
    """Rows capped at 200 tokens whose answers stop far sooner (geometric, mean ~12)."""
    rng = np.random.default_rng(3)
    n = 80
    lens = rng.integers(3, 9, n)
    seqs = [[100 + i, *rng.integers(0, 50, int(k) - 1).tolist()] for i, k in enumerate(lens)]
    natural = np.minimum(rng.geometric(1 / 12, n), 200)
    return TokenizedPrompts.from_lists(seqs, max_tokens=[200] * n), natural


def _run_stopping(kv: KVLayout, reserve: bool, learn: bool = True) -> tuple[int, int]:
    prompts, natural = _stopping_early()
    cfg = SchedulerConfig(chunk_size=64, kv_threshold=0.9, decode_reserve=reserve)
    sched = BatchLLMScheduler(cfg, kv, prompts, None)
    if not learn:  # the reserve before it: every request projected to its max_tokens
        sched._lengths.table = lambda running: RemainingTable(None)  # type: ignore[method-assign]
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {c.seq_id: 7 for c in out.chunks if c.samples}
        stop = {s for s in sampled if len(sched._live[s].outputs) + 1 >= natural[s]}
        sched.update(out, sampled, stop)
    return sched.stats.preemptions, sched.stats.iterations


def test_learned_reserve_admits_by_how_long_rows_really_run() -> None:
    """A 200-token cap over ~12-token answers: projecting every row to its cap keeps most of
    the cache idle; the lengths learned from the finished rows fill it, and still preempt
    no more than admitting by blocks in use alone."""
    kv = KVLayout(num_blocks=64, block_size=4)
    capped_pre, capped_iters = _run_stopping(kv, True, learn=False)
    learned_pre, learned_iters = _run_stopping(kv, True)
    loose_pre, _ = _run_stopping(kv, False)
    assert capped_pre == 0
    assert learned_iters < 0.7 * capped_iters, (learned_iters, capped_iters)
    assert learned_pre <= loose_pre
