"""The shapes of real checkpoints, built locally with random weights for benchmarks.

Nothing is downloaded: each shape is the architecture of a public checkpoint (layers, hidden
size, heads, MLP width, vocabulary rows, tied embeddings, biases) with a small locally trained
tokenizer; the model's vocabulary is the checkpoint's (the embedding and logits matrices are
full size), the tokenizer covers its first few hundred ids, so token-id workloads exercise the
real logits width. Random weights at the checkpoint's init scale (0.02).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchjob.testing.tiny_model import default_corpus, make_tiny_model


@dataclass(frozen=True)
class ModelShape:
    """A checkpoint's architecture: what sets the cost of a forward pass."""

    name: str
    family: str  # batchjob.testing.tiny_model.FAMILIES (qwen2: q/k/v biases)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    settings: dict[str, Any] = field(default_factory=dict)  # config keys of the checkpoint

    def params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * (attn + mlp + 2 * self.hidden) + self.vocab * self.hidden + head

    def linear_flops_per_token(self) -> int:
        """Multiply-adds x 2 of one token through every layer's linear layers (no logits)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = (
            self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        )
        return 2 * self.layers * per_layer

    def logits_flops_per_token(self) -> int:
        return 2 * self.hidden * self.vocab


# a window of 512 in five layers of six, each layer type with its own RoPE
GEMMA3_1B = {"sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}

SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("smollm2-135m", "llama", 30, 576, 9, 3, 64, 1536, 49152, True),
        ModelShape("qwen2.5-0.5b", "qwen2", 24, 896, 14, 2, 64, 4864, 151936, True),
        ModelShape("llama-3.2-1b", "llama", 16, 2048, 32, 8, 64, 8192, 128256, True),
        ModelShape("qwen3-embedding-0.6b", "qwen3", 28, 1024, 16, 8, 128, 3072, 151669, True),
        ModelShape("gemma-3-1b", "gemma3", 26, 1152, 4, 1, 256, 6912, 262144, True, GEMMA3_1B),
    )
}


def make_shaped_model(path: str | Path, shape: ModelShape | str, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of ``shape`` to ``path`` (reused when it exists)."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    out = Path(path)
    if (out / "config.json").exists():
        return out
    corpus = [t for k in range(4) for t in default_corpus(400, seed=k)]
    return make_tiny_model(
        out,
        family=s.family,
        vocab_size=1000,
        model_vocab=s.vocab,
        hidden=s.hidden,
        layers=s.layers,
        heads=s.heads,
        kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate=s.intermediate,
        seed=seed,
        corpus=corpus,
        init_std=0.02,
        tie_word_embeddings=s.tied,
        max_position=8192,
        overrides=s.settings,
    )
