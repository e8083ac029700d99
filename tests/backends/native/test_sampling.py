"""Sampler: greedy, seeded batch-independent draws, top-k/top-p support, stop conditions."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.backends.native.sampling import check_stop, sample, truncate_at_stop
from batchjob.config import SamplingConfig
from batchjob.errors import ConfigError


def _logits(k: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(k, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(16, 500)
    params = [SamplingConfig(temperature=0.0, top_k=3, seed=i) for i in range(16)]
    assert torch.equal(sample(logits, params, range(16), [0] * 16), logits.argmax(-1))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), shuffle_seed=st.integers(0, 1000))
def test_seeded_draws_do_not_depend_on_the_batch(seed, shuffle_seed):
    k, v = 12, 300
    logits = _logits(k, v, seed % 1000)
    kinds = [
        SamplingConfig(temperature=1.0, seed=seed),
        SamplingConfig(temperature=0.7, top_k=20, seed=seed + 1),
        SamplingConfig(temperature=1.3, top_p=0.9, seed=seed),
        SamplingConfig(temperature=0.9, top_k=50, top_p=0.5),
        SamplingConfig(temperature=0.0),
    ]
    params = [kinds[i % len(kinds)] for i in range(k)]
    row_ids = [1000 + 7 * i for i in range(k)]
    steps = [i % 4 for i in range(k)]
    batch = sample(logits, params, row_ids, steps)
    alone = [
        int(sample(logits[i : i + 1], [params[i]], [row_ids[i]], [steps[i]])) for i in range(k)
    ]
    assert batch.tolist() == alone
    order = list(range(k))
    random.Random(shuffle_seed).shuffle(order)
    shuffled = sample(logits[order], [params[i] for i in order], [row_ids[i] for i in order],
                      [steps[i] for i in order])  # fmt: skip
    assert shuffled.tolist() == [alone[i] for i in order]


def test_draws_vary_with_step_row_and_seed():
    logits = torch.zeros(1, 1000)  # uniform: every draw is a fresh token
    p = SamplingConfig(temperature=1.0, seed=5)
    by_step = {int(sample(logits, [p], [0], [s])) for s in range(50)}
    by_row = {int(sample(logits, [p], [r], [0])) for r in range(50)}
    by_seed = {
        int(sample(logits, [SamplingConfig(temperature=1.0, seed=s)], [0], [0])) for s in range(50)
    }
    assert min(len(by_step), len(by_row), len(by_seed)) > 40


def _draws(probs: list[float], params: SamplingConfig, n: int = 4000) -> torch.Tensor:
    """n draws for one distribution: n rows of the same logits, distinct row ids."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    return sample(logits, [params] * n, range(n), [0] * n)


def test_unfiltered_draws_follow_the_distribution():
    probs = [0.4, 0.3, 0.2, 0.1]
    draws = _draws(probs, SamplingConfig(temperature=1.0, seed=1))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.tensor(probs), atol=0.03)


def test_top_k_restricts_support():
    logits = _logits(1, 200, seed=9)[0]
    top5 = set(logits.topk(5).indices.tolist())
    probs = torch.softmax(logits, -1).tolist()
    draws = _draws(probs, SamplingConfig(temperature=1.0, top_k=5, seed=2))
    assert set(draws.tolist()) == top5


def test_top_p_restricts_support_and_renormalises():
    probs = [0.05, 0.5, 0.15, 0.3]  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    draws = _draws(probs, SamplingConfig(temperature=1.0, top_p=0.8, seed=3))
    assert set(draws.tolist()) == {1, 3}  # 0.5 + 0.3 reaches 0.8: token 2 is cut
    share = (draws == 1).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.03
    draws = _draws(probs, SamplingConfig(temperature=1.0, top_p=0.81, seed=3))
    assert set(draws.tolist()) == {1, 2, 3}


def test_top_k_then_top_p_and_low_temperature():
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    draws = _draws(probs, SamplingConfig(temperature=1.0, top_k=3, top_p=0.6, seed=4))
    assert set(draws.tolist()) == {0, 1}  # top-p over the top-3 mass 0.75: 0.3 + 0.25 >= 0.45
    cold = _draws(probs, SamplingConfig(temperature=0.05, seed=4), n=500)
    assert (cold == 0).float().mean() > 0.95


def test_params_validation():
    """The sampler takes SamplingConfig as is: its checks are the config's, naming the key."""
    with pytest.raises(ConfigError, match=r"sampling\.temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ConfigError, match=r"sampling\.top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ConfigError, match=r"sampling\.max_tokens"):
        SamplingConfig(max_tokens=0)
    with pytest.raises(ConfigError, match=r"sampling\.top_k"):
        SamplingConfig(top_k=-2)
    assert SamplingConfig(top_k=-1).top_k == 0  # vLLM's spelling of "off"
    with pytest.raises(ConfigError, match=r"sampling\.stop"):
        SamplingConfig(stop=["x", ""])
    assert SamplingConfig(stop_token_ids=[3, 4], stop=["x"]).stop_token_ids == (3, 4)


def test_top_k_zero_and_above_vocab_are_off():
    logits = _logits(3, 40, seed=5)
    rows, steps = [11, 12, 13], [0, 1, 2]
    full = sample(logits, [SamplingConfig(temperature=1.0, seed=9)] * 3, rows, steps)
    for k in (0, 40, 1000):
        p = SamplingConfig(temperature=1.0, top_k=k, seed=9)
        assert torch.equal(sample(logits, [p] * 3, rows, steps), full)


def test_check_stop():
    p = SamplingConfig(max_tokens=3, stop_token_ids=(9,))
    eos = [2]
    assert check_stop([], 5, p, eos) is None
    assert check_stop([5], 2, p, eos) == "stop"
    assert check_stop([5], 9, p, eos) == "stop"
    assert check_stop([5, 6], 7, p, eos) == "length"
    assert check_stop([5, 6], 2, p, eos) == "stop"  # EOS on the last allowed token
    ignore = SamplingConfig(max_tokens=3, ignore_eos=True)
    assert check_stop([5], 2, ignore, eos) is None
    assert check_stop([5, 2], 2, ignore, eos) == "length"


def test_truncate_at_stop():
    assert truncate_at_stop("hello world", ()) == ("hello world", False)
    assert truncate_at_stop("hello world. Next", (".", "wor")) == ("hello ", True)
    assert truncate_at_stop("abc END def", ("END",)) == ("abc ", True)
    # incremental: "EN" was checked at the previous step, "D" completes the stop string
    assert truncate_at_stop("abc END", ("END",), checked=len("abc EN")) == ("abc ", True)
    assert truncate_at_stop("END abc", ("END",), checked=len("END ab")) == ("END abc", False)
