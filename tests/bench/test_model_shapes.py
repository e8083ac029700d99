"""The real-checkpoint shapes the benchmarks build: each reads back as the checkpoint's
architecture (a shape's own config keys over the family's test settings)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from batchjob.model.info import read_model_info
from batchjob.testing.model_shapes import SHAPES, make_shaped_model

pytest.importorskip("transformers")


def test_gemma3_shape_keeps_its_checkpoints_windows(tmp_path: Path) -> None:
    """gemma-3-1b's settings at a few layers' size: a window of 512 in five layers of six
    (not the tiny family's 16 in one of two), query_pre_attn_scalar 256."""
    small = dataclasses.replace(
        SHAPES["gemma-3-1b"], name="g", layers=7, hidden=64, heads=2, head_dim=32,
        intermediate=128, vocab=1200,
    )  # fmt: skip
    cfg = read_model_info(make_shaped_model(tmp_path / "g", small)).config
    assert cfg.sliding_window == 512 and cfg.attention_scale == 256**-0.5
    assert [cfg.layer_window(i) is not None for i in range(7)] == [True] * 5 + [False, True]
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (7, 1, 32, 1200)
