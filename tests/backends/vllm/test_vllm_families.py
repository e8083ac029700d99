"""The families the native engine runs beyond Llama's layout against vLLM's implementations
of them (Granite's four multipliers; SmolLM3's layers without RoPE, OLMo2's and OLMo3's norms
on the branch outputs, which vLLM 0.32 runs through its transformers backend; Phi3's fused
checkpoint tensors, RoPE over part of each head and longrope; sliding windows; Gemma3's
norms of 1 + w around both branches, GELU, a RoPE per layer type): greedy
float32 outputs equal token for token, through both backends on the same job."""

from __future__ import annotations

import json

import pytest

from tests.backends.vllm.vllm_kit import both_results, build_model, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.mark.parametrize("family", ["granite", "smollm3", "olmo2", "olmo3", "phi3", "gemma3"])
def test_family_outputs_equal_vllms(family, dataset, tmp_path):
    model = build_model(tmp_path / family, family=family)
    _assert_equal(family, model, dataset, tmp_path)


@pytest.mark.parametrize("max_model_len", [512, 1024])
def test_longrope_outputs_equal_vllms(max_model_len, dataset, tmp_path):
    """Both backends take longrope's long factors for a context beyond the original 512
    tokens, the short ones within it (the factors far apart: a wrong set changes outputs)."""
    model = build_model(tmp_path / "phi3", family="phi3")
    cfg = json.loads((model / "config.json").read_text())
    rot_pairs = cfg["head_dim"] // 4  # partial_rotary_factor 0.5
    cfg |= {"original_max_position_embeddings": 512, "max_position_embeddings": 4096}
    cfg["rope_parameters"] = {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + i / rot_pairs for i in range(rot_pairs)],
        "long_factor": [4.0 + 8 * i / rot_pairs for i in range(rot_pairs)],
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(cfg))
    _assert_equal("phi3 longrope", model, dataset, tmp_path, max_model_len=str(max_model_len))


@pytest.mark.parametrize(
    "family,window",
    [("mistral", {"sliding_window": 16}), ("olmo3", {"sliding_window": 16})],
)
def test_sliding_window_outputs_equal_vllms(family, window, dataset, tmp_path):
    """A window shorter than the rows (case1's: 30-70 tokens and 3-17 out): in every layer
    (Mistral), in three of four (OLMo3's layer_types: its default pattern)."""
    model = build_model(tmp_path / family, family=family)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | window))
    _assert_equal(f"{family} window", model, dataset, tmp_path)


def _assert_equal(family, model, dataset, tmp_path, **extra: str) -> None:
    # 8 MiB of KV: vLLM's pool for OLMo3's sliding-window layers needs more than 2 MiB
    sets = {"sampling.max_tokens": "12", "engine.kv_cache_bytes": "8MiB"}
    sets |= {f"model.{k}": v for k, v in extra.items()}
    got = both_results(model, dataset, tmp_path, **sets)
    native, vllm = got["native"], got["vllm"]
    assert [r["row_id"] for r in native] == [r["row_id"] for r in vllm]
    differ = [
        n["row_id"] for n, v in zip(native, vllm, strict=True)
        if n["output_token_ids"] != v["output_token_ids"]
    ]  # fmt: skip
    assert not differ, f"{family}: rows {differ[:5]} of {len(native)} differ from vLLM's"
    assert len({tuple(r["output_token_ids"]) for r in native}) > len(native) // 2  # not collapsed
