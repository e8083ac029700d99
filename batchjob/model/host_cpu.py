"""The host CPU as the dtype choice and the benchmark tables need it: model name and ISA flags.

Read from ``/proc/cpuinfo`` (Linux), torch-free; elsewhere the model is ``platform.processor()``
and the flags are empty (so ``dtype = "auto"`` falls back to float32).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# the flags that decide a kernel path or the dtype (in /proc/cpuinfo's spelling)
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CpuInfo:
    model: str  # "Intel(R) Xeon(R) Processor", "AMD EPYC 7B13", ...
    flags: frozenset[str]

    @property
    def key_flags(self) -> tuple[str, ...]:
        """Those of ``KEY_FLAGS`` this CPU has, in that order."""
        return tuple(f for f in KEY_FLAGS if f in self.flags)

    @property
    def has_fast_bf16(self) -> bool:
        """bf16 matmuls in hardware: AMX tiles or AVX-512 BF16 dot products."""
        return "amx_bf16" in self.flags or "avx512_bf16" in self.flags

    def summary(self) -> str:
        """One compact line for tables: ``model [flag flag ...]``."""
        return f"{self.model} [{' '.join(self.key_flags) or 'no avx2'}]"


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor's ``model name`` and ``flags`` from /proc/cpuinfo text."""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return CpuInfo(model or platform.processor() or platform.machine(), flags)


@cache
def host_cpu() -> CpuInfo:
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuInfo(platform.processor() or platform.machine(), frozenset())


def cpu_summary() -> str:
    return host_cpu().summary()
