"""Decode units that take all KV heads (``WHOLE_ROWS``) at two thresholds, on the decode shapes
of bench_cpu_attention and bench_kernel_ab, the calls alternated in one process.

    .venv/bin/python benchmarks/bench_whole_units.py --isa avx512 --dtype float32
    .venv/bin/python benchmarks/bench_whole_units.py --isa amx --dtype bfloat16

Units under ``WHOLE_ROWS`` query rows per head read all KV heads of their cache rows in one
unit (whole rows stream); above it, one unit per KV head reads that head's slice, ``Hkv * D``
elements apart. Median of 10 calls after 2 warm-ups per side; B / A below 1: B is faster.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import click
import torch
from bench_cpu_attention import shapes
from bench_kernel_ab import small_group_shapes

from batchjob.backends.native.attention import cpu
from batchjob.kernels import reference as ref
from batchjob.model.host_cpu import cpu_summary


@click.command()
@click.option("--isa", default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32")
@click.option("--head-dims", default="32,128", show_default=True)
@click.option("--a", "rows_a", default=4, show_default=True, help="WHOLE_ROWS of side A")
@click.option("--b", "rows_b", default=8, show_default=True, help="WHOLE_ROWS of side B")
@click.option("--threads", default=2, show_default=True)
def main(isa: str, dtype: str, head_dims: str, rows_a: int, rows_b: int, threads: int) -> None:
    torch.set_num_threads(threads)
    backend = cpu.CpuAttention(isa, calibrate=False)
    print(f"{cpu_summary()}; {backend.isa} build, {dtype}, {threads} threads")
    print(f"| head dim | shape | A: under {rows_a} ms | B: under {rows_b} ms | B / A |")
    print("|---:|---|---:|---:|---:|")
    saved = cpu.WHOLE_ROWS
    for d in (int(x) for x in head_dims.split(",")):
        for name, spec in {**shapes(d), **small_group_shapes(d)}.items():
            if "decode" not in name:
                continue
            b = ref.build_batch(dataclasses.replace(spec, dtype=getattr(torch, dtype)), seed=0)
            args = (b.q, b.k_cache, b.v_cache, b.meta, b.scale)
            times: dict[int, list[float]] = {rows_a: [], rows_b: []}
            for _ in range(12):
                for rows, ts in times.items():
                    cpu.WHOLE_ROWS = rows
                    side = cpu.CpuAttention(isa, calibrate=False)  # fresh units per setting
                    side.attend(*args)
                    t0 = time.perf_counter()
                    side.attend(*args)
                    ts.append(time.perf_counter() - t0)
            cpu.WHOLE_ROWS = saved
            a, bb = (statistics.median(times[r][2:]) * 1e3 for r in (rows_a, rows_b))
            print(f"| {d} | {name} | {a:.2f} | {bb:.2f} | {bb / a:.3f} |", flush=True)


if __name__ == "__main__":
    main()
