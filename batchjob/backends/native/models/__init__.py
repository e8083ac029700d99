"""Llama-family models (Llama, Mistral, Qwen2, Qwen3, Granite, SmolLM3, OLMo2, OLMo3) in
torch, loaded from local checkpoints."""

from __future__ import annotations

from batchjob.backends.native.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from batchjob.backends.native.models.llama import LlamaForCausalLM
from batchjob.backends.native.models.loader import MODEL_CLASSES, load_model
from batchjob.model.info import ModelInfo

__all__ = [
    "MODEL_CLASSES",
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelInfo",
    "load_model",
]
