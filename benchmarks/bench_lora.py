"""The native engine's LoRA cost: one job run with an adapter (``model.adapter``, the deltas
added per token) against the same rows on the model with that adapter merged into its
weights; one system per fresh process, repeats interleaved.

    flock /tmp/helpers/bench.lock nice -n -20 .venv/bin/python benchmarks/bench_lora.py \\
        --model-shape smollm2-135m --rank 16 --docs 8 --questions 16 --max-tokens 32 --repeats 3 \\
        --results benchmarks/results/zen5_lora_smollm2_135m_fp32.json

The rows are ``--docs`` documents of ``--doc-tokens`` random token ids, each asked
``--questions`` questions of 16 tokens, ``--max-tokens`` generated per row (EOS ignored), so
the run has prefill and decode. The adapter targets all seven projections of every layer
(q/k/v/o/gate/up/down) at ``--rank``. Systems: ``merged`` (no adapters), ``lora`` (every row
with the adapter), ``lora-half`` (every other row with it, the rest on the base model: two
families of groups). Prints rows/s, generated tokens/s and the time relative to merged.
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
OUT = ROOT / "out" / "bench_lora"
SYSTEMS = ("merged", "lora", "lora-half")


def build(args) -> tuple[Path, Path, Path, Path]:
    from batchjob.testing.lora_adapter import make_lora_adapter, merge_lora
    from batchjob.testing.model_shapes import make_shaped_model

    base = make_shaped_model(ROOT / "models" / args.model_shape, args.model_shape)
    adapter = OUT / f"adapter-{args.model_shape}-r{args.rank}"
    if not (adapter / "adapter_config.json").exists():
        make_lora_adapter(adapter, base, rank=args.rank, alpha=2.0 * args.rank, std=0.02)
    merged = OUT / f"merged-{args.model_shape}-r{args.rank}"
    if not (merged / "config.json").exists():
        merge_lora(base, adapter, merged)
    rng = np.random.default_rng(0)
    rows, names = [], []
    for _ in range(args.docs):
        doc = rng.integers(3, 1000, args.doc_tokens).tolist()
        for q in range(args.questions):
            rows.append([1, *doc, *rng.integers(3, 1000, 16).tolist()])
            names.append("a" if q % 2 == 0 else None)
    order = rng.permutation(len(rows))
    table = pa.table({
        "prompt": pa.array([rows[i] for i in order], pa.list_(pa.int32())),
        "half": pa.array([names[i] for i in order], pa.string()),
    })  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    data = OUT / f"rows-{args.docs}x{args.questions}-{args.doc_tokens}.parquet"
    pq.write_table(table, data)
    return base, adapter, merged, data


def run_one(system: str, base: str, adapter: str, merged: str, data: str, args) -> dict:
    import batchjob

    table = pq.read_table(data)
    model: dict = {"path": merged if system == "merged" else base, "dtype": args.dtype}
    inp: dict = {}
    if system != "merged":
        model["adapters"] = {"a": adapter}
        if system == "lora":
            model["adapter"] = "a"
        else:
            inp["adapter_column"] = "half"
    sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0}
    with batchjob.Generator(model=model, input=inp, sampling=sampling) as g:
        g.generate(table.slice(0, 4))  # warm-up
        t0 = time.perf_counter()
        res = g.generate(table)
        seconds = time.perf_counter() - t0
    bad = [s for s in res["status"].to_pylist() if s != "ok"]
    if bad:
        raise SystemExit(f"{system}: {len(bad)} rows failed (first: {bad[0]})")
    generated = int(np.sum(res["num_output_tokens"].to_numpy()))
    return {"seconds": seconds, "rows": table.num_rows, "generated": generated}


def cpu_name() -> str:
    """/proc/cpuinfo's model name, family and model (what lscpu shows)."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return f"{info.get('model name')} family {info.get('cpu family')} model {info.get('model')}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--results", default=None)
    ap.add_argument("--one", nargs=6, help=argparse.SUPPRESS)  # system base adapter merged data out
    args = ap.parse_args()
    if args.one:
        system, base, adapter, merged, data, out = args.one
        Path(out).write_text(json.dumps(run_one(system, base, adapter, merged, data, args)))
        return 0
    base, adapter, merged, data = build(args)
    systems = args.systems.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for k in range(args.repeats):
        for system in systems:
            out = OUT / f"{system}-{k}.json"
            cmd = [sys.executable, __file__, "--dtype", args.dtype, "--max-tokens",
                   str(args.max_tokens), "--one", system, str(base), str(adapter), str(merged),
                   str(data), str(out)]  # fmt: skip
            subprocess.run(cmd, check=True, cwd=ROOT)
            runs[system].append(json.loads(out.read_text()))
            print(f"# {system} repeat {k}: {runs[system][-1]['seconds']:.2f} s", flush=True)
    med = {s: float(np.median([r["seconds"] for r in runs[s]])) for s in systems}
    lines = ["| system | rows/s | generated tokens/s | seconds (median) | time vs merged |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for s in systems:
        first = runs[s][0]
        rel = med[s] / med["merged"] if "merged" in med else float("nan")
        lines.append(f"| {s} | {first['rows'] / med[s]:.1f} | {first['generated'] / med[s]:.0f} "
                     f"| {med[s]:.2f} | {rel:.2f}x |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    if args.results:
        record = {"args": {k: v for k, v in vars(args).items() if k not in ("one", "results")},
                  "cpu": cpu_name(), "runs": runs, "median_s": med,
                  "table": table}  # fmt: skip
        Path(args.results).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
