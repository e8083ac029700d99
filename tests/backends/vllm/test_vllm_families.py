"""The families the native engine runs beyond Llama's layout against vLLM's implementations
of them (Granite's four multipliers; SmolLM3's layers without RoPE, OLMo2's and OLMo3's norms
on the branch outputs, which vLLM 0.32 runs through its transformers backend): greedy
float32 outputs equal token for token, through both backends on the same job."""

from __future__ import annotations

import pytest

from tests.backends.vllm.vllm_kit import both_results, build_model, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.mark.parametrize("family", ["granite", "smollm3", "olmo2", "olmo3"])
def test_family_outputs_equal_vllms(family, dataset, tmp_path):
    model = build_model(tmp_path / family, family=family)
    # 8 MiB of KV: vLLM's pool for OLMo3's sliding-window layers needs more than 2 MiB
    sets = {"sampling.max_tokens": "12", "engine.kv_cache_bytes": "8MiB"}
    got = both_results(model, dataset, tmp_path, **sets)
    native, vllm = got["native"], got["vllm"]
    assert [r["row_id"] for r in native] == [r["row_id"] for r in vllm]
    differ = [
        n["row_id"] for n, v in zip(native, vllm, strict=True)
        if n["output_token_ids"] != v["output_token_ids"]
    ]  # fmt: skip
    assert not differ, f"{family}: rows {differ[:5]} of {len(native)} differ from vLLM's"
    assert len({tuple(r["output_token_ids"]) for r in native}) > len(native) // 2  # not collapsed
