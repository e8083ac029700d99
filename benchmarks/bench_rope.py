"""RoPE in place: the C pass (kernels/cpu/rope.c) against the torch ops it replaces, in one run.

    .venv/bin/python benchmarks/bench_rope.py      # bench-peer's layout: 8 + 8 heads x 128

q and k of a fused qkv output rotated as one strided view (as the Llama layer does), cos/sin
from the model's RopeTable; both paths are bit-equal (tests/engine/test_model_glue.py). Wall
time, median of ``--repeats`` calls per path, the paths alternated call by call.
"""

from __future__ import annotations

import statistics
import time

import click
import torch

from batchjob.backends.native.models import rope
from batchjob.model.host_cpu import cpu_summary


@click.command()
@click.option("--tokens", default=2048, show_default=True)
@click.option("--heads", default=8, show_default=True, help="query heads (KV heads the same)")
@click.option("--head-dims", default="64,128", show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--repeats", default=30, show_default=True)
def main(tokens: int, heads: int, head_dims: str, threads: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    if rope._c_library() is None:
        raise SystemExit("no C kernel library (gcc?): nothing to compare")
    print(f"{cpu_summary()}; {threads} threads; {tokens} tokens x ({heads} + {heads}) heads")
    print("| dtype | head dim | C ms | torch ops ms | torch / C |\n|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for d in (int(x) for x in head_dims.split(",")):
            qkv = torch.randn(tokens, 3 * heads * d).to(dtype)
            inv = rope.inv_frequencies(rope.RopeConfig(theta=10000.0, rope_type="default"), d)
            cos, sin = rope.RopeTable(dtype).lookup(torch.arange(tokens), inv)
            x = qkv[:, : 2 * heads * d].view(tokens, 2 * heads, d)
            kernel = rope._kernel[:]
            times: dict[str, list[float]] = {"c": [], "torch": []}
            for _ in range(repeats + 2):
                for path in times:
                    rope._kernel[:] = kernel if path == "c" else [None]
                    t0 = time.perf_counter()
                    rope.apply_rope_(x, cos, sin)
                    times[path].append(time.perf_counter() - t0)
            rope._kernel[:] = kernel
            c_ms, t_ms = (statistics.median(times[p][2:]) * 1e3 for p in ("c", "torch"))
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {d} | {c_ms:.3f} | {t_ms:.3f} | {t_ms / c_ms:.1f}x |")


if __name__ == "__main__":
    main()
