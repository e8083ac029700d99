"""The batched sampler (``sample_batch``, ``uniform_draws``, ``finish_codes``, ``RowParams``)
against a per-row reference written out here (a Python value per row, one ``uniform_draw``
per drawn row) and ``check_stop``, on mixed batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.backends.native.engine import _per_row_params, _row_params
from batchjob.backends.native.sampling import (
    FINISH_REASONS,
    RowParams,
    _filter_top_k_top_p,
    check_stop,
    finish_codes,
    sample,
    sample_batch,
    uniform_draw,
    uniform_draws,
)
from batchjob.config import SamplingConfig
from batchjob.tokenize.prompts import TokenizedPrompts


def _reference_sample(
    logits: torch.Tensor,  # float32 [K, V]
    params: Sequence[SamplingConfig],  # [K]
    row_ids: Sequence[int],  # [K]: stable id of each row's request
    steps: Sequence[int],  # [K]: index of the token being generated (0 = first)
) -> torch.Tensor:  # int64 [K]
    """The reference sampler: Python lists, one row at a time."""
    k, v = logits.shape
    out = torch.empty(k, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        out[idx] = logits[idx].argmax(dim=-1)
    if not drawn:
        return out
    dev = logits.device
    idx = torch.tensor(drawn, device=dev)
    ps = [params[i] for i in drawn]
    temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
    probs = torch.softmax(logits[idx].float() / temp[:, None], dim=-1)  # [Ks, V]
    top_k = [p.top_k if 0 < p.top_k < v else v for p in ps]
    top_p = [p.top_p for p in ps]
    if min(top_k) < v or min(top_p) < 1.0:
        probs = _filter_top_k_top_p(probs, top_k, top_p)
    cdf = probs.cumsum(dim=-1)  # [Ks, V], token-id order
    u = torch.tensor(
        [
            uniform_draw(p.seed, int(row_ids[i]), int(steps[i]))
            for p, i in zip(ps, drawn, strict=True)
        ],
        dtype=torch.float32,
        device=dev,
    )
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # first cdf > target
    out[idx] = pick.clamp_max(v - 1)
    return out


KINDS = [
    SamplingConfig(temperature=0.0),
    SamplingConfig(temperature=0.0, top_k=3, seed=9),  # greedy: filters ignored
    SamplingConfig(temperature=1.0, seed=1),
    SamplingConfig(temperature=0.7, top_k=20, seed=2),
    SamplingConfig(temperature=1.3, top_p=0.9, seed=3),
    SamplingConfig(temperature=0.9, top_k=50, top_p=0.5),
    SamplingConfig(temperature=0.5, top_k=1, seed=2**40 + 5),
    SamplingConfig(temperature=2.0, top_p=0.05, seed=7),
]


def _batch(seed: int, k: int, v: int, kinds: Sequence[SamplingConfig]):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.normal(0, 3, (k, v)).astype(np.float32))
    params = [kinds[i] for i in rng.integers(0, len(kinds), k)]
    row_ids = rng.integers(-(2**40), 2**40, k)
    steps = rng.integers(0, 5000, k)
    return logits, params, row_ids, steps


def _table(params: Sequence[SamplingConfig]) -> tuple[RowParams, np.ndarray]:
    distinct = list(dict.fromkeys(params))
    index = np.asarray([distinct.index(p) for p in params], dtype=np.int64)
    return RowParams.build(distinct, index, eos_ids=(2,)), index


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.integers(1, 40), n_kinds=st.integers(1, len(KINDS)))
def test_batched_sampler_equals_the_per_row_path(seed, k, n_kinds):
    kinds = KINDS[:n_kinds] if seed % 2 else KINDS[-n_kinds:]
    logits, params, row_ids, steps = _batch(seed, k, 257, kinds)
    table, index = _table(params)
    got = sample_batch(logits, table, index, row_ids, steps)
    whole = _reference_sample(logits, params, row_ids.tolist(), steps.tolist())
    alone = [
        int(_reference_sample(logits[i : i + 1], [params[i]], [int(row_ids[i])], [int(steps[i])]))
        for i in range(k)
    ]
    assert got.tolist() == whole.tolist() == alone
    assert sample(logits, params, row_ids.tolist(), steps.tolist()).tolist() == alone


def test_all_greedy_batch_is_one_argmax():
    logits, _, row_ids, steps = _batch(3, 64, 1000, KINDS[:1])
    table, index = _table([KINDS[1]] * 64)
    assert torch.equal(sample_batch(logits, table, index, row_ids, steps), logits.argmax(-1))


def test_greedy_ties_take_the_first_index_as_torch_argmax():
    logits = torch.zeros(6, 50)
    logits[:, [3, 7, 40]] = 5.0  # a three-way tie for the maximum
    logits[4] = 0.0  # all equal
    logits[5, 12] = float("nan")  # NaN counts as the maximum in torch.argmax
    table, index = _table([KINDS[0]] * 6)
    got = sample_batch(logits, table, index, np.zeros(6, np.int64), np.zeros(6, np.int64))
    assert got.tolist() == logits.argmax(-1).tolist() == [3, 3, 3, 3, 0, 12]


def test_uniform_draws_equal_the_scalar_hash():
    rng = np.random.default_rng(0)
    seeds = np.concatenate([[0, 1, 2**63 - 1], rng.integers(0, 2**62, 200)]).astype(np.uint64)
    rows = np.concatenate([[0, -1, 2**62], rng.integers(-(2**62), 2**62, 200)])
    steps = np.concatenate([[0, 1, 10**9], rng.integers(0, 10**6, 200)])
    got = uniform_draws(seeds, rows, steps)
    want = [
        uniform_draw(int(s), int(r), int(t)) for s, r, t in zip(seeds, rows, steps, strict=True)
    ]
    assert got.tolist() == want
    assert ((got >= 0) & (got < 1)).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_finish_codes_equal_check_stop(seed):
    rng = np.random.default_rng(seed)
    kinds = [
        SamplingConfig(max_tokens=3),
        SamplingConfig(max_tokens=5, stop_token_ids=(4, 6)),
        SamplingConfig(max_tokens=4, ignore_eos=True),
        SamplingConfig(max_tokens=1, ignore_eos=True, stop_token_ids=(2,)),
        SamplingConfig(max_tokens=9, stop_token_ids=(7,), ignore_eos=True),
    ][: int(rng.integers(1, 6))]
    k = int(rng.integers(1, 50))
    params = [kinds[i] for i in rng.integers(0, len(kinds), k)]
    tokens = rng.integers(0, 10, k)
    steps = rng.integers(0, 9, k)
    eos = (2, 3)
    distinct = list(dict.fromkeys(params))
    index = np.asarray([distinct.index(p) for p in params], dtype=np.int64)
    table = RowParams.build(distinct, index, eos)
    got = [FINISH_REASONS[c] for c in finish_codes(tokens, table, index, steps)]
    want = [
        check_stop([0] * int(s), int(t), p, eos)
        for t, s, p in zip(tokens, steps, params, strict=True)
    ]
    assert got == want


@pytest.mark.parametrize("varied", [False, True])
def test_row_params_equal_the_per_row_settings(varied):
    n = 50
    mt = np.random.default_rng(1).integers(1, 6, n) if varied else np.full(n, 7)
    prompts = TokenizedPrompts.from_lists([[5, 6, 7]] * n, max_tokens=mt)
    base = SamplingConfig(temperature=0.8, top_k=4, seed=3, stop_token_ids=(9,))
    table = _row_params(base, prompts, eos=(2,))
    get = _per_row_params(base, prompts)
    assert [table.configs[i] for i in table.index] == [get(i) for i in range(n)]
    assert len(table.configs) == len(set(mt.tolist()))
