"""Embedding rows/s: batchjob (native engine, and its vLLM backend) against vLLM's ``LLM.embed``
on the same model folder, token ids, pooling and dtype; one system per fresh process.

    flock /tmp/helpers/bench.lock nice -n -20 .venv/bin/python benchmarks/bench_embed.py \\
        --rows 300 --model-shape qwen3-embedding-0.6b --systems vllm-embed,batchjob \\
        --repeats 3 --results benchmarks/results/zen5_embed_qwen3_0.6b_fp32.json

The rows are one instruction (``--instruction-tokens``) in front of a distinct query of 8-40
tokens (the retrieval-query shape of Qwen3-Embedding and e5-mistral), shuffled. The model is
a random-weight embedding folder with sentence-transformers files (last-token pooling,
normalized): a small Qwen3 by default, ``--model-shape`` for a real checkpoint's shape.

vLLM runs ``LLM(runner="pooling", pooler_config=...)`` and ``LLM.embed`` over the rows in file
order, prefix caching on (vLLM keeps it for last-token pooling) in blocks of
``--vllm-block-size`` tokens (its CPU default is 128; 32, the smallest its CPU attention takes,
caches nothing of an instruction shorter than that), ``VLLM_CPU_OMP_THREADS_BIND`` on every
core and a 2 GiB KV cache. Every system is warmed first
(start-up and a few rows, untimed; vLLM's prefix cache reset after). Repeats are interleaved
(repeat k of every system before repeat k+1). Prints a Markdown table (rows/s, tokens/s over
every prompt token, median seconds, the lowest cosine and the largest difference from
batchjob's native embeddings) and writes out/bench_embed/ and ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "bench_embed"
GIB = 1 << 30


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
    data = OUT / f"rows-{args.rows}-i{args.instruction_tokens}-v{vocab}.parquet"
    OUT.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt": pa.array(rows, pa.list_(pa.int32()))}), data)
    return model, data


def run_vllm(rows: list[list[int]], model: str, pooling: str, dtype: str, block_size: int):
    """(seconds, embeddings, computed prompt tokens) of ``LLM.embed`` over ``rows``."""
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, runner="pooling", dtype=dtype, seed=0,  # tokenizer: pooling IO needs it
              enable_prefix_caching=pooling == "last", block_size=block_size,
              kv_cache_memory_bytes=2 * GIB, disable_log_stats=True,
              pooler_config={"seq_pooling_type": pooling.upper(),
                             "use_activation": True})  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]
    llm.embed(prompts[:8], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    res = llm.embed(prompts, use_tqdm=False)
    seconds = time.perf_counter() - t0
    emb = np.asarray([r.outputs.embedding for r in res], dtype=np.float32)
    cached = sum(int(getattr(r, "num_cached_tokens", 0) or 0) for r in res)
    return seconds, emb, sum(map(len, rows)) - cached


def run_batchjob(table: pa.Table, model: str, backend: str, dtype: str):
    import batchjob

    with batchjob.Generator(
        model={"path": model, "task": "embed", "dtype": dtype}, engine={"backend": backend}
    ) as g:
        g.generate(table.slice(0, 8))  # warm-up (vLLM: start-up)
        t0 = time.perf_counter()
        res = g.generate(table)
        seconds = time.perf_counter() - t0
    bad = [s for s in res["status"].to_pylist() if s != "ok"]
    if bad:
        raise SystemExit(f"batchjob {backend}: {len(bad)} rows not embedded (first: {bad[0]})")
    return seconds, np.asarray(res["embedding"].to_pylist(), dtype=np.float32), None


def run_one(system: str, model: str, data: str, pooling: str, dtype: str, out: str,
            block_size: int) -> None:  # fmt: skip
    """One system in this process: writes {seconds, rows, tokens, ...} and its embeddings."""
    table = pq.read_table(data)
    rows = table["prompt"].to_pylist()
    if system == "vllm-embed":
        seconds, emb, computed = run_vllm(rows, model, pooling, dtype, block_size)
    else:
        backend = "vllm" if system == "batchjob-vllm" else "native"
        seconds, emb, computed = run_batchjob(table, model, backend, dtype)
    np.save(out + ".npy", emb)
    tokens = sum(map(len, rows))
    record = {"seconds": seconds, "rows": len(rows), "tokens": tokens, "computed": computed}
    Path(out + ".json").write_text(json.dumps(record))


def agreement(emb: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(lowest per-row cosine, largest absolute difference) of ``emb`` against ``ref``."""
    a = emb.astype(np.float64)
    b = ref.astype(np.float64)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    return float(cos.min()), float(np.abs(a - b).max())


def cpu_name() -> str:
    """/proc/cpuinfo's model name, family and model (what lscpu shows)."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return f"{info.get('model name')} family {info.get('cpu family')} model {info.get('model')}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--instruction-tokens", type=int, default=24)
    ap.add_argument("--pooling", choices=("last", "mean", "cls"), default="last")
    ap.add_argument("--systems", default="batchjob,batchjob-vllm,vllm-embed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vllm-block-size", type=int, default=32)
    ap.add_argument("--model-shape", default=None, help="batchjob.testing.model_shapes name")
    ap.add_argument("--results", default=None, help="JSON file for every run and the table")
    ap.add_argument("--one", nargs=5, help=argparse.SUPPRESS)  # system model data pooling out
    args = ap.parse_args()
    if args.one:
        system, model, data, pooling, out = args.one
        run_one(system, model, data, pooling, args.dtype, out, args.vllm_block_size)
        return 0
    model, data = build(args)
    systems = args.systems.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for k in range(args.repeats):  # interleaved: repeat k of every system, then k + 1
        for system in systems:
            out = str(OUT / f"{system}-{k}")
            cmd = [sys.executable, __file__, "--dtype", args.dtype, "--vllm-block-size",
                   str(args.vllm_block_size), "--one", system, str(model), str(data),
                   args.pooling, out]  # fmt: skip
            subprocess.run(cmd, check=True, cwd=ROOT)
            runs[system].append(json.loads(Path(out + ".json").read_text()))
            print(f"# {system} repeat {k}: {runs[system][-1]['seconds']:.2f} s", flush=True)
    base = "batchjob" if "batchjob" in systems else systems[0]
    lines = [f"| system | rows/s | tokens/s | seconds (median) | vs vllm-embed | min cosine vs "
             f"{base} | max abs diff |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    ref = np.load(str(OUT / f"{base}-0") + ".npy")
    med = {s: float(np.median([r["seconds"] for r in runs[s]])) for s in systems}
    summary = {}
    for system in systems:
        cos, diff = agreement(np.load(str(OUT / f"{system}-0") + ".npy"), ref)
        s, first = med[system], runs[system][0]
        ratio = med["vllm-embed"] / s if "vllm-embed" in med else float("nan")
        summary[system] = {"rows_per_s": first["rows"] / s, "tokens_per_s": first["tokens"] / s,
                           "median_s": s, "speed_vs_vllm_embed": ratio, "min_cosine": cos,
                           "max_abs_diff": diff}  # fmt: skip
        lines.append(f"| {system} | {first['rows'] / s:.1f} | {first['tokens'] / s:.0f} | "
                     f"{s:.2f} | {ratio:.2f}x | {cos:.6f} | {diff:.2e} |")  # fmt: skip
    table = "\n".join(lines)
    (OUT / "embed.md").write_text(table + "\n")
    print(table)
    if args.results:
        from importlib.metadata import PackageNotFoundError, version

        try:
            vllm_version = version("vllm-cpu")
        except PackageNotFoundError:
            vllm_version = version("vllm")
        record = {"args": {k: v for k, v in vars(args).items() if k not in ("one", "results")},
                  "model": str(model.relative_to(ROOT)), "cpu": cpu_name(),
                  "vllm": vllm_version, "runs": runs, "summary": summary,
                  "table": table}  # fmt: skip
        Path(args.results).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
