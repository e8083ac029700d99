"""What the first-use attention calibration measures and picks for bench_cpu_attention's shapes.

    .venv/bin/python benchmarks/bench_calibration.py --head-dims 96,128,256 --isa avx512
    .venv/bin/python benchmarks/bench_calibration.py --isa amx --dtype bfloat16   # AMX tiles
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python benchmarks/bench_calibration.py --isa avx2   # torch held to AVX2 too

Per shape: its shape class's kind, the calibration's kernel and torch milliseconds (one
thread, CPU time of that thread, fastest of 5 alternating calls on the class's synthetic
batch: insensitive to other load on the machine) and the backend it picks. Calibrates into a
fresh temporary cache, so nothing earlier is reused.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import click
import torch
from bench_cpu_attention import shapes

from batchjob.backends.native.attention.cpu import CpuAttention
from batchjob.kernels import reference as ref
from batchjob.model.host_cpu import cpu_summary


@click.command()
@click.option("--head-dims", default="32,64,96,128,256", show_default=True)
@click.option("--isa", default="auto", show_default=True, help="amx|avx512bf16|avx512|avx2|generic")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="The KV cache's and queries' dtype.")  # fmt: skip
def main(head_dims: str, isa: str, dtype: str) -> None:
    os.environ["BATCHJOB_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="bench-calibration-")
    os.environ["BATCHJOB_CPU_CALIBRATE"] = "1"
    backend = CpuAttention(isa, calibrate=True)
    print(f"{cpu_summary()}; kernel {backend.isa}; torch ISA env "
          f"{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}; {dtype}")  # fmt: skip
    print("| head dim | shape | class | kernel ms | torch ms | torch / kernel | picks |")
    print("|---:|---|---|---:|---:|---:|---|")
    for d in (int(x) for x in head_dims.split(",")):
        for name, spec in shapes(d).items():
            b = ref.build_batch(dataclasses.replace(spec, dtype=getattr(torch, dtype)), seed=0)
            kind = backend.shape_class(b.q, b.k_cache, b.meta).kind
            dec = backend.decision(b.q, b.k_cache, b.meta)
            pick = "kernel" if dec.use_kernel else "torch"
            print(f"| {d} | {name} | {kind} | {dec.kernel_ms:.2f} | {dec.torch_ms:.2f} | "
                  f"{dec.torch_ms / dec.kernel_ms:.2f}x | {pick} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
