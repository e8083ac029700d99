"""Build tiny random-weight Llama-family checkpoints (+ a trained BPE tokenizer) locally.

For tests, demos and benchmarks: nothing is downloaded. The folder looks like a Hugging
Face checkpoint (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json) and loads both with ``batchjob`` and with ``transformers``.
Needs ``transformers`` (a dev dependency), imported lazily.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "granite", "smollm3", "olmo2", "olmo3", "phi3",
    "gemma3",
)  # fmt: skip
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
_SYLLABLES = [c + v for c in "bdklmnrstv" for v in "aeiou"] + [v + c for v in "aeiou" for c in "nr"]


def default_corpus(num_sentences: int = 400, seed: int = 0) -> list[str]:
    """English-like sentences of made-up words (Zipf-ish word frequencies)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(300)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    sentences = []
    for _ in range(num_sentences):
        n = rng.randint(4, 14)
        text = " ".join(rng.choices(words, weights=weights, k=n))
        sentences.append(text.capitalize() + rng.choice([".", ".", "?", "!"]))
    return sentences


def train_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE (every byte encodable) with BOS/EOS/PAD specials; BOS is prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _config(family: str, overrides: dict[str, Any] | None = None, **kw):
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "granite": transformers.GraniteConfig,
        "smollm3": transformers.SmolLM3Config,
        "olmo2": transformers.Olmo2Config,
        "olmo3": transformers.Olmo3Config,
        "phi3": transformers.Phi3Config,
        "gemma3": transformers.Gemma3TextConfig,
    }[family]
    if kw.get("head_dim") is None:
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    kw |= FAMILY_SETTINGS.get(family, {}) | (overrides or {})
    return cls(**kw)


# what sets a family apart, at values a missed one changes outputs with: Granite's scalars
# (its checkpoints: embedding 12, residual 0.22, attention 1/128 or 1/64, logits 8-16);
# SmolLM3 without RoPE in every second layer (its checkpoints: every fourth); Phi3 rotating
# half of each head (Phi-4-mini: three quarters); Gemma3 with a window of 16 in one layer of
# two (its checkpoints: 512 in five of six), each layer type with its own RoPE
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "granite": {
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 2.0,
        "attention_bias": True,
    },
    "smollm3": {"no_rope_layer_interval": 2},
    "phi3": {"partial_rotary_factor": 0.5},
    "gemma3": {"sliding_window": 16, "sliding_window_pattern": 2, "query_pre_attn_scalar": 24},
}


def write_random_weights(folder: str | Path, config: dict, seed: int = 0) -> Path:
    """``folder/model.safetensors`` for a Llama ``config`` (a config.json dict), random values.

    Without ``transformers``: for model folders written by hand (tests of reading and
    planning); the tensors have the names and shapes the native loader expects.
    """
    from safetensors.torch import save_file

    h, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype") or "float32")
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: (torch.randn(s, generator=gen) * 0.1).to(dtype) for k, s in shapes.items()}
    out = Path(folder) / "model.safetensors"
    save_file(tensors, out, metadata={"format": "pt"})
    return out


def make_tiny_model(
    out_dir: str | Path,
    family: str = "llama",
    vocab_size: int = 320,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    seed: int = 0,
    corpus: list[str] | None = None,
    dtype: str = "float32",
    init_std: float = 0.1,
    tie_word_embeddings: bool = False,
    max_position: int = 4096,
    max_shard_size: str | None = None,
    head_dim: int | None = None,
    model_vocab: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random-weight ``family`` model with a BPE tokenizer to ``out_dir``.

    ``init_std`` is larger than the usual 0.02 so that greedy decoding of a tiny random model
    does not collapse into one repeated token. ``max_shard_size`` (e.g. "20KB") writes a
    sharded checkpoint with an index. The model's vocab is the tokenizer's actual size, or
    ``model_vocab`` rows where that is larger (real checkpoints pad theirs past the tokenizer).
    ``overrides``: config keys over the family's test settings (a real checkpoint's).
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (use {', '.join(FAMILIES)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(corpus or default_corpus(seed=seed), vocab_size)
    tok.save(str(out / "tokenizer.json"))
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    config = _config(
        family,
        overrides,
        vocab_size=max(tok.get_vocab_size(), model_vocab or 0),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        initializer_range=init_std,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    if family == "gemma3":
        config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms init to 1: perturb them so a missed norm changes outputs
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, init_std)
    model = model.to(getattr(torch, dtype))
    save_model_folder(out, model, (bos_id, eos_id, pad_id), max_position, max_shard_size)
    return out


def save_model_folder(
    out: Path,
    model: Any,
    special_ids: tuple[int, int, int],
    max_position: int,
    max_shard_size: str | None = None,
) -> None:
    """A transformers ``model``'s weights and config, its generation config, and the
    tokenizer config of ``train_tokenizer``'s special tokens (``special_ids``: BOS, EOS, PAD
    ids) into ``out``, whose tokenizer.json is written already."""
    import transformers

    bos_id, eos_id, pad_id = special_ids
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    transformers.GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    ).save_pretrained(out)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": max_position,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
