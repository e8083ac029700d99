"""Embedding rows/s: batchjob (native engine, and its vLLM backend) against vLLM's ``LLM.embed``
on the same model folder, token ids, pooling and dtype; one system per fresh process.

    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv/bin/python benchmarks/bench_embed.py \\
        --rows 4000 --pooling last --systems batchjob,batchjob-vllm,vllm-embed --repeats 3

The rows are one instruction (``--instruction-tokens``) in front of a distinct query of 8-40
tokens (the retrieval-query shape of Qwen3-Embedding and e5-mistral), shuffled. The model is
a Qwen3-shaped random-weight embedding folder (``--model-shape`` for a real checkpoint's
shape). vLLM runs ``LLM(runner="pooling", pooler_config=...)`` and ``LLM.embed`` over the rows
in file order with its defaults (prefix caching where vLLM keeps it: last-token pooling).
Prints a Markdown table (rows/s, tokens/s, engine seconds, max |difference| from batchjob's
native embeddings) and writes out/bench_embed/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "bench_embed"


def build(args) -> tuple[Path, Path]:
    from batchjob.testing.embedding_model import (
        make_tiny_embedding_model,
        write_sentence_transformers_files,
    )
    from batchjob.testing.model_shapes import SHAPES, make_shaped_model

    model = ROOT / "models" / f"embed-{args.model_shape or 'qwen3-small'}"
    if not (model / "config.json").exists():
        if args.model_shape:
            make_shaped_model(model, args.model_shape)
            hidden = SHAPES[args.model_shape].hidden
            write_sentence_transformers_files(model, args.pooling, True, hidden)
        else:
            make_tiny_embedding_model(model, family="qwen3", pooling=args.pooling, vocab_size=1000,
                                      hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64,
                                      init_std=0.02)  # fmt: skip
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    instr = rng.integers(3, vocab, args.instruction_tokens).tolist()
    rows = [[1, *instr, *rng.integers(3, vocab, int(rng.integers(8, 41))).tolist()]
            for _ in range(args.rows)]  # fmt: skip
    data = OUT / f"rows-{args.rows}.parquet"
    OUT.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt": pa.array(rows, pa.list_(pa.int32()))}), data)
    return model, data


def run_one(system: str, model: str, data: str, pooling: str, dtype: str, out: str) -> None:
    """One system in this process: writes {seconds, rows, tokens} and its embeddings."""
    table = pq.read_table(data)
    rows = table["prompt"].to_pylist()
    if system == "vllm-embed":
        from vllm import LLM
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, runner="pooling", dtype=dtype, skip_tokenizer_init=True,
                  pooler_config={"seq_pooling_type": pooling.upper()})  # fmt: skip
        t0 = time.perf_counter()
        res = llm.embed([TokensPrompt(prompt_token_ids=r) for r in rows], use_tqdm=False)
        seconds = time.perf_counter() - t0
        emb = np.asarray([r.outputs.embedding for r in res], dtype=np.float32)
    else:
        import batchjob

        backend = "vllm" if system == "batchjob-vllm" else "native"
        with batchjob.Generator(
            model={"path": model, "task": "embed", "dtype": dtype}, engine={"backend": backend}
        ) as g:
            g.generate(table.slice(0, 8))  # warm-up (vLLM: start-up)
            t0 = time.perf_counter()
            res = g.generate(table)
            seconds = time.perf_counter() - t0
        bad = [s for s in res["status"].to_pylist() if s != "ok"]
        if bad:
            raise SystemExit(f"{system}: {len(bad)} rows not embedded (first: {bad[0]})")
        emb = np.asarray(res["embedding"].to_pylist(), dtype=np.float32)
    np.save(out + ".npy", emb)
    tokens = sum(map(len, rows))
    Path(out + ".json").write_text(
        json.dumps({"seconds": seconds, "rows": len(rows), "tokens": tokens})
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--instruction-tokens", type=int, default=24)
    ap.add_argument("--pooling", choices=("last", "mean", "cls"), default="last")
    ap.add_argument("--systems", default="batchjob,batchjob-vllm,vllm-embed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model-shape", default=None, help="batchjob.testing.model_shapes name")
    ap.add_argument("--one", nargs=5, help=argparse.SUPPRESS)  # system model data pooling out
    args = ap.parse_args()
    if args.one:
        system, model, data, pooling, out = args.one
        run_one(system, model, data, pooling, args.dtype, out)
        return 0
    model, data = build(args)
    lines = ["| system | rows/s | tokens/s | seconds (median) | max abs diff vs batchjob |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    ref = None
    for system in args.systems.split(","):
        runs = []
        for k in range(args.repeats):
            out = str(OUT / f"{system}-{k}")
            cmd = [sys.executable, __file__, "--dtype", args.dtype, "--one", system, str(model),
                   str(data), args.pooling, out]  # fmt: skip
            subprocess.run(cmd, check=True, cwd=ROOT)
            runs.append(json.loads(Path(out + ".json").read_text()))
        emb = np.load(str(OUT / f"{system}-0") + ".npy")
        ref = emb if ref is None else ref
        s = float(np.median([r["seconds"] for r in runs]))
        diff = float(np.abs(emb - ref).max())
        lines.append(f"| {system} | {runs[0]['rows'] / s:.1f} | {runs[0]['tokens'] / s:.0f} | "
                     f"{s:.2f} | {diff:.2e} |")  # fmt: skip
    table = "\n".join(lines)
    (OUT / "embed.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
