"""Linear layers: the C kernel over packed weights (models/cpu_linear.py) vs torch's
F.linear, per layer shape and row count (decode batches to prefill chunks), warm and cold.

    .venv/bin/python benchmarks/bench_cpu_linear.py [--isa auto] [--threads 2] [--repeats 30]
        [--rows 1,8,36,66,128,256,512,1024,2048]

Shapes (in -> out features): the benchmark models' projections at head dim 128 (hidden 256:
qkv 256 -> 3072, o 1024 -> 256, gate_up 256 -> 1024, down 512 -> 256) and a 0.5B-class
model's (hidden 896, intermediate 4864: gate_up 896 -> 9728, down 4864 -> 896) and a square
2048 one. "cold": a buffer of twice the last-level cache is read before each call, as the
KV cache streams through attention before a decode step's projections. Calls of both sides
alternated, medians; ratio torch / kernel (above 1 the kernel is faster). The calibration
decides per shape and row bucket from the cold case with the engine's threads.
"""

from __future__ import annotations

import statistics

import click
import torch

from batchjob.backends.native.attention.calibrate import alternated_times
from batchjob.backends.native.models.cpu_linear import PackedLinear, flush_bytes
from batchjob.kernels.cpu import build
from batchjob.model.host_cpu import cpu_summary

SHAPES = ((256, 3072), (1024, 256), (256, 1024), (512, 256), (896, 9728), (4864, 896),
          (2048, 2048))  # fmt: skip
ROWS = "1,8,36,66,128,256,512,1024,2048"


def paired(fns, x, repeats: int, flush: torch.Tensor | None) -> list[float]:
    """Median ms per call of each of ``fns`` on ``x``, calls alternated, ``flush`` read
    before each (cold caches) when given."""
    before = flush.sum if flush is not None else None
    times = alternated_times(fns, (x,), repeats, before=before)
    return [statistics.median(ts) * 1e3 for ts in times]


@click.command()
@click.option("--isa", default="auto", show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--repeats", default=30, show_default=True)
@click.option("--rows", default=ROWS, show_default=True, help="Comma list of row counts.")
def main(isa: str, threads: int, repeats: int, rows: str) -> None:
    torch.set_num_threads(threads)
    kernel = build.load_kernel(isa)
    if kernel is None:
        raise SystemExit("the C kernel did not build")
    print(f"{cpu_summary()}; {kernel.isa} build, {threads} threads, float32")
    flush = torch.ones(flush_bytes() // 4)
    print("| in -> out | rows | torch ms warm | kernel ms warm | warm torch / kernel "
          "| torch ms cold | kernel ms cold | cold torch / kernel |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=g)
        layer = PackedLinear(w, None, kernel, calibrate=False)
        fns = (layer.forward_torch, layer.kernel_forward)
        for m in map(int, rows.split(",")):
            x = torch.randn(m, k, generator=g)
            tw, kw = paired(fns, x, repeats, None)
            tc, kc = paired(fns, x, repeats, flush)
            print(f"| {k} -> {n} | {m} | {tw:.3f} | {kw:.3f} | {tw / kw:.2f}x | {tc:.3f} "
                  f"| {kc:.3f} | {tc / kc:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
