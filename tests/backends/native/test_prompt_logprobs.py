"""``sampling.prompt_logprobs`` on the native engine: every prompt token's log-prob and top k
equal Hugging Face transformers' log-softmax over the prompt within 1e-4, with shared
prefixes, chunks that split them, preemption, GQA; and a shared prefix's rows are read once
(the logits rows read equal the plan's computed prompt tokens less one sampling row per
request, where every member reading its own would read the prompt tokens less one each)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import batchjob
from batchjob.backends.native.engine import Engine
from batchjob.backends.native.models.loader import load_model
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig
from batchjob.plan.build import build_plan
from batchjob.testing.tiny_model import make_tiny_model
from tests.backends.native.test_engine_hf_parity import shared_prompts

transformers = pytest.importorskip("transformers")
K = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("plp"), kv_heads=1, heads=4)  # GQA 4:1
    model, info = load_model(folder, dtype="float32", device="cpu", attention="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = shared_prompts(info.vocab_size, seed=4)
    refs = []
    with torch.no_grad():
        for i in range(len(prompts)):
            ids = torch.tensor(prompts.row(i), dtype=torch.long)[None]
            refs.append(torch.log_softmax(hf(ids).logits[0].float(), dim=-1).numpy())
    return folder, model, info, prompts, refs


@pytest.mark.parametrize("chunk,kv_blocks", [(2048, 256), (13, 256), (24, 9)])
def test_prompt_logprobs_equal_hf(setup, chunk, kv_blocks):
    _, model, info, prompts, refs = setup
    bs = 8
    sched = SchedulerConfig(chunk_size=chunk, decode_reserve=kv_blocks >= 16)
    eng = EngineConfig(block_size=bs, kv_cache_bytes=kv_blocks * bs * info.kv_bytes_per_token)
    engine = Engine(model, info, sched, eng)
    plan = build_plan(prompts)
    got = {}
    run = engine.run(
        prompts,
        plan,
        SamplingConfig(max_tokens=6, ignore_eos=True, prompt_logprobs=K),
        lambda o: got.__setitem__(o.position, o.prompt_logprobs),
    )
    for i, ref in enumerate(refs):
        toks = prompts.row(i)
        lp = got[i]
        assert lp.logprob.shape == (len(toks),) and np.isnan(lp.logprob[0])
        want = ref[np.arange(len(toks) - 1), toks[1:]]  # position p predicts token p + 1
        np.testing.assert_allclose(lp.logprob[1:], want, atol=1e-4)
        top = np.sort(ref[:-1], axis=-1)[:, ::-1][:, :K]
        np.testing.assert_allclose(lp.top_logprobs[1:], top, atol=1e-4)
        np.testing.assert_allclose(np.take_along_axis(ref[:-1], lp.top_ids[1:], -1), top, atol=1e-4)
    if run.scheduler.preemptions == 0:  # each prefix position read once, for all its members
        once = plan.stats.single_level_prefill_tokens - len(prompts)
        assert engine.prompt_logprob_rows == once
        assert once < int(prompts.lengths.sum()) - len(prompts)  # what reading per member costs
    else:
        assert kv_blocks < 16


def test_prompt_logprobs_column(setup):
    folder, *_ = setup
    out = batchjob.generate(
        [[1, 50, 60, 70], [1, 50, 60, 80], [9]],
        model={"path": folder, "device": "cpu"},
        sampling={"max_tokens": 2, "prompt_logprobs": 2},
        engine={"threads": 1, "kv_cache_bytes": "8MiB"},
    )
    col = out["prompt_logprobs"]
    assert col.type == pa.list_(out.schema.field("prompt_logprobs").type.value_type)
    rows = col.to_pylist()
    assert [len(r) for r in rows] == [4, 4, 1]
    assert all(r[0] is None for r in rows)  # the first token has no log-prob (as in vLLM)
    assert [s["token_id"] for s in rows[0][1:]] == [50, 60, 70]
    assert rows[0][1] == rows[1][1] and rows[0][2] == rows[1][2]  # the shared prefix's
    assert all(len(s["top"]) == 2 for s in rows[0][1:])
