"""CPU attention backends side by side: the C kernel (each ISA build) vs the torch path.

    .venv/bin/python benchmarks/bench_cpu_attention.py [--head-dims 32,64,128] [--isas all]
        [--threads 2] [--repeats 10] [--dtype float32|bfloat16]

Per head dim (8 query heads = 8 KV heads, float32 or bfloat16 queries and cache, block 16)
four shapes: a small decode batch
(3 groups x 15 members, prefix 600, own 60-150 keys), a larger one (32 groups x 8, prefix
512, own 64-96), a group prefill (16 members x 100 distinct tokens over a 600-token prefix)
and one causal 2000-token prefill; plus one GQA shape (32 query heads over 8 KV heads).

Each ISA build this CPU runs (kernels/cpu/build.py) is measured in its own process in which
torch is held to the same ISA (``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``,
``MKL_CBWR``, ``ONEDNN_MAX_CPU_ISA``), so a narrower path is compared with the torch path a
CPU of that ISA would run; the table also gives torch at this CPU's full ISA. Median wall ms
per call (torch's and the kernel's calls alternated), GFLOP/s of the kernel (4 flops per
query-key pair per head dim: QK^T and P.V), the ratios (torch ms / kernel ms: above 1 the kernel is
faster) and what the first-use calibration picks for that shape class (``kernel`` or
``torch``), then torch's fp32 GEMM GFLOP/s, at full ISA and held to each build's.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import click
import torch

from batchjob.backends.native.attention.calibrate import alternated_times
from batchjob.backends.native.attention.cpu import CpuAttention
from batchjob.backends.native.attention.torch_path import TorchAttention
from batchjob.kernels import reference as ref
from batchjob.kernels.cpu import build

# torch held to an ISA: its own vector kernels, MKL and oneDNN. MKL ignores
# MKL_ENABLE_INSTRUCTIONS on non-Intel CPUs (on an AMD EPYC its sgemm stays on AVX2 + FMA:
# mkl_blas_def_sgemm_kernel_0_zen, vfmadd231ps on ymm); MKL_CBWR=COMPATIBLE holds it to SSE2
# there too (~60 GFLOP/s at 2048^3 on 2 Zen 4 cores, like OpenBLAS's Nehalem kernels).
TORCH_ISA_ENV = {
    "avx512": {},
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "generic": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "MKL_CBWR": "COMPATIBLE",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
}


def shapes(head_dim: int, dtype: torch.dtype = torch.float32) -> dict[str, ref.BatchSpec]:
    rng = random.Random(0)
    dims = dict(num_q_heads=8, num_kv_heads=8, head_dim=head_dim, dtype=dtype)
    decode = [ref.SeqSpec(1, rng.randint(60, 150), group=g) for g in range(3) for _ in range(15)]
    big = [ref.SeqSpec(1, rng.randint(64, 96), group=g) for g in range(32) for _ in range(8)]
    return {
        "decode 45 seqs, 3 prefixes of 600": ref.BatchSpec(tuple(decode), (600,) * 3, **dims),
        "decode 256 seqs, 32 prefixes of 512": ref.BatchSpec(tuple(big), (512,) * 32, **dims),
        "prefill 16x100 over prefix 600": ref.BatchSpec(
            tuple(ref.SeqSpec(100, 100, group=0) for _ in range(16)), (600,), **dims
        ),
        "causal prefill 2000": ref.BatchSpec((ref.SeqSpec(2000, 2000),), (), **dims),
        "GQA 32/8: decode 45 seqs": ref.BatchSpec(
            tuple(decode), (600,) * 3, **{**dims, "num_q_heads": 32}
        ),
    }


def pairs(spec: ref.BatchSpec) -> float:
    """Query-key pairs attended (prefix + own causal)."""
    n = 0.0
    for s in spec.seqs:
        p = spec.prefix_lens[s.group] if s.group >= 0 else 0
        n += s.q_len * (p + s.kv_len - s.q_len) + s.q_len * (s.q_len + 1) / 2
    return n


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def paired_ms(fns, args, repeats: int) -> list[float]:
    """Median wall ms per call of each of ``fns``, their calls alternated (a drift of the
    machine's speed, minutes long on a VM, then hits every side alike)."""
    return [statistics.median(ts) * 1e3 for ts in alternated_times(fns, args, repeats)]


def gemm_gflops(repeats: int) -> float:
    """torch's float32 GEMM at 2048^3, GFLOP/s (at the ISA this process holds torch to)."""
    x, y = torch.randn(2048, 2048), torch.randn(2048, 2048)
    x @ y
    t = time.perf_counter()
    for _ in range(repeats):
        x @ y
    return 2 * 2048**3 * repeats / (time.perf_counter() - t) / 1e9


def measure_isa(isa: str, head_dims: list[int], repeats: int, dtype: torch.dtype) -> list[dict]:
    """Rows for one ISA build (run in a process whose torch is held to that ISA)."""
    rows = []
    kernel = CpuAttention(isa, calibrate=False)
    picker = CpuAttention(isa, calibrate=True)
    for d in head_dims:
        for name, spec in shapes(d, dtype).items():
            b = ref.build_batch(spec, seed=0)
            args = (b.q, b.k_cache, b.v_cache, b.meta, b.scale)
            t_ms, k_ms = paired_ms((TorchAttention().attend, kernel.attend), args, repeats)
            pick = "kernel" if picker.uses_kernel(b.q, b.k_cache, b.v_cache, b.meta) else "torch"
            flops = pairs(spec) * spec.num_q_heads * d * 4
            rows.append(dict(isa=isa, d=d, shape=name, torch=t_ms, kernel=k_ms, pick=pick,
                             gflops=flops / k_ms / 1e6))  # fmt: skip
    return rows


@click.command()
@click.option("--head-dims", default="32,64,128", show_default=True)
@click.option("--isas", default="all", show_default=True, help="Comma list or 'all' (this CPU).")
@click.option("--threads", default=2, show_default=True)
@click.option("--repeats", default=10, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="Queries' and KV cache's dtype.")  # fmt: skip
@click.option("--child", default="", hidden=True)
def main(head_dims: str, isas: str, threads: int, repeats: int, dtype: str, child: str) -> None:
    torch.set_num_threads(threads)
    dims = [int(x) for x in head_dims.split(",")]
    if child:  # one ISA, torch already held to it by the parent's environment
        rows = measure_isa(child, dims, repeats, getattr(torch, dtype))
        print(json.dumps({"rows": rows, "gemm": gemm_gflops(repeats)}))
        return
    todo = build.cpu_isas() if isas == "all" else tuple(isas.split(","))
    print(f"CPU: {build.cpu_model()}; ISA builds: {', '.join(todo)}; threads {threads}; {dtype}")
    print(f"load average before: {loadavg()}")
    rows: list[dict] = []
    held: dict[str, float] = {}  # GEMM GFLOP/s with torch held to each ISA
    # the children calibrate afresh beside libraries built in a scratch cache: decisions made
    # with torch held to an ISA are what a CPU of that ISA picks, and stay out of the real cache
    with tempfile.TemporaryDirectory(prefix="bench_cpu_attention-") as scratch:
        for isa in todo:
            env = {**os.environ, **TORCH_ISA_ENV.get(isa, {}), "BATCHJOB_KERNEL_CACHE": scratch}
            cmd = [sys.executable, __file__, "--head-dims", head_dims, "--threads", str(threads)]
            cmd += ["--repeats", str(repeats), "--dtype", dtype, "--child", isa]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            out = json.loads(res.stdout.strip().splitlines()[-1])
            rows += out["rows"]
            held[isa] = out["gemm"]
    native = {(r["d"], r["shape"]): r["torch"] for r in rows if r["isa"] == todo[0]}
    print(
        "\n| head dim | shape | ISA | torch ms (same ISA) | torch ms (full CPU) | kernel ms "
        "| kernel GFLOP/s | torch / kernel (same ISA) | torch / kernel (full CPU) "
        "| calibration picks |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in sorted(rows, key=lambda r: (r["d"], r["shape"], todo.index(r["isa"]))):
        full = native.get((r["d"], r["shape"]), float("nan"))
        print(
            f"| {r['d']} | {r['shape']} | {r['isa']} | {r['torch']:.2f} | {full:.2f} | "
            f"{r['kernel']:.2f} | {r['gflops']:.0f} | {r['torch'] / r['kernel']:.2f}x | "
            f"{full / r['kernel']:.2f}x | {r['pick']} |"
        )
    print(f"\nfp32 GEMM 2048^3 at full ISA (the ceiling for comparison): {gemm_gflops(repeats):.0f}"
          " GFLOP/s; with torch held to each build's ISA: "
          + ", ".join(f"{isa} {held[isa]:.0f}" for isa in todo))  # fmt: skip
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
