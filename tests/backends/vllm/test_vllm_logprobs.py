"""Log-probabilities on the vLLM backend: ``sampling.logprobs`` equals the native engine's (both the
log-softmax of the raw logits), with and without stop strings (DELTA outputs); per-row
sampling columns reach vLLM (scoring mode: test_vllm_scoring.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.runner.pipeline import run as run_job
from tests.backends.vllm.vllm_kit import job_for, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]


def results(model, data, out, backend, **sets):
    res = run_job(job_for(model, data, out, backend, **sets), progress=False)
    return pq.read_table(res.results_path).sort_by("row_id").to_pylist()


@pytest.mark.parametrize("stop", [None, '["zz"]'])
def test_vllm_logprobs_equal_native(model_dir, dataset, tmp_path, stop):
    sets = {"sampling.logprobs": "4"} | ({"sampling.stop": stop} if stop else {})
    native = results(model_dir, dataset, tmp_path / "n.parquet", "native", **sets)
    vllm = results(model_dir, dataset, tmp_path / "v.parquet", "vllm", **sets)
    assert len(native) == len(vllm)
    for a, b in zip(native, vllm, strict=True):
        assert a["output_token_ids"] == b["output_token_ids"]
        assert len(b["output_logprobs"]) == len(b["output_token_ids"])
        for sa, sb in zip(a["output_logprobs"], b["output_logprobs"], strict=True):
            assert sb["token_id"] == sa["token_id"]
            assert sb["logprob"] == pytest.approx(sa["logprob"], abs=1e-3)
            np.testing.assert_allclose(
                [t["logprob"] for t in sb["top"]], [t["logprob"] for t in sa["top"]], atol=1e-3
            )


def test_vllm_per_row_temperature(model_dir, dataset, tmp_path):
    data = pq.read_table(dataset)
    temp = [None] * data.num_rows
    temp[0] = 1.5
    path = tmp_path / "t.parquet"
    pq.write_table(data.append_column("t", pa.array(temp, pa.float64())), path)
    sets = {"input.temperature_column": "t", "sampling.max_tokens": "12"}
    native_greedy = results(model_dir, dataset, tmp_path / "g.parquet", "native")
    vllm = results(model_dir, path, tmp_path / "v2.parquet", "vllm", **sets)
    same = [
        a["output_token_ids"] == b["output_token_ids"]
        for a, b in zip(native_greedy, vllm, strict=True)
    ]
    assert all(same[1:])  # the other rows stay greedy
