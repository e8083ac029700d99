"""Log-probabilities and scoring mode against Hugging Face transformers' logits.

``sampling.logprobs``: each generated token's log-prob and the top-N equal the float32
log-softmax of HF's logits at that step. Scoring: each label's log-prob equals the sum of HF's
log-softmax over its tokens, teacher-forced after the prompt, for single- and multi-token
labels (shared first tokens included), with prefix-sharing plans and tiny chunks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from batchjob.backends.native.engine import Engine
from batchjob.backends.native.models.loader import load_model
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig
from batchjob.plan.build import build_plan
from batchjob.prompts import TokenizedPrompts
from batchjob.row_settings import RowSettings
from batchjob.scoring import LabelCombiner, expand
from batchjob.tiny_model import make_tiny_model

transformers = pytest.importorskip("transformers")

N_TOKENS = 6
TOP_N = 5


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param)
    model, info = load_model(folder, dtype="float32", device="cpu", attention="torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, info, hf


def prompts_with_sharing(vocab: int, seed: int = 3) -> TokenizedPrompts:
    rng = np.random.default_rng(seed)
    doc = rng.integers(5, vocab, 29)
    seqs = [np.concatenate([doc, rng.integers(5, vocab, rng.integers(1, 9))]) for _ in range(4)]
    seqs += [rng.integers(5, vocab, n) for n in (17, 3)]
    return TokenizedPrompts.from_lists(seqs, max_tokens=N_TOKENS)


def hf_logsoftmax(hf, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), V]: log-softmax of HF's logits at every position."""
    with torch.no_grad():
        logits = hf(torch.tensor(ids, dtype=torch.long)[None]).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def engine(model, info, chunk: int = 2048) -> Engine:
    return Engine(model, info, SchedulerConfig(chunk_size=chunk), EngineConfig(block_size=16))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_hf(models, temperature):
    model, info, hf = models
    prompts = prompts_with_sharing(info.vocab_size)
    outs = {}
    sampling = SamplingConfig(
        max_tokens=N_TOKENS, ignore_eos=True, logprobs=TOP_N, temperature=temperature, seed=7
    )
    engine(model, info).run(
        prompts, build_plan(prompts), sampling, lambda o: outs.__setitem__(o.position, o)
    )
    for i in range(len(prompts)):
        o = outs[i]
        toks = o.token_ids.tolist()
        assert o.logprobs is not None and len(o.logprobs.logprob) == len(toks) == N_TOKENS
        assert o.logprobs.top_ids.shape == (N_TOKENS, TOP_N)
        ref = hf_logsoftmax(hf, prompts.row(i).tolist() + toks)
        p = len(prompts.row(i))
        for s, tok in enumerate(toks):
            row = ref[p - 1 + s]  # predicts generated token s
            assert o.logprobs.logprob[s] == pytest.approx(float(row[tok]), abs=2e-4)
            top = row.topk(TOP_N)
            np.testing.assert_allclose(o.logprobs.top_logprobs[s], top.values.numpy(), atol=2e-4)
            # ids agree wherever the values are not (near-)tied
            gaps = np.diff(top.values.numpy())
            if np.all(np.abs(gaps) > 1e-4):
                assert o.logprobs.top_ids[s].tolist() == top.indices.tolist()
        if temperature == 0.0:
            assert all(o.logprobs.logprob[s] == o.logprobs.top_logprobs[s, 0] for s in range(6))


def test_logprobs_zero_is_chosen_only(models):
    model, info, _ = models
    prompts = prompts_with_sharing(info.vocab_size)
    outs = {}
    engine(model, info).run(
        prompts,
        None,
        SamplingConfig(max_tokens=3, ignore_eos=True, logprobs=0),
        lambda o: outs.__setitem__(o.position, o),
    )
    assert outs[0].logprobs.top_ids.shape == (N_TOKENS, 0)  # the rows' own max_tokens
    assert np.all(outs[0].logprobs.logprob <= 0)


def score(model, info, prompts: TokenizedPrompts, labels: list[list[int]], chunk: int):
    settings = RowSettings(
        row_ids=prompts.row_ids,
        labels=tuple(tuple(f"L{j}" for j in range(len(labels))) for _ in range(len(prompts))),
        label_tokens=tuple(
            tuple(np.asarray(t, dtype=np.int32) for t in labels) for _ in range(len(prompts))
        ),
    )
    prompts = dataclasses.replace(prompts, settings=settings)
    req = expand(prompts)
    got = {}
    comb = LabelCombiner(req, prompts.row_ids, lambda o: got.__setitem__(o.position, o))
    run = engine(model, info, chunk).run(
        req.prompts,
        build_plan(req.prompts),
        SamplingConfig(max_tokens=1),
        comb.on_request,
        score_targets=req.targets,
    )
    return [got[i] for i in range(len(prompts))], req, run


@pytest.mark.parametrize("chunk", [2048, 7])
@pytest.mark.parametrize(
    "labels",
    [
        [[11], [12], [40]],  # single-token: one request per row
        [[11, 30, 31], [11, 30, 9], [12], [40, 41]],  # multi-token, shared first tokens
    ],
)
def test_label_logprobs_match_hf(models, labels, chunk):
    model, info, hf = models
    prompts = prompts_with_sharing(info.vocab_size)
    outs, req, _ = score(model, info, prompts, labels, chunk)
    distinct_nodes = {tuple(t[:k]) for t in labels for k in range(len(t))}
    assert len(req.prompts) == len(prompts) * len(distinct_nodes)  # shared steps shared
    for i, o in enumerate(outs):
        p = prompts.row(i).tolist()
        want = []
        for t in labels:
            ref = hf_logsoftmax(hf, p + t)
            want.append(sum(float(ref[len(p) - 1 + k, tok]) for k, tok in enumerate(t)))
        np.testing.assert_allclose(o.label_logprobs, want, atol=3e-4)
        assert o.label == f"L{int(np.argmax(want))}"
        assert o.finish_reason == "score" and len(o.token_ids) == 0


def test_single_token_labels_cost_one_prefill(models):
    """Single-token labels: the requests are the prompts themselves, nothing decoded."""
    model, info, _ = models
    prompts = prompts_with_sharing(info.vocab_size)
    _, req, run = score(model, info, prompts, [[11], [12]], 2048)
    assert req.same_rows and req.prompts.tokens is prompts.tokens
    assert run.scheduler.decode_tokens == 0
    plan = build_plan(prompts)
    assert run.scheduler.prefill_tokens == plan.stats.single_level_prefill_tokens
    assert plan.stats.single_level_prefill_tokens < plan.stats.logical_prefill_tokens
