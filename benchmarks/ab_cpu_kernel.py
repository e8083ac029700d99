"""Two versions of the CPU attention kernel's source, timed side by side in one process.

For kernel changes: both sources are built (kernels/cpu/build.py, the same flags, other
sources as checked out; both must take the checked-out entry point's arguments,
``batchjob_paged_attention_strided`` as ``run_units`` calls it) and loaded as separate
libraries, then run alternately on the same
batches (vLLM's block-table batches with the native layout, as the vLLM backend runs them:
``prefix_attention.step_work``), so machine drift hits both alike. Prints each version's
median of ``--rounds`` rounds of at least 10 calls, the ratio A / B (> 1: B faster) and the
largest output difference. Each call reads the next of ``--layers`` caches, as a model's
layers do: a cache read again by the very next call stays in L3 where a real step's would
not (one layer: ``--layers 1``).

    git show HEAD~1:kernels/cpu/paged_attention.c > /tmp/old.c
    .venv/bin/python benchmarks/ab_cpu_kernel.py /tmp/old.c kernels/cpu/paged_attention.c \\
        [--heads 8/2x128,8/8x128] [--isa avx2] [--bf16] [--shapes decode]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lib.timing import whole_cycles
from lib.workloads import ATTENTION_SHAPES, BS, block_tables

from batchjob.backends.native.attention.cpu import run_units
from batchjob.backends.vllm import prefix_attention as pa
from batchjob.kernels.cpu import build
from batchjob.kernels.cpu.build import CpuKernel

# bench_vllm_attention's batches, and one with long unshared sequences
SHAPES = [*ATTENTION_SHAPES, ("decode 64, nothing shared, 2000 each", 64, 1, 0, 2000, 1)]


def load(source: Path, isa: str) -> CpuKernel:
    """The build of ``source`` in place of kernels/cpu/paged_attention.c."""
    build.SOURCES = (source.resolve(), *build.SOURCES[1:])
    build._load.cache_clear()
    kn = build._load(isa)
    if kn is None:
        raise SystemExit(f"{source}: no {isa} build")
    return kn


def batch(
    hq: int, hkv: int, d: int, shape: tuple, kn: CpuKernel, bf16: bool, layers: int = 1
) -> Callable:
    """A call running one layer's attention of ``shape`` on a kernel build; each call the next
    of ``layers`` caches (the first again every ``layers`` calls)."""
    nblocks, table, seq, qsl = block_tables(shape)
    bs = BS
    dtype = torch.bfloat16 if bf16 else torch.float32
    kvs = itertools.cycle([torch.randn(nblocks, hkv, bs, 2 * d).to(dtype) for _ in range(layers)])
    q = torch.randn(int(qsl[-1]), hq, d)
    work = pa.step_work(kn, table.numpy(), seq.numpy(), qsl.numpy(), bs, hq, hkv, kv_bf16=bf16)

    def call(k: CpuKernel) -> torch.Tensor:
        return run_units(
            k, q, *pa.native_cache(next(kvs)), work.units, work.blocks, work.has_prefix,
            work.threads, bf16, d**-0.5, None, work.batch.token_order,
        )  # fmt: skip

    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="kernel source A (the baseline)")
    p.add_argument("b", type=Path, help="kernel source B")
    p.add_argument("--heads", default="8/2x128,8/8x128", help="q/kv x dim, comma list")
    p.add_argument("--isa", default=None, help="the build (default: this CPU's widest)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 caches")
    p.add_argument("--shapes", default=None, help="only batches whose name has one of these")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layers", type=int, default=8, help="caches the calls cycle through")
    args = p.parse_args()
    isa = build.select_isa(args.isa)
    ka, kb = load(args.a, isa), load(args.b, isa)
    print(
        f"CPU: {build.cpu_model()}; build {isa}; torch threads {torch.get_num_threads()}; "
        f"{args.layers} layers' caches"
    )
    print("| heads | batch | A ms | B ms | A / B | max diff |\n|---|---|---:|---:|---:|---:|")
    for spec in args.heads.split(","):
        hq, hkv, d = (int(x) for x in spec.replace("x", "/").split("/"))
        for shape in SHAPES:
            if args.shapes and not any(w in shape[0] for w in args.shapes.split(",")):
                continue
            call = batch(hq, hkv, d, shape, ka, args.bf16, args.layers)
            ref = call(ka)
            for _ in range(args.layers - 1):  # back to the first cache
                call(ka)
            diff = (ref - call(kb)).abs().max().item()
            times: dict[str, list[float]] = {"a": [], "b": []}
            reps = whole_cycles(10, args.layers)
            for _ in range(args.rounds):
                for name, k in (("a", ka), ("b", kb)):
                    for _ in range(args.layers):
                        call(k)
                    t = time.perf_counter()
                    for _ in range(reps):
                        call(k)
                    times[name].append((time.perf_counter() - t) / reps * 1e3)
            ta, tb = (statistics.median(times[n]) for n in ("a", "b"))
            print(f"| {spec} | {shape[0]} | {ta:.2f} | {tb:.2f} | {ta / tb:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
