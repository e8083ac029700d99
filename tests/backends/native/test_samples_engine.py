"""Samples of a row on the native engine (``sampling.n``): all but the first copy the first's
own prompt KV and compute only their last prompt token. Greedy samples equal Hugging Face
transformers token for token whether the copy happens, a KV so small that samples are
preempted and recompute, chunks that split prompts; prompt log-probs equal HF for every
sample; the tokens computed are the rows' plan plus one per further sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchjob.backends.native.engine import Engine
from batchjob.backends.native.models.loader import load_model
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig
from batchjob.plan.build import build_plan
from batchjob.testing.tiny_model import make_tiny_model
from batchjob.tokenize.samples import expand_samples
from tests.backends.native.test_engine_hf_parity import hf_greedy, shared_prompts

transformers = pytest.importorskip("transformers")
N, MAX_TOKENS = 3, 10  # shared_prompts rows have max_tokens 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("samples"), family="qwen2")
    model, info = load_model(folder, dtype="float32", device="cpu", attention="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = shared_prompts(info.vocab_size, seed=6)
    refs = [hf_greedy(hf, rows.row(i), MAX_TOKENS) for i in range(len(rows))]
    with torch.no_grad():
        lps = [
            torch.log_softmax(hf(torch.tensor(rows.row(i), dtype=torch.long)[None]).logits[0], -1)
            for i in range(len(rows))
        ]
    return model, info, rows, refs, lps


@pytest.mark.parametrize("chunk,kv_blocks", [(2048, 256), (7, 256), (24, 10)])
def test_samples_copy_the_first_ones_prompt(setup, chunk, kv_blocks):
    model, info, rows, refs, lps = setup
    prompts = expand_samples(rows, N)
    bs = 8
    sched = SchedulerConfig(chunk_size=chunk, decode_reserve=kv_blocks >= 16)
    eng = EngineConfig(block_size=bs, kv_cache_bytes=kv_blocks * bs * info.kv_bytes_per_token)
    engine = Engine(model, info, sched, eng)
    plan = build_plan(prompts)
    outs, plps = {}, {}

    def done(o):
        outs[o.position] = o.token_ids.tolist()
        plps[o.position] = o.prompt_logprobs

    params = SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1)
    run = engine.run(prompts, plan, params, done)
    for pos in range(len(prompts)):
        r = int(prompts.row_ids[pos])
        assert outs[pos] == refs[r], (pos, r)
        toks = rows.row(r)
        want = lps[r][np.arange(len(toks) - 1), toks[1:]].numpy()
        np.testing.assert_allclose(plps[pos].logprob[1:], want, atol=1e-4)
    stats = run.scheduler
    assert stats.copied_tokens > 0
    if stats.preemptions == 0:
        rows_plan = build_plan(rows)
        want = rows_plan.stats.single_level_prefill_tokens + (N - 1) * len(rows)
        assert stats.prefill_tokens == want == plan.stats.single_level_prefill_tokens
    else:
        assert kv_blocks < 16
