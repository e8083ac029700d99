"""Two versions of the CPU attention kernel source, A against B, on bench_cpu_attention's shapes
plus decode over 1000-token prefixes shared by 4-48 rows, calls alternated in one process (a
drift of the machine's speed hits both sides). A kernel from before all-head key-major units
(367a3ab) gets the work units it supports.

    git show HEAD~1:kernels/cpu/paged_attention.c > /tmp/old.c
    .venv/bin/python benchmarks/bench_kernel_ab.py kernels/cpu/paged_attention.c /tmp/old.c \\
        --head-dims 32,64,128 --isa avx512 --threads 2

Each source is compiled with kernels/cpu/build.py's flags for ``--isa`` into a temporary
folder and called directly (no calibration: the kernel takes every batch). Median of 10 calls
after 2 warm-ups per side; A/B below 1 means A is faster.
"""

from __future__ import annotations

import ctypes
import dataclasses
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import click
import torch
from bench_cpu_attention import shapes

from batchjob.backends.native.attention.cpu import _work
from batchjob.kernels import reference as ref
from batchjob.kernels.cpu import build
from batchjob.model.host_cpu import cpu_summary


def load(source: Path, isa: str, folder: Path) -> tuple[ctypes._CFuncPtr, dict]:  # type: ignore[name-defined]
    """The build's entry point, and the ``build_units`` arguments its work units need."""
    out = folder / f"{source.stem}-{abs(hash(str(source)))}.so"
    flags = [*build.FLAGS, *build.ISA_FLAGS[isa]]
    subprocess.run(["gcc", *flags, str(source), "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    fn = lib.batchjob_paged_attention
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p, p]
    fn.argtypes += [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    rows, lanes = lib.batchjob_kernel_max_rows(), lib.batchjob_kernel_lanes()
    if hasattr(lib, "batchjob_kernel_max_whole_rows"):  # all-head units of key-major tiles
        return fn, {"max_rows": rows, "lanes": lanes}
    # a kernel from before them: all-head units of row-major decode rows only, <= max_rows
    return fn, {"max_rows": rows, "lanes": lanes, "whole_tiles": False, "max_whole": rows}


def small_group_shapes(d: int) -> dict[str, ref.BatchSpec]:
    rng = random.Random(1)
    out = {}
    # share 16, 24: all-head units of key-major tiles; 48: per-head units of 33-64 rows
    for groups, share in ((14, 4), (8, 6), (6, 16), (4, 24), (2, 48)):
        seqs = tuple(
            ref.SeqSpec(1, rng.randint(100, 150), group=g)
            for g in range(groups)
            for _ in range(share)
        )
        out[f"decode {groups * share} seqs, {groups} prefixes of 1000 (share {share})"] = (
            ref.BatchSpec(seqs, (1000,) * groups, num_q_heads=8, num_kv_heads=8, head_dim=d)
        )
    return out


def call(fn, unit_args: dict, b: ref.PagedBatch):
    """A zero-argument call of ``fn`` on batch ``b`` (its buffers kept alive in the closure)."""
    t, h, d = b.q.shape
    _, bs, hkv, _ = b.k_cache.shape
    units, blocks, _ = _work(b.meta, h, hkv, threads=torch.get_num_threads(), **unit_args)
    out, pout, lse = torch.empty(t, h, d), torch.empty(t, h, d), torch.empty(2, t, h)
    q = b.q.float().contiguous()  # the kernel's queries are float32 (CpuAttention.attend)
    bf16 = int(b.k_cache.dtype == torch.bfloat16)
    args = (q.data_ptr(), b.k_cache.data_ptr(), b.v_cache.data_ptr(), blocks.ctypes.data,
            units.ctypes.data, len(units), t, h, hkv, d, bs, b.scale, out.data_ptr(),
            pout.data_ptr(), lse.data_ptr(), torch.get_num_threads(), bf16)  # fmt: skip

    def run() -> None:
        if fn(*args) != 0:
            raise RuntimeError("kernel rejected its arguments")
        _ = (q, units, blocks, out, pout, lse)  # alive as long as run

    return run


@click.command()
@click.argument("source_a", type=click.Path(exists=True, path_type=Path))
@click.argument("source_b", type=click.Path(exists=True, path_type=Path))
@click.option("--head-dims", default="32,64,128", show_default=True)
@click.option("--isa", type=click.Choice(build.ISAS), default="avx512", show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--repeats", default=10, show_default=True)
@click.option("--only", default="", help="Run only the shapes whose name contains this.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="The KV cache's (and queries') dtype.")  # fmt: skip
def main(
    source_a: Path,
    source_b: Path,
    head_dims: str,
    isa: str,
    threads: int,
    repeats: int,
    only: str,
    dtype: str,
):
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = [load(s, isa, Path(tmp)) for s in (source_a, source_b)]
        print(f"{cpu_summary()}; {isa} build, {threads} threads, {dtype}")
        print(f"A = {source_a}, B = {source_b}")
        print("| head dim | shape | A ms | B ms | A / B |\n|---:|---|---:|---:|---:|")
        for d in (int(x) for x in head_dims.split(",")):
            for name, spec in {**shapes(d), **small_group_shapes(d)}.items():
                if only not in name:
                    continue
                spec = dataclasses.replace(spec, dtype=getattr(torch, dtype))
                b = ref.build_batch(spec, seed=0)
                runs = [call(fn, unit_args, b) for fn, unit_args in kernels]
                times: list[list[float]] = [[], []]
                for rep in range(repeats + 2):
                    for side in (0, 1) if rep % 2 else (1, 0):
                        t0 = time.perf_counter()
                        runs[side]()
                        times[side].append(time.perf_counter() - t0)
                a, bb = (statistics.median(ts[2:]) * 1e3 for ts in times)
                print(f"| {d} | {name} | {a:.2f} | {bb:.2f} | {a / bb:.3f} |", flush=True)


if __name__ == "__main__":
    main()
