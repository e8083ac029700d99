"""What the benchmarks run: the peer workloads at their scales, the benchmark models
(models/bench-peer[-d<D>][-kv<K>]), a workload's Parquet of token ids, and the vLLM-style
attention batches of the attention benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from batchjob.storage.atomic import write_parquet_atomic
from batchjob.testing.tiny_model import default_corpus, make_tiny_model
from batchjob.testing.workloads import make_workload
from batchjob.tokenize.prompts import TokenizedPrompts

ROOT = Path(__file__).resolve().parents[2]

# name -> (scale, len_scale, max_tokens): each a few minutes of vLLM on 2 cores
WORKLOADS: dict[str, tuple[float, float, int]] = {  # (scale, len_scale, max_tokens)
    "case1": (0.05, 0.5, 50),  # 150 requests, 114k prompt tokens
    "micro-2000-200-s16": (0.1, 0.5, 50),  # 102 requests: prefix 1000 / distinct 100
    "micro-2000-200-s4": (0.06, 0.5, 50),
    "micro-1000-1000-s16": (0.06, 0.5, 50),
    "micro-1000-1000-s4": (0.05, 0.5, 50),
    "micro-200-2000-s16": (0.05, 0.5, 50),
    "micro-200-2000-s4": (0.05, 0.5, 50),
    "case2": (0.1, 0.5, 25),
    "nosharing": (0.1, 0.5, 64),
    "natural-qa": (0.15, 1.0, 32),  # 150 requests: instruction 40 / document ~400 / question ~22
    "long-doc": (0.15, 1.0, 32),  # 150 requests: 1,500-3,500-token documents, 5-100 questions each
}
SMOKE_WORKLOAD = ("micro-2000-200-s4", 0.02, 0.05, 8)  # 20 requests of 110 tokens


def model_dir(head_dim: int, kv_heads: int = 8) -> Path:
    """models/bench-peer (head dim 128, 8 KV heads: the original), else
    models/bench-peer[-d<D>][-kv<K>]."""
    name = "bench-peer" + (f"-d{head_dim}" if head_dim != 128 else "")
    return ROOT / "models" / (name + (f"-kv{kv_heads}" if kv_heads != 8 else ""))


def build_model(path: Path, smoke: bool, head_dim: int = 128, kv_heads: int = 8) -> Path:
    """models/bench-peer: Llama 256 / 8 layers / 8 heads x 128, vocab 1000 (64 KiB KV/token);
    ``head_dim``, ``kv_heads``: the same shape at another head dim (--head-dims) or with
    grouped-query attention (--kv-heads: 8 query heads share ``kv_heads``); smoke: hidden 64,
    2 layers, 2 heads x ``head_dim``."""
    if (path / "config.json").exists():
        return path
    if smoke:
        return make_tiny_model(
            path, vocab_size=320, hidden=64, layers=2, heads=2, kv_heads=2, head_dim=head_dim
        )
    corpus = [s for k in range(4) for s in default_corpus(400, seed=k)]  # enough for 1000 ids
    return make_tiny_model(
        path,
        vocab_size=1000,
        hidden=256,
        layers=8,
        heads=8,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=512,
        corpus=corpus,
    )


def write_workload(
    name: str, scale: float, len_scale: float, max_tokens: int, vocab: int, path: Path
) -> pa.Table:
    """Workload ``name`` as token ids of a ``vocab``-token model at ``path``: row_id, prompt
    (list<int32>), max_tokens."""
    t = make_workload(
        name, scale, len_scale, seed=0, form="ids", vocab_size=vocab, max_tokens=max_tokens
    )
    t = pa.table(
        {
            "row_id": np.arange(t.num_rows, dtype=np.int64),
            "prompt": t["prompt"],
            "max_tokens": t["max_tokens"],
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet_atomic(t, path)
    return t


def prompts_from_table(table: pa.Table) -> TokenizedPrompts:
    """A workload table's token-id prompts (``prompt``, ``max_tokens``) as the engine takes
    them, row ids 0..N-1."""
    col = table["prompt"].combine_chunks()
    offsets = col.offsets.to_numpy().astype(np.int64)
    tokens = col.values.to_numpy().astype(np.int32)
    return TokenizedPrompts(
        row_ids=np.arange(table.num_rows, dtype=np.int64),
        tokens=tokens,
        offsets=offsets - offsets[0],
        max_tokens=table["max_tokens"].to_numpy().astype(np.int32),
    )


# --- attention batches (bench_vllm_attention.py, ab_cpu_kernel.py) --------------------------

BS = 32  # block size of the attention batches
# (name, groups, members a group, shared prefix tokens, own tokens, query tokens a request)
ATTENTION_SHAPES = [
    ("decode 100: 25 groups of 4 over 320", 25, 4, 320, 100, 1),
    ("decode 64: 4 groups of 16 over 1984", 4, 16, 1984, 220, 1),
    ("decode 96, nothing shared, 500 each", 96, 1, 0, 500, 1),
    ("prefill 8 x 64 over 4 prefixes of 320", 4, 2, 320, 64, 64),
    ("prefill 2048, one sequence", 1, 1, 0, 2048, 2048),
    ("prefill 16 x 200 over one prefix of 1984", 1, 16, 1984, 200, 200),
]


def block_tables(shape: tuple) -> tuple[int, Any, Any, Any]:
    """A vLLM-style batch of ``shape`` (``prefix_groups.block_tables``: blocks in the cache,
    block tables [R, M] int32 with each group's prefix blocks shared and the requests
    shuffled, sequence lengths, query start offsets [R + 1]), torch tensors."""
    from batchjob.backends.vllm.prefix_groups import block_tables as tables

    _, groups, members, prefix, own, qlen = shape
    return tables(groups, members, prefix, own, qlen, BS)
