"""batchjob's prefix-shared kernel inside vLLM against vLLM's own CPU attention, per batch shape.

What the vLLM backend's attention (backends/vllm/prefix_attention.py) changes, one layer's
attention call at a time: vLLM's ``cpu_attention_with_kv_cache`` on its cache layout against
``batchjob_paged_attention_strided`` on the same cache tensor in the native layout, with the
step's work built from vLLM-style block tables (``step_work``: prefix groups found from equal
leading block ids, requests in shuffled batch order). float32 (``--dtype bfloat16``: bf16
queries, caches and output, vLLM's AMX kernel where the CPU has AMX, batchjob's tiles one KV
head a unit there as the backend builds them), block 32, both kernels on the threads torch
has; times are the best of 3 rounds of 10 calls, the two alternating (``--layers 8``: each
call on the next of 8 caches, as cold as a model's other layers leave them). ``--heads``
also takes the real checkpoints' 9/3x64 (SmolLM2-135M), 14/2x64 (Qwen2.5-0.5B) and 32/8x64
(Llama-3.2-1B).

    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv/bin/python benchmarks/bench_vllm_attention.py \\
        [--out benchmarks/results/vllm_attention_zen4.txt]
    # real shapes in bf16, cold caches (what cpu_truth.sh check runs):
    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv/bin/python benchmarks/bench_vllm_attention.py \
        --dtype bfloat16 --heads 9/3x64,14/2x64 --layers 8
    # the batches of a real run, step by step (profile_vllm_backend.py --capture-steps):
    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv/bin/python benchmarks/bench_vllm_attention.py \\
        --heads 8/2x128 --steps out/profile_vllm_backend/micro-2000-200-s16-vllm-sorted/steps \\
        [--layers 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from lib.timing import whole_cycles
from lib.workloads import ATTENTION_SHAPES as SHAPES
from lib.workloads import BS, block_tables

HEADS = [(8, 8, 128), (8, 2, 128), (8, 8, 64)]  # query heads, KV heads, head dim
REAL_HEADS = [(9, 3, 64), (14, 2, 64), (32, 8, 64)]  # SmolLM2-135M, Qwen2.5-0.5B, Llama-3.2-1B


def best_ms(fns: dict[str, Callable[[], None]], rounds: int = 3, calls: int = 10):
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            f()
            t = time.perf_counter()
            for _ in range(calls):
                f()
            times[k].append((time.perf_counter() - t) / calls * 1e3)
    return {k: min(v) for k, v in times.items()}


def measure_batch(
    hq: int,
    hkv: int,
    d: int,
    nblocks: int,
    table: torch.Tensor,
    seq: torch.Tensor,
    qsl: torch.Tensor,
    rounds: int = 3,
    calls: int = 10,
    layers: int = 1,
    dtype: torch.dtype = torch.float32,
) -> tuple[float, float, int]:
    """(vLLM ms, batchjob ms, prefix groups) of one batch: block tables [R, M] int32 into a
    cache of ``nblocks`` blocks, sequence lengths [R], query start offsets [R + 1]. Each call
    reads the next of ``layers`` caches, so a cache is as cold as a model's other layers
    leave it (1: the same cache every call, warm where it fits L3)."""
    from batchjob.backends.vllm.attention_choice import call_pair

    vllm, ours, groups = call_pair(hq, hkv, d, BS, dtype, (nblocks, table, seq, qsl), layers)
    ms = best_ms({"vllm": vllm, "ours": ours}, rounds, whole_cycles(calls, layers))
    return ms["vllm"], ms["ours"], groups


def replay(
    folder: Path, hq: int, hkv: int, d: int, layers: int = 1, dtype: torch.dtype = torch.float32
) -> list[str]:
    """Both kernels on every step batch saved in ``folder`` (profile_vllm_backend.py
    --capture-steps), on random queries and caches (``layers`` of them, each call the next):
    per-step-kind totals of one layer's calls, and the steps with prompt tokens one by one."""
    files = sorted(folder.glob("step-*.npz"))
    if not files:
        raise SystemExit(f"--steps: no step-*.npz in {folder}")
    totals = {k: [0.0, 0.0, 0] for k in ("prefill", "decode")}
    rows = []
    for f in files:
        z = np.load(f)
        if int(z["block_size"]) != BS:
            raise SystemExit(f"{f}: block size {int(z['block_size'])}, this bench runs {BS}")
        qsl = torch.from_numpy(z["query_start_loc"]).int()
        seq = torch.from_numpy(z["seq_lens"]).int()
        table = torch.from_numpy(z["block_table"]).int().contiguous()
        qlen = (qsl[1:] - qsl[:-1]).numpy()
        kind = "decode" if (qlen == 1).all() else "prefill"
        nblocks = int(table.max()) + 1
        v, o, g = measure_batch(hq, hkv, d, nblocks, table, seq, qsl, 3, 2, layers, dtype)
        tot = totals[kind]
        tot[0], tot[1], tot[2] = tot[0] + v, tot[1] + o, tot[2] + 1
        if kind == "prefill":
            prompt = int(qlen[qlen > 1].sum())
            rows.append(
                f"| {f.stem} | {len(seq)} | {prompt} | {int((qlen == 1).sum())} | "
                f"{int(seq.max())} | {g} | {v:.2f} | {o:.2f} | {v / o:.2f}x |"
            )
    lines = [
        f"steps of {folder} at {hq}/{hkv} x {d}: one layer's calls summed, {layers} layers' caches",
        "",
        "| steps | count | vLLM ms | batchjob ms | vLLM / batchjob |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, (v, o, n) in totals.items():
        if n:
            lines.append(f"| {kind} | {n} | {v:.1f} | {o:.1f} | {v / o:.2f}x |")
    lines += [
        "",
        "| step | requests | prompt tokens | decode tokens | longest | groups | vLLM ms | "
        "batchjob ms | vLLM / batchjob |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    p.add_argument("--heads", default=None, help="only these q/kv x dim, e.g. 8/2x128,8/8x64")
    p.add_argument("--shapes", default=None, help="only batches whose name has one of these")
    p.add_argument(
        "--steps",
        type=Path,
        default=None,
        help="instead of the shapes, replay the step batches saved in this folder by "
        "profile_vllm_backend.py --capture-steps (one --heads shape)",
    )
    p.add_argument(
        "--layers", type=int, default=1, help="caches the calls cycle through (8: cold as in a run)"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    heads = HEADS
    if args.heads:
        want = {h.replace(" ", "") for h in args.heads.split(",")}
        heads = [x for x in HEADS + REAL_HEADS if f"{x[0]}/{x[1]}x{x[2]}" in want]
        if len(heads) != len(want):
            raise SystemExit(f"--heads: choose from {HEADS + REAL_HEADS} as q/kvxdim")
    shapes = SHAPES
    if args.shapes:
        shapes = [s for s in SHAPES if any(w in s[0] for w in args.shapes.split(","))]
    import vllm
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from batchjob.backends.vllm import prefix_attention as pa
    from batchjob.model.host_cpu import host_cpu

    kn = pa.kernel()
    amx = bool(kn is not None and args.dtype == "bfloat16" and kn.isa == "amx")
    lines = [
        f"CPU: {host_cpu().summary()}; torch threads {torch.get_num_threads()}; "
        f"vLLM {vllm.__version__} ({_get_attn_isa(dtype, BS, heads[0][2])} kernel); "
        f"batchjob {kn and kn.isa} build{' on AMX' if amx else ''}; {args.dtype}, block {BS}",
        "",
        "| heads (q/kv) x dim | batch | vLLM ms | batchjob ms | vLLM / batchjob | groups |",
        "|---|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    if args.steps is not None:
        for hq, hkv, d in heads[:1]:
            out = replay(args.steps, hq, hkv, d, args.layers, dtype)
            print("\n".join(out), flush=True)
            lines += out
        shapes = []
    for hq, hkv, d in heads:
        for shape in shapes:
            v, o, g = measure_batch(
                hq, hkv, d, *block_tables(shape), layers=args.layers, dtype=dtype
            )
            line = f"| {hq}/{hkv} x {d} | {shape[0]} | {v:.2f} | {o:.2f} | {v / o:.2f}x | {g} |"
            print(line, flush=True)
            lines.append(line)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
