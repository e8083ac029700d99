"""Planner benchmark on the industry case-1 shape (snippet generation).

Each prompt = a 20-token instruction shared by all + a ~1100-token document shared by ~7
requests + a ~400-token distinct query; rows shuffled. Token ids are generated directly with
numpy (seeded); no tokenizer.

Each size runs in a fresh subprocess. Time per stage of ``build_plan`` is wall clock (the
total also as process CPU time, steadier on a shared machine; small sizes: best of 5 runs).
Peak memory per stage: the kernel's resident-set high-water mark (VmHWM) is reset before
each stage through /proc/self/clear_refs, so "peak extra" = VmHWM during the stage minus the
resident set before planning started. It sees numpy allocations (tracemalloc does not) and
counts pages actually touched. The child runs with a fixed glibc mmap threshold so that
freed arrays leave the resident set (otherwise reused heap pages hide allocations).
"peak/x tok" = the largest stage peak / bytes of the int32 token array.

    .venv/bin/python benchmarks/bench_plan.py --sizes 3000,100000,1000000
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

from batchjob.plan import build_plan
from batchjob.tokenize.prompts import TokenizedPrompts

VOCAB = 128_000


def _ragged(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    seg = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(starts, sizes) + (np.arange(int(sizes.sum()), dtype=np.int64) - seg)


def snippet_workload(
    num_requests: int,
    *,
    seed: int = 0,
    share: float = 7.0,
    instr_len: int = 20,
    doc_len: int = 1100,
    query_len: int = 400,
    jitter: float = 0.2,
) -> TokenizedPrompts:
    """Case-1 prompts: instruction + document (shared by ~share rows) + distinct query."""
    rng = np.random.default_rng(seed)
    sizes = 1 + rng.poisson(share - 1, size=num_requests // max(int(share), 1) + 16)
    while sizes.sum() < num_requests:
        sizes = np.concatenate([sizes, 1 + rng.poisson(share - 1, size=16)])
    group = np.repeat(np.arange(len(sizes)), sizes)[:num_requests]
    group = group[rng.permutation(num_requests)]
    num_docs = int(group.max()) + 1 if num_requests else 0

    def jittered(mean: int, n: int) -> np.ndarray:
        lo, hi = int(mean * (1 - jitter)), int(mean * (1 + jitter))
        return rng.integers(max(lo, 1), max(hi, 1) + 1, size=n).astype(np.int64)

    d_len, q_len = jittered(doc_len, num_docs), jittered(query_len, num_requests)
    d_off = np.concatenate([[0], np.cumsum(d_len)])
    docs = rng.integers(0, VOCAB, size=int(d_off[-1]), dtype=np.int32)
    instr = rng.integers(0, VOCAB, size=instr_len, dtype=np.int32)
    lengths = instr_len + d_len[group] + q_len
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.empty(int(offsets[-1]), dtype=np.int32)
    step = 4096
    for s in range(0, num_requests, step):
        r = np.arange(s, min(s + step, num_requests))
        base, g = offsets[r], group[r]
        tokens[_ragged(base, np.full(len(r), instr_len))] = np.tile(instr, len(r))
        tokens[_ragged(base + instr_len, d_len[g])] = docs[_ragged(d_off[g], d_len[g])]
        dst = _ragged(base + instr_len + d_len[g], q_len[r])
        tokens[dst] = rng.integers(0, VOCAB, size=len(dst), dtype=np.int32)
    return TokenizedPrompts(
        row_ids=np.arange(num_requests, dtype=np.int64),
        tokens=tokens,
        offsets=offsets,
        max_tokens=rng.integers(32, 256, size=num_requests).astype(np.int32),
    )


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def run_one(n: int, scale: float, repeats: int) -> dict:
    """Generate, plan `repeats` times (stage times: best run), report one JSON dict."""
    t0 = time.perf_counter()
    p = snippet_workload(n, doc_len=int(1100 * scale), query_len=int(400 * scale))
    gen_s = time.perf_counter() - t0
    best: dict[str, float] = {}
    peaks: dict[str, int] = {}
    plan = None
    for _ in range(repeats):
        base_kb = _status_kb("VmRSS")
        exact = _reset_peak()
        times: dict[str, float] = {}
        cpu = 0.0
        last, last_cpu = time.perf_counter(), time.process_time()

        def on_stage(name: str, times=times, base_kb=base_kb) -> None:
            nonlocal last, last_cpu, cpu
            now, now_cpu = time.perf_counter(), time.process_time()
            times[name] = now - last
            cpu += now_cpu - last_cpu
            peaks[name] = max(peaks.get(name, 0), _status_kb("VmHWM") - base_kb)
            _reset_peak()
            last, last_cpu = time.perf_counter(), time.process_time()  # skip the bookkeeping

        plan = build_plan(p, on_stage=on_stage)
        times["total"] = sum(times.values())
        times["cpu"] = cpu
        if not best or times["total"] < best["total"]:
            best = times
    assert plan is not None
    return {
        "requests": n,
        "tokens": len(p.tokens),
        "token_bytes": p.tokens.nbytes,
        "gen_s": gen_s,
        "times": best,
        "peak_extra_kb": peaks,
        "peak_exact": exact,
        "groups": plan.num_groups,
        "saving_single": plan.stats.saving_ratio_single_level,
        "saving_multi": plan.stats.saving_ratio_multi_level,
    }


STAGES = ("sort", "tree", "reuse", "groups", "order", "stats")


def _print_table(rows: list[dict]) -> None:
    head = ["requests", "tokens"] + [f"{s} s" for s in STAGES] + ["total s", "Mtok/s"]
    head += ["cpu s", "Mtok/cpu-s"]
    head += ["peak/x tok", "groups", "R single", "R multi"]
    print(" | ".join(head))
    for r in rows:
        t = r["times"]
        peak = max(r["peak_extra_kb"].values()) * 1024 / r["token_bytes"]
        worst = max(r["peak_extra_kb"], key=r["peak_extra_kb"].get)
        cells = [f"{r['requests']:,}", f"{r['tokens']:,}"]
        cells += [f"{t[s]:.4f}" for s in STAGES]
        cells += [f"{t['total']:.4f}", f"{r['tokens'] / t['total'] / 1e6:.1f}"]
        cells += [f"{t['cpu']:.4f}", f"{r['tokens'] / t['cpu'] / 1e6:.1f}"]
        cells += [f"{peak:.3f} ({worst})", f"{r['groups']:,}"]
        cells += [f"{r['saving_single']:.4f}", f"{r['saving_multi']:.4f}"]
        print(" | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="3000,100000", help="comma-separated request counts")
    ap.add_argument("--scale", type=float, default=1.0, help="scale document/query lengths")
    ap.add_argument("--repeats", type=int, default=0, help="runs per size (0: 5 if small)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args()
    if args.one is not None:
        reps = args.repeats or (5 if args.one <= 10_000 else 1)
        print(json.dumps(run_one(args.one, args.scale, reps)))
        return
    # A fixed mmap threshold keeps glibc from raising it after the generator frees large
    # blocks: arrays > 128 KiB are then mmapped and unmapped on free, so RSS tracks live memory
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        cmd = [sys.executable, __file__, "--one", str(n), "--scale", str(args.scale)]
        cmd += ["--repeats", str(args.repeats)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"# {n:,} requests: generated in {r['gen_s']:.1f} s", file=sys.stderr)
    _print_table(rows)


if __name__ == "__main__":
    main()
