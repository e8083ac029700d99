"""A job's attention work as the vllm backend's timed steps count it (backends/vllm/job_mix.py):
real plans of prompts that share a document or nothing, against the steps' own shapes."""

from __future__ import annotations

import numpy as np
import pytest

from batchjob.backends.vllm.job_mix import STEPS, WEIGHTS, JobMix, saved_share, step_tokens
from batchjob.plan.build import build_plan
from batchjob.tokenize.prompts import TokenizedPrompts


def prompts_of(groups: int, members: int, prefix: int, own: int, max_tokens: int):
    """``groups`` x ``members`` prompts: each group's ``prefix`` tokens shared, then ``own``
    tokens no other prompt has (distinct from the first)."""
    rows, nxt = [], 1
    for _ in range(groups):
        doc = np.arange(nxt, nxt + prefix)
        nxt += prefix
        for _ in range(members):
            rows.append(np.concatenate([doc, np.arange(nxt, nxt + own)]))
            nxt += own
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = len(rows)
    return TokenizedPrompts(
        np.arange(n, dtype=np.int64),
        np.concatenate(rows).astype(np.int32),
        offsets,
        np.full(n, max_tokens, dtype=np.int32),
    )


def mix_of(groups: int, members: int, prefix: int, own: int, max_tokens: int = 32) -> JobMix:
    p = prompts_of(groups, members, prefix, own, max_tokens)
    return JobMix.of(build_plan(p), p.lengths)


def test_the_steps_shapes_and_their_savings():
    assert {k: step_tokens(k) for k in STEPS} == {
        "decode": 128, "decode_alone": 32, "prefill": 2048, "prefill_alone": 2048
    }  # fmt: skip
    # the unshared steps read as much context a query as the shared ones
    assert STEPS["decode_alone"][3] == STEPS["decode"][2] + STEPS["decode"][3]
    assert STEPS["prefill_alone"][3] == STEPS["prefill"][2] + STEPS["prefill"][3]
    assert saved_share("decode") == pytest.approx(1024 * 7 / 8 / 1088)
    assert saved_share("prefill") == pytest.approx(512 * 15 / 16 / (512 + 64))


def test_a_job_that_shares_nothing_weighs_the_unshared_steps():
    mix = mix_of(groups=40, members=1, prefix=0, own=300)
    assert mix.decode_shared == 0 and mix.prefill_shared == 0
    w = mix.weights()
    assert w["decode"] == 0 and w["prefill"] == 0
    assert w["decode_alone"] == pytest.approx(mix.decode_tokens / 32)
    assert w["prefill_alone"] == pytest.approx(mix.prefill_tokens / 2048)


def test_a_job_shaped_like_the_shared_steps_weighs_them_alone():
    # the decode step's groups: 8 members over a 1,024-token prefix, 64 tokens of their own
    mix = mix_of(groups=16, members=8, prefix=1024, own=64, max_tokens=1)
    assert mix.decode_shared == pytest.approx(1.0, abs=1e-3)
    w = mix.weights()
    assert w["decode"] == pytest.approx(mix.decode_tokens / 128 * mix.decode_shared)
    assert w["decode_alone"] == pytest.approx(0.0, abs=1e-2 * w["decode"])
    # more members over a longer document save more than the step does: capped at the step
    assert mix_of(groups=4, members=32, prefix=3000, own=30).decode_shared == 1.0


def test_sharing_moves_a_job_between_the_steps():
    pairs = mix_of(groups=20, members=2, prefix=512, own=128)
    eights = mix_of(groups=5, members=8, prefix=512, own=128)
    short = mix_of(groups=5, members=8, prefix=64, own=512)
    for a, b in ((pairs, eights), (short, eights)):
        assert 0 < a.decode_shared < b.decode_shared <= 1
        assert 0 < a.prefill_shared < b.prefill_shared <= 1
    # two members over a 512-token prefix, 128 own + 16 decoded on average: 256 / 656
    assert pairs.decode_shared == pytest.approx(256 / (512 + 128 + 16) / saved_share("decode"))


def test_no_tokens_weighs_three_shared_decode_steps_a_prefill_step():
    assert JobMix(0, 0).weights() == WEIGHTS
    assert WEIGHTS["decode"] == 3 * WEIGHTS["prefill"]
    assert WEIGHTS["decode_alone"] == WEIGHTS["prefill_alone"] == 0


def test_counting_in_chunks_gives_the_whole_plans_mix(monkeypatch):
    from batchjob.backends.vllm import job_mix

    p = prompts_of(groups=7, members=5, prefix=96, own=40, max_tokens=8)
    plan = build_plan(p)
    whole = JobMix.of(plan, p.lengths)
    monkeypatch.setattr(job_mix, "CHUNK", 3)  # chunks that cut through groups
    chunked = JobMix.of(plan, p.lengths)
    assert chunked.__dict__ == pytest.approx(whole.__dict__)
    assert 0 < whole.decode_shared < 1 and 0 < whole.prefill_shared < 1
