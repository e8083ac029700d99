"""The native sampler's logits processors against vLLM's own: penalties, logit bias, allowed
token ids, min_tokens and min_p (with temperature, top-k and top-p) on the same logits tensor.

vLLM's side is its sampler's code run in this process (``Sampler.apply_logits_processors``
with its ``MinTokens``/``LogitBias``/``MinP`` processors fed the requests' ``SamplingParams``,
then ``apply_temperature``, the argmax-invariant processors and ``apply_top_k_top_p``), so
the order of operations is vLLM's, not a copy. The native side is ``sampling_probs`` on the
engine's ``RowParams`` and ``DecodeState``. The distributions must agree within 1e-5; greedy
rows must pick the same token. Needs vllm (skipped without it)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from batchjob.backends.native.logits_processors import DecodeState, OutputHistory
from batchjob.backends.native.sampling import RowParams, sample_batch, sampling_probs
from batchjob.config import SamplingConfig

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed"
)
V = 512
EOS = (2,)


def _batch(seed: int, k: int):
    """Logits [k, V], prompts with repeats, outputs so far (repeats too)."""
    g = np.random.default_rng(seed)
    logits = torch.from_numpy(g.normal(0, 3, (k, V)).astype(np.float32))
    prompts = [g.integers(0, V, g.integers(3, 40)).tolist() for _ in range(k)]
    outputs = [g.choice(g.integers(0, V, 6), g.integers(0, 12)).tolist() for _ in range(k)]
    for i in range(k):  # make sure some of the best tokens are penalised
        top = torch.topk(logits[i], 4).indices.tolist()
        prompts[i] += top[:2]
        outputs[i] += top[2:] * (1 + i % 2)
    return logits, prompts, outputs


def _native(logits, configs, prompts, outputs, greedy=False):
    k = len(configs)
    table = RowParams.build(configs, np.arange(k), EOS)
    lengths = np.asarray([len(p) for p in prompts], np.int64)
    offsets = np.zeros(k + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.asarray([t for p in prompts for t in p], np.int32)
    state = DecodeState(table.procs, tokens, offsets, None, inplace=False)
    steps = np.asarray([len(o) for o in outputs], np.int64)
    seqs = np.arange(k, dtype=np.int64)
    if state.history is not None:  # the outputs so far, one step at a time as the engine does
        for s in range(int(steps.max(initial=0))):
            on = np.flatnonzero(steps > s)
            state.history.record(on, np.asarray([outputs[i][s] for i in on]), np.full(len(on), s))
    cfg = np.arange(k, dtype=np.int64)
    if greedy:
        ids = np.zeros(k, np.int64)
        return sample_batch(logits.clone(), table, cfg, ids, steps, seqs, state)
    return sampling_probs(logits.clone(), table, cfg, steps, seqs, state)


def _vllm(logits, configs, prompts, outputs, greedy=False):
    """vLLM's processing of ``logits`` for requests with these settings."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import (
        BatchUpdate,
        LogitBiasLogitsProcessor,
        LogitsProcessors,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    k = len(configs)
    params = []
    for c in configs:
        p = SamplingParams(
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            min_p=c.min_p,
            presence_penalty=c.presence_penalty,
            frequency_penalty=c.frequency_penalty,
            repetition_penalty=c.repetition_penalty,
            min_tokens=c.min_tokens,
            logit_bias=dict(c.logit_bias) or None,
            allowed_token_ids=list(c.allowed_token_ids) or None,
            stop_token_ids=list(c.stop_token_ids),
            max_tokens=64,
        )
        p.update_from_generation_config({"eos_token_id": list(EOS)}, None)
        params.append(p)
    cpu = torch.device("cpu")
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=k))
    procs = [
        MinTokensLogitsProcessor(config, cpu, False),
        LogitBiasLogitsProcessor(config, cpu, False),
        MinPLogitsProcessor(config, cpu, False),
    ]
    added = [(i, p, prompts[i], outputs[i]) for i, p in enumerate(params)]
    for proc in procs:
        proc.update_state(BatchUpdate(batch_size=k, removed=[], added=added, moved=[]))
    allowed = None
    if any(c.allowed_token_ids for c in configs):
        allowed = torch.zeros(k, V, dtype=torch.bool)
        for i, c in enumerate(configs):
            if c.allowed_token_ids:
                allowed[i] = True
                allowed[i, list(c.allowed_token_ids)] = False
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((k, width), V, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, : len(p)] = torch.tensor(p)
    temps = torch.tensor([c.temperature for c in configs], dtype=torch.float32)
    md = SamplingMetadata(
        temperature=temps,
        all_greedy=greedy,
        all_random=not greedy,
        top_p=torch.tensor([c.top_p for c in configs], dtype=torch.float32),
        top_k=torch.tensor([c.top_k if c.top_k else V for c in configs], dtype=torch.long),
        generators={},
        max_num_logprobs=None,
        no_penalties=not any(c.processors() for c in configs),
        prompt_token_ids=prompt_ids,
        frequency_penalties=torch.tensor([c.frequency_penalty for c in configs]),
        presence_penalties=torch.tensor([c.presence_penalty for c in configs]),
        repetition_penalties=torch.tensor([c.repetition_penalty for c in configs]),
        output_token_ids=[list(o) for o in outputs],
        allowed_token_ids_mask=allowed,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(procs),
    )
    sampler = Sampler()
    x = sampler.apply_logits_processors(logits.clone(), md, predict_bonus_token=False)
    if greedy:
        return x.argmax(dim=-1)
    x = Sampler.apply_temperature(x, md.temperature, md.all_random)
    for proc in md.logitsprocs.argmax_invariant:
        x = proc.apply(x)
    x = apply_top_k_top_p(x, md.top_k, md.top_p)
    return x.softmax(dim=-1, dtype=torch.float32)


def _settings(seed: int) -> list[SamplingConfig]:
    """Each processor alone, then mixed, on drawn rows (temperature > 0)."""
    base = SamplingConfig(temperature=0.8, max_tokens=64)
    g = np.random.default_rng(seed)
    some = sorted({int(t) for t in g.integers(0, V, 40)} | {2})
    return [
        replace(base, presence_penalty=1.5),
        replace(base, frequency_penalty=0.7),
        replace(base, repetition_penalty=1.7),
        replace(base, repetition_penalty=0.6),
        replace(base, presence_penalty=-1.0, frequency_penalty=-0.5),
        replace(base, logit_bias={int(t): float(g.normal(0, 4)) for t in some[:12]}),
        replace(base, allowed_token_ids=tuple(some)),
        replace(base, min_tokens=40, stop_token_ids=(5, 9)),
        replace(base, min_p=0.1),
        replace(base, min_p=0.3, temperature=1.3, top_k=50),
        replace(base, min_p=0.05, top_p=0.8),
        replace(
            base,
            presence_penalty=0.4,
            frequency_penalty=0.3,
            repetition_penalty=1.3,
            logit_bias={3: 5.0, 4: -100.0},
            min_tokens=3,
            min_p=0.02,
            top_k=100,
            top_p=0.9,
        ),
        base,  # no processor: unchanged next to the others
    ]


@needs_vllm
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processed_distribution_equals_vllms(seed):
    configs = _settings(seed)
    logits, prompts, outputs = _batch(seed, len(configs))
    ours = _native(logits, configs, prompts, outputs)
    theirs = _vllm(logits, configs, prompts, outputs)
    assert torch.isfinite(ours).all() and torch.isfinite(theirs).all()
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-5, rtol=0)
    plain = _native(logits, [configs[-1]] * len(configs), prompts, outputs)
    changed = [i for i in range(len(configs) - 1) if not torch.allclose(ours[i], plain[i])]
    assert changed == list(range(len(configs) - 1))  # every setting changes its distribution


@needs_vllm
@pytest.mark.parametrize("seed", [3, 4])
def test_greedy_picks_equal_vllms(seed):
    configs = [replace(c, temperature=0.0, min_p=0.0, top_k=0, top_p=1.0) for c in _settings(seed)]
    logits, prompts, outputs = _batch(seed, len(configs))
    ours = _native(logits, configs, prompts, outputs, greedy=True)
    theirs = _vllm(logits, configs, prompts, outputs, greedy=True)
    assert ours.tolist() == theirs.tolist()
    assert ours.tolist() != logits.argmax(dim=-1).tolist()  # the processors changed picks


def test_min_tokens_masks_stop_ids_and_eos_until_reached():
    c = SamplingConfig(min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    logits = torch.zeros(3, 16)
    logits[:, 7] = logits[:, 2] = 10.0  # a stop id and EOS lead
    table = RowParams.build([c], np.zeros(3, np.int64), EOS)
    state = DecodeState(table.procs, np.zeros(3, np.int32), np.arange(4), None, False)
    steps = np.asarray([0, 1, 2])
    got = sample_batch(logits, table, np.zeros(3, np.int64), np.zeros(3), steps, steps, state)
    assert got.tolist()[:2] == [0, 0] and got.tolist()[2] == 2  # EOS masked even with ignore_eos


def test_output_history_reuses_rows_and_counts():
    h = OutputHistory(5)
    h.record(np.asarray([0, 3]), np.asarray([4, 4]), np.asarray([0, 0]))
    h.record(np.asarray([0, 3]), np.asarray([4, 1]), np.asarray([1, 1]))
    counts = h.counts(np.asarray([0, 3, 2]), np.asarray([2, 2, 0]), 6)
    assert counts.tolist() == [[0, 0, 0, 0, 2, 0], [0, 1, 0, 0, 1, 0], [0] * 6]
    h.release(0)
    h.record(np.asarray([2]), np.asarray([5]), np.asarray([0]))  # takes row 0's buffer row
    assert h.slot[2] == 0 and h.used == 2
    for s in range(40):  # grows past its first width
        h.record(np.asarray([2]), np.asarray([s % 6]), np.asarray([s]))
    assert h.counts(np.asarray([2]), np.asarray([40]), 6).sum() == 40
