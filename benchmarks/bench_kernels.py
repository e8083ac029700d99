"""Kernel benchmark (GPU): fused prefix-shared attention vs cascade, plain paged, torch SDPA.

Shapes follow the BatchLLM paper's Figure 8: decode batches of 32 and 256 requests, and a
chunked-prefill batch of 7 prefill + 256 decode requests, for prefix/distinct/share settings
such as 256/2048/all and 2048/256/16 (share: requests per prefix group; all: one group).
Model shape defaults to Mistral-7B / Llama-3-8B attention (32 q heads, 8 kv heads, D 128).

    python benchmarks/bench_kernels.py [--out out/kernels.md] [--quick]
    python benchmarks/bench_kernels.py --cpu-smoke   # no GPU: tiny shapes, interpreter, no timing

Times are CUDA-graph replays (GPU time: what the kernels cost inside a captured model step)
and eager calls (plus host overhead: validation and launches, what an eager engine pays).
TFLOP/s counts useful attention FLOPs (4 * D per visible query-key pair and q head); GB/s
counts unique bytes (q, out, each group's prefix KV once, each sequence's own KV): both have
the same numerator for every variant, so they rank variants like their speed.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Scenario:
    kind: str  # "decode" or "chunked"
    n_decode: int
    n_prefill: int
    prefix: int  # shared prefix tokens per group
    distinct: int  # own tokens per request (prompt + generated so far)
    share: int  # requests per group (0: all requests in one group)
    chunk: int = 512  # prefill chunk of a prefill request (its last `chunk` own tokens)

    @property
    def name(self) -> str:
        share = "all" if self.share == 0 else str(self.share)
        reqs = f"{self.n_prefill}p+{self.n_decode}d" if self.n_prefill else f"{self.n_decode}d"
        return f"{self.kind} {reqs} {self.prefix}/{self.distinct}/{share}"


SETTINGS = [(256, 2048, 0), (2048, 256, 16), (2048, 256, 0), (1024, 1024, 16), (4096, 256, 32)]
QUICK = [(256, 2048, 0), (2048, 256, 16)]


def scenarios(quick: bool) -> list[Scenario]:
    out = []
    for prefix, distinct, share in QUICK if quick else SETTINGS:
        out.append(Scenario("decode", 32, 0, prefix, distinct, share))
        out.append(Scenario("decode", 256, 0, prefix, distinct, share))
        out.append(Scenario("chunked", 256, 7, prefix, distinct, share))
    return out


@dataclass(frozen=True)
class Bench:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: object  # AttentionMetadata
    q_lens: list[int]
    kv_lens: list[int]  # own KV
    groups: list[int]
    prefix_len: int
    flops: float
    unique_bytes: float


def build(
    sc: Scenario, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype, dev: str = "cuda"
) -> Bench:
    from batchjob.backends.native.attention.meta import AttentionMetadata

    n_req = sc.n_prefill + sc.n_decode
    share = sc.share or n_req
    q_lens = [min(sc.chunk, sc.distinct)] * sc.n_prefill + [1] * sc.n_decode
    kv_lens = [sc.distinct] * n_req
    groups = [i // share for i in range(n_req)]
    n_groups = groups[-1] + 1
    pb = math.ceil(sc.prefix / bs)
    own_blocks = [math.ceil(n / bs) for n in kv_lens]
    total = n_groups * pb + sum(own_blocks)
    perm = torch.randperm(total, device=dev).to(torch.int32)
    prefix_bt = perm[: n_groups * pb].view(n_groups, pb)
    width = max(own_blocks)
    bt = torch.zeros(n_req, width, dtype=torch.int32, device=dev)
    cursor = n_groups * pb
    for i, nb in enumerate(own_blocks):
        bt[i, :nb] = perm[cursor : cursor + nb]
        cursor += nb
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    starts = [cu[groups.index(g)] for g in range(n_groups)]
    ends = [cu[n_req - groups[::-1].index(g)] for g in range(n_groups)]
    slots = []
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        pos = torch.arange(kl - ql, kl, device=dev)
        slots.append(bt[i, pos // bs].long() * bs + pos % bs)

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=dev)

    meta = AttentionMetadata(
        cu_q=i32(cu), kv_len=i32(kv_lens), block_table=bt, slot_mapping=torch.cat(slots),
        seq_group=i32(groups), prefix_len=i32([sc.prefix] * n_groups),
        prefix_block_table=prefix_bt.contiguous(), group_q_start=i32(starts),
        group_q_end=i32(ends), max_q_len=max(q_lens), max_kv_len=max(kv_lens),
        max_prefix_len=sc.prefix,
    )  # fmt: skip
    k_cache = torch.randn(total, bs, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn(total, bs, hkv, d, device=dev, dtype=dtype)
    t = cu[-1]
    q = torch.randn(t, hq, d, device=dev, dtype=dtype)
    # visible keys per query: the prefix plus own positions up to its own
    pairs = sum(
        ql * (sc.prefix + kl - ql) + ql * (ql + 1) // 2
        for ql, kl in zip(q_lens, kv_lens, strict=True)
    )
    elt = q.element_size()
    unique = (2 * t * hq * d + 2 * hkv * d * (n_groups * sc.prefix + sum(kv_lens))) * elt
    flops = 4.0 * d * hq * pairs
    return Bench(q, k_cache, v_cache, meta, q_lens, kv_lens, groups, sc.prefix, flops, unique)


def sdpa_runner(b: Bench, scale: float) -> Callable[[], torch.Tensor]:
    """torch SDPA on the dense, unshared problem: one padded batch per (q_len, kv_len) shape."""
    import torch.nn.functional as F

    from batchjob.kernels.triton import unshare_kv

    ub = unshare_kv(b.meta, b.k_cache, b.v_cache)
    bs = b.k_cache.shape[1]
    cu = b.meta.cu_q.tolist()
    buckets: dict[tuple[int, int], list[int]] = {}
    for s, (ql, kl) in enumerate(zip(b.q_lens, ub.kv_len.tolist(), strict=True)):
        buckets.setdefault((ql, kl), []).append(s)
    calls = []
    dev = b.q.device
    for (ql, kl), seqs in buckets.items():
        pos = torch.arange(kl, device=dev)
        blocks = ub.block_table[seqs][:, pos // bs].long()  # [B, K]
        k = ub.k_cache[blocks, pos % bs].transpose(1, 2).contiguous()  # [B, Hkv, K, D]
        v = ub.v_cache[blocks, pos % bs].transpose(1, 2).contiguous()
        rows = torch.tensor([cu[s] + j for s in seqs for j in range(ql)], device=dev)
        q = b.q[rows].view(len(seqs), ql, *b.q.shape[1:]).transpose(1, 2).contiguous()
        mask = None
        if ql > 1:  # bottom-right causal: query j sees keys <= kl - ql + j
            mask = pos[None, :] <= (kl - ql + torch.arange(ql, device=dev))[:, None]
        calls.append((q, k, v, mask, rows))
    out = torch.empty_like(b.q)

    def run() -> torch.Tensor:
        for q, k, v, mask, rows in calls:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[rows] = o.transpose(1, 2).reshape(-1, *out.shape[1:])
        return out

    return run


def runners(b: Bench, scale: float) -> dict[str, Callable[[], torch.Tensor]]:
    from batchjob.kernels.triton import (
        Workspace,
        cascade_prefix_attention,
        fused_prefix_attention,
        group_order,
        plain_paged_attention,
        unshare_kv,
    )

    ws, order = Workspace(), group_order(b.meta)
    ub = unshare_kv(b.meta, b.k_cache, b.v_cache)
    out = torch.empty_like(b.q)
    args = (b.q, b.k_cache, b.v_cache, b.meta, scale)
    return {
        "fused (1 launch)": lambda: fused_prefix_attention(
            *args, workspace=ws, order=order, out=out
        ),
        "cascade (3 launches)": lambda: cascade_prefix_attention(
            *args, workspace=ws, order=order, out=out
        ),
        "plain paged (no sharing)": lambda: plain_paged_attention(b.q, ub, scale, out=out),
        "torch SDPA (dense, no sharing)": sdpa_runner(b, scale),
    }


def bench_one(sc: Scenario, args: argparse.Namespace) -> list[dict]:
    import triton.testing

    dtype = getattr(torch, args.dtype)
    b = build(sc, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype)
    scale = 1.0 / math.sqrt(args.head_dim)
    rows, ref = [], None
    for name, fn in runners(b, scale).items():
        o = fn().clone()  # warm-up: compiles and autotunes outside the timed region
        torch.cuda.synchronize()
        ref = o if ref is None else ref
        err = (o.float() - ref.float()).abs().max().item()
        graph_ms = triton.testing.do_bench_cudagraph(fn, rep=args.rep)
        eager_ms = triton.testing.do_bench(fn, warmup=10, rep=args.rep)
        rows.append(
            {"scenario": sc.name, "variant": name, "graph_ms": graph_ms, "eager_ms": eager_ms,
             "tflops": b.flops / graph_ms / 1e9, "gbps": b.unique_bytes / graph_ms / 1e6,
             "err": err}
        )  # fmt: skip
        del o
    del b
    torch.cuda.empty_cache()
    return rows


def render(rows: list[dict], header: str) -> str:
    lines = [header, ""]
    lines.append(
        "| scenario | variant | ms (graph) | ms (eager) | TFLOP/s | GB/s | fused speedup "
        "| max abs diff |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    fused = {r["scenario"]: r["graph_ms"] for r in rows if r["variant"].startswith("fused")}
    for r in rows:
        speedup = r["graph_ms"] / fused[r["scenario"]]
        lines.append(
            f"| {r['scenario']} | {r['variant']} | {r['graph_ms']:.4f} | {r['eager_ms']:.4f} | "
            f"{r['tflops']:.1f} | {r['gbps']:.0f} | {speedup:.2f}x | {r['err']:.1e} |"
        )
    lines += [
        "",
        "Fused speedup = variant time / fused time (CUDA-graph times; > 1: fused faster).",
        "",
    ]
    return "\n".join(lines)


def cpu_smoke() -> int:
    """Every variant on tiny Figure-8-like batches under Triton's interpreter; no timing."""
    import os

    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    worst = 0.0
    for kind, n_dec, n_pre in (("decode", 4, 0), ("chunked", 4, 1)):
        for prefix, distinct, share in ((32, 24, 0), (48, 8, 2)):
            sc = Scenario(kind, n_dec, n_pre, prefix, distinct, share, chunk=8)
            b = build(sc, 4, 2, 64, 16, torch.float32, dev="cpu")
            outs = {name: fn().clone() for name, fn in runners(b, 0.125).items()}
            ref = next(iter(outs.values()))
            errs = {n: (o - ref).abs().max().item() for n, o in outs.items()}
            worst = max(worst, *errs.values())
            print(sc.name, {n: f"{e:.1e}" for n, e in errs.items()})
    print("ok" if worst < 1e-4 else f"MISMATCH {worst}")
    return 0 if worst < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="prefix-shared attention kernel benchmark (GPU)")
    ap.add_argument("--out", type=Path, help="also write the markdown table to this file")
    ap.add_argument("--quick", action="store_true", help="two settings instead of five")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rep", type=int, default=50, help="ms of repetitions per measurement")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, no timing")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        return cpu_smoke()
    if not torch.cuda.is_available():
        print(
            "bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False);",
            file=sys.stderr,
        )
        print("use --cpu-smoke to check the code path on CPU.", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    rows = []
    for sc in scenarios(args.quick):
        print(f"... {sc.name}", file=sys.stderr, flush=True)
        new = bench_one(sc, args)
        for line in render(new, "").splitlines():  # its rows now: a time limit keeps them
            if line.startswith("| ") and not line.startswith("| scenario"):
                print(line, file=sys.stderr, flush=True)
        rows += new
    gpu = torch.cuda.get_device_name()
    header = (
        f"# Kernel benchmark\n\n{gpu}; torch {torch.__version__}; triton {triton.__version__}; "
        f"{args.dtype}; Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
        f"block_size={args.block_size}.\n\nCommand: `python benchmarks/bench_kernels.py"
        + (" --quick" if args.quick else "")
        + (f" --out {args.out}" if args.out else "")
        + "`"
    )
    text = render(rows, header)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
