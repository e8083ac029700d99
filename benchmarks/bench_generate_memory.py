"""Peak memory of ``batchjob.generate_batches`` over a long stream: N token-id rows (4-8 tokens
each, the first one of 7 shared ids), max_tokens 1, on a tiny model, fed as Arrow tables of
65,536 rows made on the fly (the input is never whole in memory). Run once per size, each in a
fresh process (peak RSS is per process):

    .venv/bin/python benchmarks/bench_generate_memory.py --rows 100000
    .venv/bin/python benchmarks/bench_generate_memory.py --rows 1000000

Prints a line per result table (rows so far, seconds, peak RSS) and a summary line. The model
is built in models/bench-generate/ (random weights) unless ``--model`` names one.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

import batchjob

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 65536


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def tables(rows: int, vocab: int, seed: int = 0) -> Iterator[pa.Table]:
    rng = np.random.default_rng(seed)
    for start in range(0, rows, CHUNK):
        n = min(CHUNK, rows - start)
        lengths = rng.integers(4, 9, n)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = rng.integers(3, vocab, int(offsets[-1])).astype(np.int32)
        values[offsets[:-1]] = 1 + (np.arange(n) % 7)  # a few shared first tokens
        yield pa.table({"prompt": pa.ListArray.from_arrays(offsets, values)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--model", type=Path, default=None, help="default: a tiny random model")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from batchjob.testing.tiny_model import make_tiny_model

        model = ROOT / "models" / "bench-generate"
        if not (model / "config.json").exists():
            make_tiny_model(model, vocab_size=2500)
    t0 = time.perf_counter()
    done = ok = 0
    for out in batchjob.generate_batches(
        tables(args.rows, json.loads((model / "config.json").read_text())["vocab_size"]),
        model=model,
        sampling={"max_tokens": 1},
        scheduler={"chunk_size": 8192},
        engine={"kv_cache_bytes": "64MiB", "threads": 1},
    ):
        done += out.num_rows
        ok += out["status"].to_pylist().count("ok")
        print(f"{done} rows, {time.perf_counter() - t0:.0f} s, peak RSS {peak_rss_mib():.0f} MiB")
    print(
        f"rows={args.rows}: {done} results ({ok} ok) in {time.perf_counter() - t0:.0f} s; "
        f"peak RSS {peak_rss_mib():.0f} MiB"
    )


if __name__ == "__main__":
    main()
