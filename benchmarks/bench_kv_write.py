"""The native engine's KV write on the CPU: the C copy (kv_write.c) vs torch index_copy_.

    .venv/bin/python benchmarks/bench_kv_write.py
    .venv/bin/python benchmarks/bench_kv_write.py --tokens 102,2048 --head-dims 32,128

K and V are views of one qkv projection output, as the model passes them (8 KV heads), into
a cache of 2048 blocks of 16 slots, shuffled slots. Calls alternate between the two paths;
microseconds per call, the best of ``--repeats`` rounds of ``--calls`` calls.
"""

from __future__ import annotations

import time

import click
import torch

from batchjob.backends.native.attention.cpu import CpuAttention
from batchjob.backends.native.attention.torch_path import TorchAttention
from batchjob.model.host_cpu import cpu_summary


@click.command()
@click.option("--tokens", default="102,2048", show_default=True)
@click.option("--head-dims", default="32,64,128", show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16")
@click.option("--calls", default=200, show_default=True)
@click.option("--repeats", default=5, show_default=True)
def main(tokens, head_dims, dtype, calls, repeats) -> None:
    c, t = CpuAttention(), TorchAttention()
    if c.kernel is None:
        raise SystemExit("the C kernel did not build")
    dt, hkv = getattr(torch, dtype), 8
    print(f"{cpu_summary()}; isa {c.kernel.isa}; {dtype}; torch threads {torch.get_num_threads()}")
    print("| head dim | tokens | torch index_copy_ (us) | C (us) | speedup |")
    print("| --- | --- | --- | --- | --- |")
    for d in map(int, head_dims.split(",")):
        caches = [torch.empty(2048, 16, hkv, d, dtype=dt) for _ in range(2)]
        for n in map(int, tokens.split(",")):
            qkv = torch.randn(n, (8 + 2 * hkv) * d).to(dt)
            k = qkv[:, 8 * d : (8 + hkv) * d].view(n, hkv, d)
            v = qkv[:, (8 + hkv) * d :].view(n, hkv, d)
            slots = torch.randperm(2048 * 16)[:n]
            best = {"torch": float("inf"), "c": float("inf")}
            for _ in range(repeats):
                for name, backend in (("torch", t), ("c", c)):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        backend.write_kv(*caches, k, v, slots)
                    us = (time.perf_counter() - t0) / calls * 1e6
                    best[name] = min(best[name], us)
            ratio = best["torch"] / best["c"]
            print(f"| {d} | {n} | {best['torch']:.1f} | {best['c']:.1f} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
