"""The names every registry dispatches on, torch-free so config validation can use them."""

from __future__ import annotations

BACKENDS = ("native", "vllm")  # engine.backend
SCHEDULING_POLICIES = ("batchllm", "baseline")  # scheduler.policy
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # engine.attention (native only)
LINEAR_BACKENDS = ("auto", "torch")  # engine.linear (native only)
TASKS = ("generate", "embed")  # model.task
POOLING_METHODS = ("auto", "last", "mean", "cls")  # model.pooling (embed)
