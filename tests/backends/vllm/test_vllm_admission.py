"""The vLLM scheduler subclass's admission limit (backends/vllm/scheduler.py) on scheduler
state built by hand: equal to a request-by-request reference (each candidate's projected
peak computed on its own), and its shortcut for a KV-full step (the first waiting request
cannot fit) returns what the full pass returns."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from tests.backends.vllm.vllm_kit import needs_vllm

pytestmark = [needs_vllm]


def _scheduler(rng: random.Random):
    """A BatchLLM scheduler's admission state: running and waiting requests of prefix groups
    (some prefixes pinned), a block pool partly used, learned decode lengths or none."""
    from batchjob.backends.decode_lengths import DecodeLengths
    from batchjob.backends.vllm.scheduler import EXTRA_KEY, _BatchLLMMixin, _Group

    bs = rng.choice([16, 32])
    groups: dict[str, _Group] = {}
    running, waiting = [], []
    for i in range(rng.randint(0, 40) + rng.randint(1, 30)):
        key = f"g{rng.randint(0, 8)}"
        prefix = rng.choice([0, 100, 512, 1000])
        if key not in groups:
            groups[key] = _Group(key, prefix // bs, rng.randint(2, 9))
            if prefix and rng.random() < 0.5:
                groups[key].pinned = [object()] * (prefix // bs)
        own = rng.randint(1, 600)
        out = rng.randint(0, 120)
        extra = {EXTRA_KEY: [key, prefix, groups[key].unfinished]} if rng.random() < 0.9 else {}
        r = SimpleNamespace(
            request_id=f"q{i}",
            sampling_params=SimpleNamespace(extra_args=extra),
            num_tokens=prefix + own + out,
            num_output_tokens=out,
            max_tokens=rng.choice([32, 128, 512]),
        )
        if i < 30 and rng.random() < 0.6:
            r.num_computed_tokens = r.num_tokens - rng.choice([0, 0, 1, rng.randint(1, own)])
            running.append(r)
        else:
            r.num_computed_tokens = 0
            waiting.append(r)
    lengths = DecodeLengths()
    for _ in range(rng.choice([0, 20])):
        lengths.finished(rng.randint(5, 100), rng.random() < 0.2)
    total = rng.randint(50, 2000)
    used = rng.randint(total // 2, total)

    class Hand(_BatchLLMMixin):
        def __init__(self) -> None:  # vLLM's Scheduler is not built: its state by hand
            self.block_size = bs
            free = SimpleNamespace(get_num_free_blocks=lambda: total - used)
            self.kv_cache_manager = SimpleNamespace(
                block_pool=SimpleNamespace(num_gpu_blocks=total + 1, **vars(free))
            )
            self.bj_kv_threshold = rng.choice([0.9, 1.0])
            self.max_num_running_reqs = rng.choice([8, 256])
            self.running, self.waiting = running, waiting
            self._bj_groups = groups
            self._bj_req_groups = {}
            for r in running + waiting:
                self._bj_remember(r)
            self._bj_lengths = lengths

    return Hand()


@pytest.mark.parametrize("seed", range(4))
def test_the_kv_full_shortcut_returns_what_the_full_pass_returns(seed, monkeypatch):
    rng = random.Random(seed)
    took = 0
    for _ in range(300):
        s = _scheduler(rng)
        cap = int(s.bj_kv_threshold * (s.kv_cache_manager.block_pool.num_gpu_blocks - 1))
        blocked = bool(s.waiting) and s._bj_first_waiting_blocked(s.bj_blocks_in_use(), cap)
        got = s._bj_admission_limit()
        monkeypatch.setattr(s, "_bj_first_waiting_blocked", lambda used, cap: False)
        assert got == s._bj_admission_limit()
        took += blocked
    assert 20 < took < 280  # both paths taken


def _reference_limit(s) -> int:
    """The admission rule written out request by request: the running requests and the
    waiting ones in order while every request's current blocks fit under the cap, then the
    most of those candidates whose projected peak (``projected_peak_blocks`` of the running
    and the first k) stays under it."""
    from batchjob.backends.kv_projection import projected_peak_blocks

    bs = s.block_size
    cap = int(s.bj_kv_threshold * (s.kv_cache_manager.block_pool.num_gpu_blocks - 1))
    n = len(s.running)
    if s.max_num_running_reqs - n <= 0 or not s.waiting:
        return max(1, n)
    est = s._bj_lengths.table(np.array([r.num_output_tokens for r in s.running], np.int64))
    tok, rem, shared, held, started = [], [], [], 0, set()
    for r in s.running:
        g = s._bj_group(r)
        p = g.prefix_blocks if g is not None and g.pinned else 0
        tok.append(max(r.num_computed_tokens, r.num_tokens))
        rem.append(est.remaining(r.num_output_tokens, r.max_tokens))
        shared.append(p)
        held += max(-(-r.num_computed_tokens // bs) - p, 0)
        if g is not None:
            started.add(id(g))
    started |= {id(g) for g in s._bj_groups.values() if g.pinned}
    base = s.bj_blocks_in_use() - held
    floor = base + sum(max(-(-t // bs) - p, 0) for t, p in zip(tok, shared, strict=True))
    for r in s.waiting:
        if len(tok) - n >= min(s.max_num_running_reqs - n, 256):
            break
        g = s._bj_group(r)
        p = g.prefix_blocks if g is not None and id(g) in started else 0
        floor += max(-(-r.num_tokens // bs) - p, 0)
        if floor > cap:
            break
        tok.append(r.num_tokens)
        rem.append(est.remaining(r.num_output_tokens, r.max_tokens))
        shared.append(p)
        if g is not None:
            started.add(id(g))
    arrays = [np.array(x, np.int64) for x in (tok, rem, shared)]
    k = 0
    while (
        n + k < len(tok)
        and base + projected_peak_blocks(*(a[: n + k + 1] for a in arrays), bs) <= cap
    ):
        k += 1
    k = k if n else max(k, 1)
    return max(1, min(n + k, s.max_num_running_reqs))


@pytest.mark.parametrize("seed", range(4))
def test_the_admission_limit_equals_the_request_by_request_rule(seed):
    rng = random.Random(100 + seed)
    for _ in range(300):
        s = _scheduler(rng)
        assert s._bj_admission_limit() == _reference_limit(s)
