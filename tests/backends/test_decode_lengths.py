"""Decode lengths learned from finished requests (``backends.decode_lengths``): the
Kaplan-Meier quantile against a brute-force product-limit estimate, the fallbacks to the
limit, and the censoring of running requests that keeps the estimate from learning only
the short rows that finish first."""

from __future__ import annotations

import numpy as np
import pytest

from batchjob.backends.decode_lengths import MIN_ENDS, QUANTILE, DecodeLengths


def _brute_remaining(ended, capped, running, out, limit, q=QUANTILE):
    """Product-limit survival by the textbook loop, then the first length past ``out``
    whose conditional survival drops to 1 - q (the limit where none does)."""
    obs = [(x, 1) for x in ended] + [(x, 0) for x in capped] + [(x, 0) for x in running]
    top = max([x for x, _ in obs] + [out]) + 1
    surv, s = [], 1.0
    for t in range(top):
        at_risk = sum(1 for x, _ in obs if x >= t)
        events = sum(1 for x, e in obs if x == t and e)
        s *= 1 - events / at_risk if at_risk else 1.0
        surv.append(s)
    if len(ended) < MIN_ENDS or surv[out] == 0:
        return max(limit - out, 1)
    for t in range(out + 1, top):
        if surv[t] <= (1 - q) * surv[out] * (1 + 1e-12):
            return min(t - out, max(limit - out, 1))
    return max(limit - out, 1)


def _learned(ended, capped):
    d = DecodeLengths()
    for x in ended:
        d.finished(int(x), False)
    for x in capped:
        d.finished(int(x), True)
    return d


def test_uncensored_quantile_is_the_empirical_one() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.geometric(1 / 50, 3000)
    table = _learned(lengths, []).table(np.array([], np.int64))
    assert table.remaining(0, 10_000) == int(np.quantile(lengths, QUANTILE, method="inverted_cdf"))
    tail = lengths[lengths > 100]  # given 100 outputs so far
    want = int(np.quantile(tail, QUANTILE, method="inverted_cdf")) - 100
    assert table.remaining(100, 10_000) == want


@pytest.mark.parametrize("seed", range(30))
def test_matches_a_brute_force_product_limit_estimate(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ended = rng.integers(1, 40, int(rng.integers(0, 30))).tolist()
    capped = rng.integers(1, 40, int(rng.integers(0, 10))).tolist()
    running = rng.integers(0, 45, int(rng.integers(0, 10))).tolist()
    table = _learned(ended, capped).table(np.asarray(running, np.int64))
    outs = np.arange(0, 50)
    limits = rng.integers(1, 80, len(outs))
    pairs = [(int(o), int(m)) for o, m in zip(outs, limits, strict=True)]
    got = [table.remaining(o, m) for o, m in pairs]
    want = [_brute_remaining(ended, capped, running, o, m) for o, m in pairs]
    assert got == want


def test_rows_that_run_to_their_limit_keep_the_limit() -> None:
    """ignore_eos, or answers longer than the cap: nothing is learned below the limit."""
    table = _learned([], [32] * 200).table(np.array([3, 10, 31]))
    assert [table.remaining(o, 32) for o in (0, 3, 31)] == [32, 29, 1]


def test_too_few_stops_keep_the_limit() -> None:
    table = _learned([5] * (MIN_ENDS - 1), []).table(np.array([], np.int64))
    assert table.remaining(0, 500) == 500
    table = _learned([5] * MIN_ENDS, []).table(np.array([], np.int64))
    assert table.remaining(0, 500) == 5


def test_running_requests_are_censored_not_ignored() -> None:
    """Early in a run only the short rows have finished. Counting the long ones still
    running (censored at their current length) keeps the estimate from collapsing onto
    the short ones: here it stays at the limit, where the finished rows alone say less."""
    rng = np.random.default_rng(1)
    lengths = rng.geometric(1 / 50, 500)
    now = int(np.quantile(lengths, QUANTILE)) - 5  # the rows running are this far
    short, still = lengths[lengths <= now], lengths[lengths > now]
    alone = _learned(short, []).table(np.array([], np.int64)).remaining(0, 1024)
    censored = _learned(short, []).table(np.full(len(still), now)).remaining(0, 1024)
    assert alone <= now < np.quantile(lengths, QUANTILE) <= censored
    # later, with every row finished, the estimate is the true quantile
    done = _learned(lengths, []).table(np.array([], np.int64)).remaining(0, 1024)
    assert done == int(np.quantile(lengths, QUANTILE, method="inverted_cdf"))


def test_estimate_is_at_least_one_and_at_most_the_limit() -> None:
    table = _learned([1] * 50 + [100] * 5, []).table(np.array([200]))
    for out in range(0, 260, 7):
        for limit in (out, out + 1, out + 3, 1000):
            assert 1 <= table.remaining(out, limit) <= max(limit - out, 1)


@pytest.mark.parametrize("seed", range(4))
def test_remaining_array_is_remaining_of_each(seed: int) -> None:
    """The vLLM scheduler's vectorised estimate: element for element the scalar one, with
    nothing learned, with a learned curve, and past its end."""
    rng = np.random.default_rng(seed)
    ended, capped = rng.integers(1, 150, rng.integers(0, 40)), rng.integers(1, 150, 5)
    running = rng.integers(0, 300, 20)
    table = _learned(ended, capped).table(running)
    out = np.concatenate([running, rng.integers(0, 400, 50), [0, 1]])
    limit = out + rng.integers(-5, 300, len(out))
    want = [table.remaining(int(o), int(m)) for o, m in zip(out, limit, strict=True)]
    assert table.remaining_array(out, limit).tolist() == want
