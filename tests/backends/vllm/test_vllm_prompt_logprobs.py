"""``sampling.prompt_logprobs`` on the vLLM backend: every prompt token's log-prob and top k
equal Hugging Face transformers' log-softmax over the prompt within 1e-4 (and the native
engine's), the first token null, on a prefix-shared dataset."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from batchjob.runner.pipeline import run as run_job
from batchjob.tokenize.tokenizer import load_tokenizer
from tests.backends.vllm.vllm_kit import job_for, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]
transformers = pytest.importorskip("transformers")


def _steps(table) -> list[list]:
    return table["prompt_logprobs"].to_pylist()


def test_prompt_logprobs_equal_hf_and_native(tmp_path, model_dir, dataset):
    sets = {"sampling.prompt_logprobs": "2", "sampling.max_tokens": "2"}
    vl = run_job(job_for(model_dir, dataset, tmp_path / "v.parquet", "vllm", **sets))
    nat = run_job(job_for(model_dir, dataset, tmp_path / "n.parquet", "native", **sets))
    v, n = pq.read_table(vl.results_path), pq.read_table(nat.results_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = pq.read_table(dataset)  # text prompts: the token ids come from the results
    assert v.num_rows == prompts.num_rows
    tok = load_tokenizer(model_dir)
    texts = prompts["prompt"].to_pylist()
    for text, vs, ns in zip(texts, _steps(v), _steps(n), strict=True):
        flat = tok.encode([text])[0].astype(np.int64)
        assert len(flat) == len(vs) == len(ns) and vs[0] is None and ns[0] is None
        assert (
            [s["token_id"] for s in vs[1:]] == [s["token_id"] for s in ns[1:]] == flat[1:].tolist()
        )
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.from_numpy(flat)[None]).logits[0].float(), -1)
        want = ref[torch.arange(len(flat) - 1), torch.from_numpy(flat[1:])].numpy()
        got_v = np.array([s["logprob"] for s in vs[1:]], dtype=np.float32)
        got_n = np.array([s["logprob"] for s in ns[1:]], dtype=np.float32)
        np.testing.assert_allclose(got_v, want, atol=1e-4)
        np.testing.assert_allclose(got_n, want, atol=1e-4)
        top = torch.topk(ref[:-1], 2, dim=-1).values.numpy()
        np.testing.assert_allclose(
            [[t["logprob"] for t in s["top"]] for s in vs[1:]], top, atol=1e-4
        )
