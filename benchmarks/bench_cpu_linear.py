"""Linear layers: the C kernel over packed weights (models/cpu_linear.py) vs torch's
F.linear and oneDNN's product on weights it packed once (models/onednn_ops.py, the torch side
of a float32 PackedLinear and bf16's only path), per layer shape and row count (decode batches
to prefill chunks), warm and cold.

    .venv/bin/python benchmarks/bench_cpu_linear.py [--isa auto] [--threads 2] [--repeats 30]
        [--rows 1,8,36,66,128,256,512,1024,2048] [--dtype float32|bfloat16]
        [--shapes 896:1152,896:896,896:9728,4864:896] [--peers]

Shapes (in -> out features): the benchmark models' projections at head dim 128 (hidden 256:
qkv 256 -> 3072, o 1024 -> 256, gate_up 256 -> 1024, down 512 -> 256) and a 0.5B-class
model's (hidden 896, intermediate 4864: gate_up 896 -> 9728, down 4864 -> 896) and a square
2048 one. "cold": a buffer of twice the last-level cache is read before each call, as the
KV cache streams through attention before a decode step's projections. Calls of all sides
alternated, medians; ratios F.linear / kernel and oneDNN / kernel (above 1 the kernel is
faster). The calibration decides per shape and row bucket between the kernel and oneDNN from
the cold case with the engine's threads. bfloat16 has no kernel: F.linear / oneDNN.

``--peers`` adds two sides to oneDNN's: the weight packed for the row count of the call
instead of ``PACK_ROWS_HINT`` ("oneDNN@rows": whether the packed layout's batch hint costs
anything at other row counts), and vLLM's own ``onednn_mm`` handler (what vLLM's CPU linear
layers run, weight packed for a runtime row count; skipped where vLLM's ops do not load). A
Zen 4 (AVX-512-BF16, bf16): all three within 0.97-1.12x at Qwen2.5-0.5B's shapes, 16-2,048
rows; ``cpu_truth.sh check`` runs it on the CPU classes where the engine's linear layers have
not been compared with vLLM's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import click
import torch

from batchjob.backends.native.attention.calibrate import alternated_times
from batchjob.backends.native.models.cpu_linear import PackedLinear, flush_bytes
from batchjob.backends.native.models.onednn_ops import onednn_available, onednn_linear, onednn_pack
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
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True)  # fmt: skip
@click.option("--shapes", default=None, help="Comma list of in:out features (default: SHAPES).")
@click.option("--peers", is_flag=True, help="Add oneDNN packed for the rows and vLLM's onednn_mm.")
def main(
    isa: str, threads: int, repeats: int, rows: str, dtype: str, shapes: str | None, peers: bool
) -> None:
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    kernel = build.load_kernel(isa) if dt == torch.float32 else None
    if dt == torch.float32 and kernel is None:
        raise SystemExit("the C kernel did not build")
    if not onednn_available(dt):
        raise SystemExit(f"this torch build has no oneDNN {dtype} matmul on packed weights")
    built = f"{kernel.isa} build" if kernel else "no kernel"
    print(f"{cpu_summary()}; {built}, {threads} threads, {dtype}")
    flush = torch.ones(flush_bytes() // 4)
    sides: tuple[str, ...] = ("F.linear", "kernel", "oneDNN") if kernel else ("F.linear", "oneDNN")
    vllm_mm = vllm_onednn_mm() if peers else None
    if peers:
        sides += ("oneDNN@rows",) + (("vLLM onednn_mm",) if vllm_mm else ())
        if vllm_mm is None:
            print("vLLM's onednn_mm does not load here: its column is left out")
    base = "kernel" if kernel else "oneDNN"
    ratios = [s for s in sides if s != base]
    head = [f"{s} ms {c}" for c in ("warm", "cold") for s in sides]
    head += [f"{c} {s} / {base}" for c in ("warm", "cold") for s in ratios]
    print("| in -> out | rows | " + " | ".join(head) + " |")
    print("|---|---:|" + "---:|" * len(head))
    g = torch.Generator().manual_seed(0)
    todo = [tuple(map(int, s.split(":"))) for s in shapes.split(",")] if shapes else SHAPES
    for k, n in todo:
        w = torch.randn(n, k, generator=g).to(dt)
        packed = onednn_pack(w)
        handler = vllm_mm[0](w.t(), 32) if vllm_mm else None
        for m in map(int, rows.split(",")):
            fns = [lambda x, w=w: torch.nn.functional.linear(x, w)]
            if kernel is not None:
                fns.append(PackedLinear(w, None, kernel, calibrate=False).kernel_forward)
            fns.append(lambda x, p=packed, n=n: onednn_linear(x, p, None, n))
            if peers:
                at_rows = torch.ops.mkldnn._reorder_linear_weight(w, m)
                fns.append(lambda x, p=at_rows, n=n: onednn_linear(x, p, None, n))
            if vllm_mm is not None:
                fns.append(lambda x, h=handler, run=vllm_mm[1]: run(h, x, None))
            x = torch.randn(m, k, generator=g).to(dt)
            ms = paired(fns, x, repeats, None) + paired(fns, x, repeats, flush)
            warm, cold = ms[: len(sides)], ms[len(sides) :]
            b = sides.index(base)
            cells = [f"{t:.3f}" for t in ms]
            cells += [f"{t[sides.index(s)] / t[b]:.2f}x" for t in (warm, cold) for s in ratios]
            print(f"| {k} -> {n} | {m} | " + " | ".join(cells) + " |", flush=True)


def vllm_onednn_mm() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """vLLM's ``create_onednn_mm`` and ``onednn_mm`` (vllm._custom_ops), or None."""
    try:
        from vllm import _custom_ops as ops

        if not ops._supports_onednn:
            return None
        return ops.create_onednn_mm, ops.onednn_mm
    except Exception:  # no vLLM, or its ops fail to load on this CPU
        return None


if __name__ == "__main__":
    main()
