"""Checkpoint loading: sharded checkpoints, ModelInfo, and every ModelError case."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchjob.backends.native.models import SUPPORTED_ARCHITECTURES, load_model
from batchjob.errors import EXIT_MODEL, ModelError
from batchjob.kernels.reference import SeqSpec, build_metadata
from batchjob.model.info import auto_cpu_dtype
from batchjob.testing.tiny_model import make_tiny_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    kw = {"family": "llama", "vocab_size": 280, "layers": 2, "seed": 3}
    single = make_tiny_model(root / "single", **kw)
    sharded = make_tiny_model(root / "sharded", max_shard_size="60KB", **kw)
    return single, sharded


@pytest.fixture
def model_copy(models, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(models[0], dst)
    return dst


def _logits(model, info, ids: list[int]) -> torch.Tensor:
    cache = torch.zeros(info.kv_cache_shape(8, 4), dtype=info.torch_dtype)
    meta = build_metadata([SeqSpec(len(ids), len(ids), blocks=(3, 1, 6))], 4)
    t = len(ids)
    return model(torch.tensor(ids), torch.arange(t), cache, meta, torch.arange(t))


def test_sharded_checkpoint_matches_single_file(models):
    single, sharded = models
    assert not (single / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    m1, info1 = load_model(single, device="cpu", attention="torch")
    m2, info2 = load_model(sharded, device="cpu", attention="torch")
    assert info1 == info2
    ids = list(range(5, 15))
    torch.testing.assert_close(_logits(m1, info1, ids), _logits(m2, info2, ids), rtol=0, atol=0)
    for p in m2.parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32 and not p.requires_grad


def test_model_info(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["dtype"] = "bfloat16"  # "auto" on CPU: bf16 with bf16 hardware, else float32
    (model_copy / "config.json").write_text(json.dumps(cfg))
    gen = json.loads((model_copy / "generation_config.json").read_text())
    gen["eos_token_id"] = [cfg["eos_token_id"], 7]
    (model_copy / "generation_config.json").write_text(json.dumps(gen))
    _, info = load_model(model_copy, device="auto" if not torch.cuda.is_available() else "cpu")
    assert info.architecture == "LlamaForCausalLM"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (2, 4, 2, 16)
    assert info.vocab_size == 280 and info.max_position == 4096 and info.max_seq_len == 4096
    assert info.eos_token_ids == (cfg["eos_token_id"], 7)
    assert info.bos_token_id == cfg["bos_token_id"]
    auto = auto_cpu_dtype("bfloat16")
    assert info.dtype == auto and info.device == "cpu" and info.torch_dtype == getattr(torch, auto)
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * info.torch_dtype.itemsize
    assert info.kv_cache_shape(10, 16) == (2, 2, 10, 16, 2, 16)
    _, info16 = load_model(model_copy, dtype="bf16", device="cpu")
    assert info16.torch_dtype == torch.bfloat16 and info16.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2


def _raises(folder, match: str) -> ModelError:
    with pytest.raises(ModelError, match=match) as e:
        load_model(folder, device="cpu")
    assert e.value.exit_code == EXIT_MODEL
    return e.value


def test_missing_folder(tmp_path):
    _raises(tmp_path / "nope", "does not exist")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    _raises(model_copy, r"config\.json: missing")


def test_unsupported_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    err = _raises(model_copy, "unsupported architecture.*GPT2LMHeadModel")
    assert all(a in str(err) for a in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_scaling(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (model_copy / "config.json").write_text(json.dumps(cfg))
    _raises(model_copy, "rope scaling type 'yarn' is not supported.*llama3")


def test_missing_weight_files(model_copy):
    (model_copy / "model.safetensors").unlink()
    _raises(model_copy, "no model.safetensors")


def test_tensor_missing_from_checkpoint(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    _raises(model_copy, r"'model\.layers\.1\.self_attn\.k_proj\.weight' is missing")


def test_tensor_with_wrong_shape(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, path, metadata={"format": "pt"})
    _raises(model_copy, "model.norm.weight.*shape")


def test_index_lists_missing_shard(models, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(models[1], dst)
    shard = sorted(dst.glob("model-*-of-*.safetensors"))[-1]
    shard.unlink()
    _raises(dst, f"lists shard {shard.name}, which is missing")


def test_sliding_window_hides_earlier_keys(tmp_path):
    """Past the window, a position's logits depend on the last W tokens only: the logits of
    the last token are the same whatever came before them."""
    folder = make_tiny_model(tmp_path / "mistral", family="mistral", vocab_size=280, seed=1)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window"] = 4
    cfg["num_hidden_layers"] = 1  # one layer: the window is the whole receptive field
    (folder / "config.json").write_text(json.dumps(cfg))
    model, info = load_model(folder, device="cpu")
    assert info.sliding_window == 4 and info.max_seq_len == cfg["max_position_embeddings"]
    tail = [7, 8, 9, 10]
    a, b = _logits(model, info, [3, 4, 5, *tail]), _logits(model, info, [30, 40, 50, *tail])
    torch.testing.assert_close(a[-1], b[-1])
    assert not torch.allclose(a[-2], b[-2])  # the window there still holds the head


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_multimodal_checkpoint_runs_its_language_model(tmp_path, prefix):
    """Gemma3's 4B+ checkpoints (Gemma3ForConditionalGeneration): the text model's numbers in
    text_config, its tensors under a language-model prefix (the Hub's files, transformers'
    saves), the vision tower's beside them; the same logits as the text-only checkpoint."""
    text = make_tiny_model(tmp_path / "text", family="gemma3", vocab_size=280, seed=2)
    mm = tmp_path / "mm"
    shutil.copytree(text, mm)
    weights = load_file(str(text / "model.safetensors"))
    head = "language_model." if prefix.startswith("language_model") else ""  # the Hub's files
    moved = {
        (prefix + k.removeprefix("model.") if k.startswith("model.") else head + k): v
        for k, v in weights.items()
    }
    moved["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3)
    (mm / "model.safetensors").unlink()
    save_file(moved, str(mm / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((text / "config.json").read_text())
    nested = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": cfg}
    (mm / "config.json").write_text(json.dumps(nested))
    ids = list(range(3, 11))
    want = _logits(*load_model(text, device="cpu", dtype="float32"), ids)
    got = _logits(*load_model(mm, device="cpu", dtype="float32"), ids)
    assert torch.equal(got, want)
