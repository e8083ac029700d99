"""batchjob.model.host_cpu and the CPU side of ``model.dtype = "auto"`` (torch-free)."""

from __future__ import annotations

import pytest

from batchjob.model.host_cpu import CpuInfo, host_cpu, parse_cpuinfo
from batchjob.model.info import CPU_AUTO_BF16, auto_cpu_dtype, resolve_dtype

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: something else
flags\t\t: fpu
"""
SPR = parse_cpuinfo(CPUINFO)
EPYC_AVX2 = CpuInfo("AMD EPYC 7B13", frozenset({"avx2", "fma", "sse2"}))
AVX512_NO_BF16 = CpuInfo("Intel Xeon Skylake", frozenset({"avx2", "fma", "avx512f"}))


def test_parse_cpuinfo_first_processor_and_key_flags() -> None:
    assert SPR.model == "Intel(R) Xeon(R) Processor"
    assert SPR.key_flags == ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    assert SPR.summary() == "Intel(R) Xeon(R) Processor [avx2 fma avx512f avx512_bf16 amx_bf16]"
    assert SPR.has_fast_bf16 and not EPYC_AVX2.has_fast_bf16
    assert not AVX512_NO_BF16.has_fast_bf16
    assert EPYC_AVX2.key_flags == ("avx2", "fma")
    assert host_cpu().model  # this machine's, whatever it is


@pytest.mark.parametrize(
    "checkpoint,cpu,prefer_bf16,want",
    [
        ("bfloat16", SPR, True, "bfloat16"),  # AMX / AVX-512 BF16: bf16 when the policy says so
        ("float16", SPR, True, "bfloat16"),  # no fast fp16 on CPU: bf16 (vLLM CPU does the same)
        ("bfloat16", SPR, False, "float32"),
        ("float32", SPR, True, "float32"),  # never below the checkpoint's precision
        (None, SPR, True, "float32"),
        ("bfloat16", EPYC_AVX2, True, "float32"),  # no bf16 hardware: float32
        ("float16", EPYC_AVX2, True, "float32"),
        ("bfloat16", AVX512_NO_BF16, True, "float32"),
    ],
)
def test_auto_cpu_dtype(checkpoint: str | None, cpu: CpuInfo, prefer_bf16: bool, want: str) -> None:
    assert auto_cpu_dtype(checkpoint, cpu, prefer_bf16) == want


@pytest.mark.parametrize("checkpoint", ["float16", "bfloat16", "float32", None])
def test_resolve_dtype_auto_on_cpu(checkpoint: str | None) -> None:
    assert resolve_dtype("auto", checkpoint, "cpu", EPYC_AVX2) == "float32"
    want = auto_cpu_dtype(checkpoint, SPR, CPU_AUTO_BF16)
    assert resolve_dtype("auto", checkpoint, "cpu", SPR) == want
    assert resolve_dtype("bfloat16", checkpoint, "cpu", EPYC_AVX2) == "bfloat16"  # as asked
    assert resolve_dtype("auto", checkpoint, "cuda", EPYC_AVX2) == (checkpoint or "float32")
