"""batchjob.model.info: the one reader of a model folder (no torch, no weights loaded)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from batchjob.errors import EXIT_MODEL, ModelError
from batchjob.model.info import (
    DTYPE_BYTES,
    auto_cpu_dtype,
    read_model_info,
    resolve_dtype,
    safetensors_tensor_names,
)
from tests.conftest import TINY_MAX_LEN, TINY_VOCAB, write_model_folder

ROOT = Path(__file__).resolve().parents[2]
KV_ELEMS = 2 * 2 * 2 * 16  # K+V, 2 layers, 2 kv heads, head_dim 16


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def folder(tmp_path: Path, tiny_tokenizer: Tokenizer) -> Path:
    return write_model_folder(tmp_path / "m", tiny_tokenizer)


def test_reads_config_generation_config_and_weights(folder: Path) -> None:
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    info = read_model_info(folder, device="cpu")
    assert (info.architecture, info.vocab_size, info.num_layers) == ("LlamaForCausalLM", 3000, 2)
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (4, 2, 16)
    assert info.eos_token_ids == (2, 7) and info.bos_token_id == 1
    assert info.max_position == info.max_seq_len == info.max_model_len == TINY_MAX_LEN
    assert info.weight_files == (folder / "model.safetensors",)
    assert info.tensor_files["model.embed_tokens.weight"] == folder / "model.safetensors"
    assert info.kv_cache_shape(5, 16) == (2, 2, 5, 16, 2, 16)


@pytest.mark.parametrize(
    "checkpoint,asked,device,want",
    [
        ("bfloat16", "auto", "cpu", auto_cpu_dtype("bfloat16")),  # host CPU: test_cpu_info
        ("bfloat16", "auto", "cuda", "bfloat16"),
        (None, "auto", "cuda:1", "float32"),
        ("bfloat16", "float16", "cpu", "float16"),
        ("float32", "bf16", "cuda", "bfloat16"),
    ],
)
def test_dtype_resolution(checkpoint, asked, device, want) -> None:
    assert resolve_dtype(asked, checkpoint, device) == want


def test_kv_bytes_follow_the_resolved_dtype(folder: Path) -> None:
    _edit_config(folder, torch_dtype="bfloat16")
    auto = DTYPE_BYTES[auto_cpu_dtype("bfloat16")]  # bf16 on a CPU with bf16 hardware
    assert read_model_info(folder, device="cpu").kv_bytes_per_token == KV_ELEMS * auto
    assert read_model_info(folder, "bfloat16", "cpu").kv_bytes_per_token == KV_ELEMS * 2
    assert read_model_info(folder, "float16", "cpu").dtype == "float16"
    with pytest.raises(ModelError, match="unknown dtype 'int8'"):
        read_model_info(folder, "int8", "cpu")


def test_context_length(folder: Path) -> None:
    assert read_model_info(folder, max_model_len=100).max_model_len == 100  # the job's wins
    max_position = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    _edit_config(folder, architectures=["MistralForCausalLM"], sliding_window=64)
    info = read_model_info(folder)  # the window limits what a query sees, not the length
    assert info.sliding_window == 64 and info.max_seq_len == info.max_model_len == max_position
    assert info.config.window_layers is None and info.config.layer_window(0) == 64


def test_window_layers(folder: Path) -> None:
    """Which layers a window applies to: layer_types (OLMo3's, transformers' Qwen2/Qwen3),
    Qwen's max_window_layers rule without them, a disabled Qwen window none."""
    _edit_config(
        folder, architectures=["Olmo3ForCausalLM"], sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    cfg = read_model_info(folder).config
    assert [cfg.layer_window(i) for i in (0, 1)] == [16, None]
    _edit_config(
        folder, architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
        max_window_layers=1, layer_types=None,
    )  # fmt: skip
    cfg = read_model_info(folder).config
    assert [cfg.layer_window(i) for i in (0, 1)] == [None, 16]
    _edit_config(folder, use_sliding_window=False)
    assert read_model_info(folder).config.sliding_window is None


def test_equality_ignores_the_location(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    a = read_model_info(write_model_folder(tmp_path / "a", tiny_tokenizer), device="cpu")
    b = read_model_info(write_model_folder(tmp_path / "b", tiny_tokenizer), device="cpu")
    assert a == b and a.path != b.path
    assert a != read_model_info(tmp_path / "a", "bfloat16", "cpu")


PHI3 = {"architectures": ["Phi3ForCausalLM"]}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh"}
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}


@pytest.mark.parametrize(
    "edit,needle",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"architectures": None, "model_type": "bert"}, "unsupported architecture 'bert'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope scaling type 'yarn'"),
        ({"num_key_value_heads": 3}, "not a multiple of kv heads 3"),
        ({"vocab_size": None}, "a size is not an integer"),
        # issue 49: exit 3 blaming engine.kv_cache_bytes, exit 6 blaming the data, a run
        ({"num_hidden_layers": -1}, "num_hidden_layers is -1"),
        ({"vocab_size": 100}, "vocab_size 100 is smaller than the"),
        ({"torch_dtype": "float33"}, "'float33' is not a dtype"),
        ({"torch_dtype": None, "dtype": "float33"}, "'float33' is not a dtype"),
        # a ZeroDivisionError traceback, or a run on a size that cannot be
        ({"num_attention_heads": 0}, "num_attention_heads is 0; it must be a positive"),
        ({"num_hidden_layers": 0}, "num_hidden_layers is 0; it must be a positive"),
        ({"num_key_value_heads": 0}, "num_key_value_heads is 0; it must be a positive"),
        ({"head_dim": -16}, "head_dim is -16; it must be a positive"),
        ({"hidden_size": 66}, "hidden_size 66 is not a multiple of num_attention_heads 4"),
        ({"head_dim": "wide"}, "a size is not an integer"),
        ({"architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1]}, "one 0/1 per layer"),
        ({"architectures": ["GraniteForCausalLM"], "logits_scaling": 0}, "logits_scaling is 0"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window is 0"),
        (
            {"sliding_window": 8, "layer_types": ["sliding_attention", "chunked_attention"]},
            "layer_types ['chunked_attention'] are not supported",
        ),
        ({"sliding_window": 8, "layer_types": ["sliding_attention"]}, "one type per layer"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                    "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
                }
            },
            "rope_parameters differ by layer type",
        ),
        (
            {"architectures": ["GraniteForCausalLM"], "residual_multiplier": "half"},
            "a Granite multiplier is not a number",
        ),
        (GEMMA3 | {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        (GEMMA3 | {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        # HF's Llama rotates whole heads: a partial factor there is a config it cannot run
        ({"partial_rotary_factor": 0.5}, "0.5 is not supported for LlamaForCausalLM"),
        (PHI3 | {"partial_rotary_factor": 1.5}, "it must be in (0, 1]"),
        (PHI3 | {"partial_rotary_factor": 0.0625}, "rotates 1 of 16 head dims"),
        (
            PHI3 | {"rope_scaling": LONGROPE | {"short_factor": [1.0] * 3, "long_factor": [2.0]}},
            "lists of one length",
        ),
        (
            PHI3
            | {"rope_scaling": LONGROPE | {"short_factor": [1.0] * 3, "long_factor": [2.0] * 3}},
            "short_factor has 3 entries; 16 rotated dims need 8",
        ),
        (
            PHI3 | {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}},
            "lacks key 'long_factor'",
        ),
    ],
)
def test_config_the_engine_cannot_run(folder: Path, edit: dict, needle: str) -> None:
    _edit_config(folder, **edit)
    with pytest.raises(ModelError, match=r"config\.json") as e:
        read_model_info(folder)
    assert needle in str(e.value) and e.value.exit_code == EXIT_MODEL


def test_family_settings(folder: Path) -> None:
    """SmolLM3 without ``no_rope_layers``: HF's default, every fourth layer without RoPE;
    Granite's multipliers as given, its attention scale the multiplier, not D^-0.5."""
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    _edit_config(folder, architectures=["SmolLM3ForCausalLM"], num_hidden_layers=8)
    cfg = read_model_info(folder).config
    assert cfg.rope_layers == (True, True, True, False) * 2
    assert [cfg.uses_rope(i) for i in (3, 4)] == [False, True]
    _edit_config(
        folder, architectures=["GraniteForCausalLM"], num_hidden_layers=layers,
        attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=8.0,
    )  # fmt: skip
    cfg = read_model_info(folder).config
    assert cfg.rope_layers is None and cfg.attention_scale == 0.0078125
    assert (cfg.residual_multiplier, cfg.logits_scaling, cfg.embedding_multiplier) == (
        0.22, 8.0, 1.0,
    )  # fmt: skip


def test_phi3_settings(folder: Path) -> None:
    """Phi-4-mini's layout: partial rotary at the top level, longrope under its legacy name
    "su", the original context at the top level, a sliding window; the long
    factors for a context beyond the original one (vLLM's rule), the attention factor
    transformers derives from the context's growth."""
    _edit_config(
        folder, **PHI3, partial_rotary_factor=0.75, sliding_window=2047,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6},
    )  # fmt: skip
    info = read_model_info(folder)
    cfg = info.config
    assert (cfg.head_dim, cfg.rotary_dims) == (16, 12)
    assert (cfg.rope.rope_type, cfg.rope.original_max_position) == ("longrope", 4096)
    assert cfg.rope.attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    assert cfg.sliding_window == 2047 and info.max_model_len == cfg.max_seq_len == 131072
    assert [cfg.long_rope(n) for n in (4096, 4097)] == [False, True]
    _edit_config(folder, partial_rotary_factor=None, sliding_window=None, rope_scaling=None)
    cfg = read_model_info(folder).config
    assert (cfg.rotary_dims, cfg.rope.rope_type, cfg.long_rope(1 << 20)) == (16, "default", False)


def test_gemma3_settings(folder: Path) -> None:
    """gemma-3-1b-it's config.json (legacy keys): a window of 512 in five layers of six,
    rope_theta for the full layers, rope_local_base_freq for the windowed ones, the
    softmax scale from query_pre_attn_scalar, tied embeddings by default; the 4B+ configs
    nest it in text_config under Gemma3ForConditionalGeneration, with linear scaling on the
    full layers' RoPE."""
    _edit_config(
        folder, **GEMMA3, num_hidden_layers=12, sliding_window=512, sliding_window_pattern=6,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
        tie_word_embeddings=None, rope_scaling=None, rope_parameters=None,
    )  # fmt: skip
    cfg = read_model_info(folder).config
    assert cfg.activation == "gelu_tanh" and cfg.tie_word_embeddings
    assert [cfg.layer_window(i) for i in (4, 5, 6, 11)] == [512, None, 512, None]
    assert cfg.layer_rope(5).theta == 1_000_000.0 and cfg.layer_rope(4).theta == 10_000.0
    assert (cfg.attention_scale, cfg.norm_offset, cfg.embedding_multiplier) == (1 / 16, 1.0, 8.0)
    assert cfg.branch_norms and cfg.input_norms and cfg.qk_norm and not cfg.qk_norm_whole
    text = json.loads((folder / "config.json").read_text())
    text |= {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    nested = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
    (folder / "config.json").write_text(json.dumps(nested))
    cfg = read_model_info(folder).config
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    assert (cfg.layer_rope(5).rope_type, cfg.layer_rope(5).factor) == ("linear", 8.0)
    assert cfg.layer_rope(4).rope_type == "default"


def test_weights_headers(folder: Path) -> None:
    weights = folder / "model.safetensors"
    names = safetensors_tensor_names(weights)
    assert "lm_head.weight" in names and len(names) == 3 + 9 * 2
    data = weights.read_bytes()
    weights.write_bytes(data[:-1])
    with pytest.raises(ModelError, match="truncated: tensors need"):
        read_model_info(folder)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ModelError, match="header does not parse"):
        read_model_info(folder)
    weights.write_bytes(b"\xff" * 20)
    with pytest.raises(ModelError, match="not a safetensors file"):
        read_model_info(folder)


def test_index_naming_a_tensor_its_shard_lacks(folder: Path) -> None:
    index = {
        "weight_map": {"model.embed_tokens.weight": "model.safetensors", "x.w": "model.safetensors"}
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"puts 'x\.w' in model\.safetensors, which lacks it"):
        read_model_info(folder)


def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not a directory"):
        read_model_info(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"config\.json: missing"):
        read_model_info(tmp_path / "empty")


def test_reading_imports_no_torch(folder: Path) -> None:
    """Plan-side modules and reading a folder on a GPU-less machine never import torch."""
    code = (
        "import sys\n"
        "import batchjob.model.info, batchjob.tokenize.batched\n"
        "import batchjob.outputs.plan_summary, batchjob.cli\n"
        "from batchjob.model.info import read_model_info\n"
        f"info = read_model_info({str(folder)!r})\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(info.device, info.dtype, info.vocab_size)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    if not any(Path(d).exists() for d in ("/proc/driver/nvidia", "/dev/kfd")):
        assert p.stdout.split() == ["cpu", "float32", str(TINY_VOCAB)]


def test_vllm_backend_reads_architectures_the_native_engine_refuses(folder: Path) -> None:
    """A Gemma/MoE folder is refused for the native engine (exit 5) but read for its sizes
    when the vLLM backend runs it (vLLM checks its own models)."""
    _edit_config(
        folder,
        architectures=["GemmaForCausalLM"],
        hidden_act="gelu_pytorch_tanh",
        rope_scaling={"rope_type": "yarn", "factor": 4.0},
    )
    with pytest.raises(ModelError, match=r"engine\.backend = 'vllm' runs the others"):
        read_model_info(folder, device="cpu")
    info = read_model_info(folder, device="cpu", native=False)
    assert info.architecture == "GemmaForCausalLM"
    assert info.kv_bytes_per_token == 2 * info.num_layers * info.num_kv_heads * info.head_dim * 4
