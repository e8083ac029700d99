"""CPU attention backends side by side: the C kernel (CpuAttention) vs the torch path.

    .venv/bin/python benchmarks/bench_cpu_attention.py [--threads 2] [--repeats 10]

Shapes of the peer benchmark's model (8 heads = 8 KV heads x 128, fp32, block 16): a decode
batch (3 groups x 15 members, prefix 600, own 60-150 keys), a group prefill (16 members x 100
distinct tokens over a 600-token prefix), one causal 2000-token prefill. Median ms per call
and GFLOP/s (4 flops per query-key pair per head dim: QK^T and P.V), then an fp32 GEMM's
GFLOP/s as the ceiling.
"""

from __future__ import annotations

import random
import statistics
import time

import click
import torch

from batchjob.backends.native.attention.cpu import CpuAttention
from batchjob.backends.native.attention.torch_path import TorchAttention
from batchjob.kernels import reference as ref


def shapes() -> dict[str, ref.BatchSpec]:
    rng = random.Random(0)
    dims = dict(num_q_heads=8, num_kv_heads=8, head_dim=128)
    decode = [ref.SeqSpec(1, rng.randint(60, 150), group=g) for g in range(3) for _ in range(15)]
    return {
        "decode 45 seqs, 3 prefixes of 600": ref.BatchSpec(tuple(decode), (600,) * 3, **dims),
        "prefill 16x100 over prefix 600": ref.BatchSpec(
            tuple(ref.SeqSpec(100, 100, group=0) for _ in range(16)), (600,), **dims
        ),
        "causal prefill 2000": ref.BatchSpec((ref.SeqSpec(2000, 2000),), (), **dims),
    }


def pairs(spec: ref.BatchSpec) -> float:
    """Query-key pairs attended (prefix + own causal)."""
    n = 0.0
    for s in spec.seqs:
        p = spec.prefix_lens[s.group] if s.group >= 0 else 0
        n += s.q_len * (p + s.kv_len - s.q_len) + s.q_len * (s.q_len + 1) / 2
    return n


@click.command()
@click.option("--threads", default=2, show_default=True)
@click.option("--repeats", default=10, show_default=True)
def main(threads: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    print("| shape | torch ms | C kernel ms | torch GFLOP/s | C kernel GFLOP/s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, spec in shapes().items():
        b = ref.build_batch(spec, seed=0)
        flops = pairs(spec) * spec.num_q_heads * spec.head_dim * 4
        ms = []
        for backend in (TorchAttention(), CpuAttention()):
            backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)  # warm-up, units
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                backend.attend(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
                times.append(time.perf_counter() - t)
            ms.append(statistics.median(times) * 1e3)
        gf = [flops / (m / 1e3) / 1e9 for m in ms]
        print(
            f"| {name} | {ms[0]:.1f} | {ms[1]:.1f} | {gf[0]:.0f} | {gf[1]:.0f} | "
            f"{ms[0] / ms[1]:.2f}x |"
        )
    x, y = torch.randn(2048, 2048), torch.randn(2048, 2048)
    x @ y
    t = time.perf_counter()
    for _ in range(repeats):
        x @ y
    gemm = 2 * 2048**3 * repeats / (time.perf_counter() - t) / 1e9
    print(f"\nfp32 GEMM 2048^3 (the ceiling for comparison): {gemm:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
