"""Compile the kernels for a real GPU target without a GPU, and report registers and spills.

The interpreter never runs Triton's compiler, so CPU-only test runs would not notice code
that fails to compile or spills registers on a GPU. This module compiles every autotune
config (or one per kernel with --quick) for sm_90 with Triton's bundled ptxas and prints a
table. Run it with TRITON_INTERPRET unset::

    python -m batchjob.kernels.triton.aot_check [--quick] [--arch 90] [--head-dim 128] [--gqa 4]
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

_PTR_TYPES = {"q_ptr": "act", "k_ptr": "act", "v_ptr": "act", "out_ptr": "act"}
_PTR_TYPES |= {"kc_ptr": "act", "vc_ptr": "act", "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32"}
_PTR_TYPES |= {"slot_ptr": "*i64"}


@dataclass(frozen=True)
class Report:
    kernel: str
    config: str
    regs: int
    spill_bytes: int
    smem: int
    mma: str
    seconds: float

    def line(self) -> str:
        spill = f"SPILLS {self.spill_bytes} B" if self.spill_bytes else "0"
        return (
            f"| {self.kernel} | {self.config} | {self.regs} | {spill} | {self.smem} | "
            f"{self.mma} | {self.seconds:.1f} |"
        )


def _signature(fn, consts: dict, act: str) -> tuple[dict, dict]:
    """Argument types as a launch would specialise them (16-aligned pointers and strides)."""
    sig, attrs = {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            kind = _PTR_TYPES.get(name, "*i32")
            sig[name] = "*" + act if kind == "act" else kind
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
        if name.endswith("_ptr") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _ptxas_spills(ptx: str, arch: int) -> int:
    from triton.backends.nvidia.compiler import get_ptxas  # the one Triton itself uses

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        cmd = [ptxas, "-v", f"--gpu-name={gpu}", str(src), "-o", str(Path(tmp) / "k.o")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


def compile_report(fn, consts: dict, act: str, warps: int, stages: int, arch: int) -> Report:
    sig, attrs = _signature(fn, consts, act)
    t0 = time.time()
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    spills = _ptxas_spills(c.asm["ptx"], arch)
    ttgir = c.asm["ttgir"]
    mma = "wgmma" if "warp_group_dot" in ttgir else "mma" if "nvidia_mma" in ttgir else "-"
    tiles = {k: v for k, v in consts.items() if k.startswith("BLOCK")}
    cfg = " ".join(f"{k}={v}" for k, v in tiles.items()) + f" w{warps} s{stages}"
    regs = _cubin_regs(c.asm["cubin"])
    return Report(fn.fn.__name__, cfg, regs, spills, c.metadata.shared, mma, time.time() - t0)


def _cubin_regs(cubin: bytes) -> int:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+)", out.stdout)
    return int(m.group(1)) if m else -1


def main(argv: list[str] | None = None) -> int:
    from .checks import interpreting

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one config per kernel")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"])
    args = ap.parse_args(argv)
    if interpreting():
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    from . import attention_kernels as ak
    from .kv_write import write_kv_kernel

    gqa_pad = triton.next_power_of_2(args.gqa)
    d_pad = max(16, triton.next_power_of_2(args.head_dim))
    base = {"GQA": args.gqa, "GQA_PAD": gqa_pad, "D": args.head_dim, "D_PAD": d_pad}
    attn = {**base, "PAGE": args.page, "DOT_F32": False}
    attn["DOT_PREC"] = "tf32x3" if args.dtype == "fp32" else "tf32"
    jobs = []
    for fn, configs, extra in (
        (ak.fused_kernel, ak.fused_kernel_tuned.configs, {}),
        (ak.prefix_kernel, ak.prefix_kernel_tuned.configs, {}),
        (ak.own_kernel, ak.own_kernel_tuned.configs, {"HAS_GROUPS": True}),
    ):
        for cfg in configs[:1] if args.quick else configs:
            consts = {**attn, **extra, **cfg.kwargs}
            jobs.append((fn, consts, cfg.num_warps, cfg.num_stages))
    merge = {**base, "BLOCK_M": max(ak.MERGE_BLOCK_M, gqa_pad)}
    jobs.append((ak.merge_kernel, merge, 4, 1))
    kv = {"H": 8, "D": args.head_dim, "H_PAD": 8, "D_PAD": d_pad, "PAGE": args.page}
    jobs.append((write_kv_kernel, kv, 4, 1))
    print(f"sm_{args.arch}, {args.dtype}, head_dim {args.head_dim}, GQA {args.gqa}")
    print("| kernel | config | regs | spill stores | smem B | mma | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fn, consts, warps, stages in jobs:
        print(compile_report(fn, consts, args.dtype, warps, stages, args.arch).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
