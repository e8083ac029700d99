"""bf16 queries read in place by the CPU attention kernel against the widened float32 copy.

    .venv/bin/python benchmarks/ab_bf16_queries.py [--repeats 15]

The native engine hands the kernel bf16 queries as a view of the layer's qkv output, which
the kernel widens row by row and whose output it rounds to bf16 itself; the alternative is
torch's ``q.to(float32).contiguous()`` before the call and ``.to(bfloat16)`` after. Both on
bench_cpu_attention's shapes (bf16 cache, head dims 32/64/128), calls alternated, median ms
per call; outputs checked equal first.
"""

from __future__ import annotations

import statistics

import click
import torch
from bench_cpu_attention import shapes

from batchjob.backends.native.attention.calibrate import alternated_times
from batchjob.backends.native.attention.cpu import CpuAttention
from batchjob.kernels import reference as ref
from batchjob.kernels.cpu.build import load_kernel


@click.command()
@click.option("--repeats", default=15, show_default=True)
@click.option("--threads", default=2, show_default=True)
def main(repeats: int, threads: int) -> None:
    torch.set_num_threads(threads)
    kn = load_kernel()
    if kn is None:
        raise SystemExit("no C compiler: no kernel to time")
    kernel = CpuAttention(kn.isa, calibrate=False)
    print(f"kernel build {kn.isa}, {threads} threads; ms per call (widened / in place)")

    def in_place(q, k, v, meta, scale):
        return kernel.attend(q, k, v, meta, scale)

    def widened(q, k, v, meta, scale):
        wide = q.to(torch.float32).contiguous()
        return kernel.attend(wide, k, v, meta, scale).to(torch.bfloat16)

    for d in (32, 64, 128):
        for name, spec in shapes(d, torch.bfloat16).items():
            b = ref.build_batch(spec, seed=0)
            t, h, _ = b.q.shape
            qkv = torch.zeros(t, (h + 2 * spec.num_kv_heads) * d, dtype=torch.bfloat16)
            q = qkv[:, : h * d].view(t, h, d)  # as the engine passes it: a view of qkv
            q.copy_(b.q)
            args = (q, b.k_cache, b.v_cache, b.meta, b.scale)
            assert torch.equal(in_place(*args), widened(*args))
            w, i = (
                statistics.median(x) * 1e3
                for x in alternated_times((widened, in_place), args, repeats)
            )
            print(f"d{d:<4d} {name:36s} {w:8.3f} {i:8.3f}  {w / i:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
