"""One small launch of every Triton kernel, checked against the naive reference: the program
to run under ``compute-sanitizer`` (memcheck, racecheck) on a CUDA GPU.

    python benchmarks/sanitize_kernels.py                      # warms Triton's cache
    compute-sanitizer --tool memcheck python benchmarks/sanitize_kernels.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_kernels.py

Batches mix groups (prefixes ending mid-block), ungrouped sequences, decodes and prefill
chunks, GQA 4 and 1; the fused kernel's last program per group merges the partial results
through an atomic counter, so racecheck sees that path. Exit 1 on a mismatch.
"""

from __future__ import annotations

import os
import sys

import torch

from batchjob.kernels.reference import build_batch, naive_prefix_shared_attention, random_spec
from batchjob.kernels.triton import (
    cascade_prefix_attention,
    fused_prefix_attention,
    plain_paged_attention,
    unshare_kv,
)

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("sanitize_kernels.py needs a CUDA GPU (or TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    bad = []
    cases = [
        (0, torch.bfloat16, 128, 32, 8),
        (1, torch.float16, 64, 4, 4),
        (2, torch.float32, 128, 8, 2),
    ]
    for seed, dtype, d, hq, hkv in cases:
        spec = random_spec(
            seed, dtype=dtype, head_dim=d, num_q_heads=hq, num_kv_heads=hkv, min_groups=2,
            max_groups=3, max_members=5, max_prefix=300, max_own=120, max_chunk=64,
        )  # fmt: skip
        b = build_batch(spec, seed, dev)
        ref = naive_prefix_shared_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale).float()
        outs = {
            "fused": fused_prefix_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale),
            "cascade": cascade_prefix_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale),
            "plain": plain_paged_attention(b.q, unshare_kv(b.meta, b.k_cache, b.v_cache), b.scale),
        }
        if dev == "cuda":
            torch.cuda.synchronize()
        for name, out in outs.items():
            # torch.testing.assert_close's rule with atol = rtol = tol, as the kernel tests
            excess = (out.float() - ref).abs() - TOL[dtype] * ref.abs()
            err = float(excess.max())
            key = f"{name} {str(dtype).removeprefix('torch.')} d{d} {hq}x{hkv}"
            if not err <= TOL[dtype]:  # NaN fails too
                bad.append(key)
            print(f"{key}: max(|diff| - tol*|ref|) {err:.2e} (tol {TOL[dtype]:.0e})", flush=True)
    print("MISMATCH: " + ", ".join(bad) if bad else "all kernels match the reference")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
