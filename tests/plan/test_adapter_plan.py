"""Groups keyed by (adapter, tokens): rows share a group prefix only with rows of the same
LoRA adapter (``TokenizedPrompts.adapter``; -1: the base model), since KV computed under
one adapter's weights is no other's."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.plan import build_plan
from batchjob.tokenize.prompts import TokenizedPrompts
from batchjob.tokenize.samples import expand_samples
from tests.plan.test_plan_build import check_plan, groups
from tests.plan.test_prefix_tree import prompt_lists


def _keyed(seqs, adapters, **kw) -> TokenizedPrompts:
    p = TokenizedPrompts.from_lists(seqs, **kw)
    return dataclasses.replace(p, adapter=np.asarray(adapters, dtype=np.int32))


def test_two_adapters_and_none_plan_three_families() -> None:
    """One document asked 12 questions, 4 under adapter 0, 4 under 1, 4 on the base: three
    groups sharing the document, where the unkeyed plan makes one."""
    doc = list(range(100, 140))
    seqs = [[*doc, 200 + i, 300 + i] for i in range(12)]
    adapters = [0, 1, -1] * 4
    plan = build_plan(_keyed(seqs, adapters))
    assert build_plan(TokenizedPrompts.from_lists(seqs)).num_groups == 1
    fams = [{adapters[m] for m in members} for members, _ in groups(plan)]
    assert sorted(f.pop() for f in fams if len(f) == 1) == [-1, 0, 1] and len(fams) == 3
    assert plan.group_prefix_len.tolist() == [40, 40, 40]
    s = plan.stats
    assert s.single_level_prefill_tokens == 3 * 40 + 12 * 2


@settings(max_examples=60, deadline=None)
@given(prompt_lists(max_prompts=9), st.integers(0, 2**16))
def test_keyed_plan_is_the_plan_of_each_adapter(seqs, seed) -> None:
    rng = np.random.default_rng(seed)
    adapters = rng.integers(-1, 2, len(seqs))
    prompts = _keyed(seqs, adapters, max_tokens=rng.integers(1, 40, len(seqs)))
    plan = build_plan(prompts)
    check_plan(plan, prompts)  # invariants and stats as any plan's
    for members, _ in groups(plan):
        assert len({int(adapters[m]) for m in members}) == 1
    want = 0
    for a in np.unique(adapters):
        pos = np.flatnonzero(adapters == a)
        want += build_plan(prompts.take(pos)).stats.single_level_prefill_tokens
    assert plan.stats.single_level_prefill_tokens == want


def test_samples_keep_their_adapter() -> None:
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6]]
    prompts = expand_samples(_keyed(seqs, [0, 1, 0]), 2)
    assert prompts.adapter.tolist() == [0, 0, 1, 1, 0, 0]
    plan = build_plan(prompts)
    for members, _ in groups(plan):
        assert len({int(prompts.adapter[m]) for m in members}) == 1
