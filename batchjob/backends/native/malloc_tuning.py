"""glibc malloc settings for CPU inference: freed activations stay in the process.

Every engine step allocates and frees activations of up to tens of MB. By default glibc
gives blocks over its mmap threshold back to the OS when they are freed and trims the top of
its heap, so the next step faults the same memory in again, 4 KiB at a time: 884k minor page
faults in a 10 s run of 2000/200 share 16 at head dim 128, bf16, on a 2-vCPU Zen 4 VM, most
of them this churn (the KV cache is 262k pages). Faults cost more in a VM, and seemed to cost
more still after another process had freed a lot of memory (batchjob ran ~25% slower right
after a vLLM run than alone; the mechanism was not established). Settings, per process:

- allocations up to 32 MiB (glibc's maximum) come from the heap, not from their own mmap;
- the heap top is trimmed only when 2 GiB are free there (it never is in a batch job);
- each heap extension asks for 512 MiB more than it needs (address space; pages are touched
  only when used).

Peak memory is unchanged (the freed blocks are reused by the next step, not added to).
jemalloc or tcmalloc loaded with LD_PRELOAD make this a no-op; ``BATCHJOB_MALLOC_TUNING=0``
turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import cache

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, (1 << 31) - 1), (M_TOP_PAD, 512 << 20))


@cache
def keep_freed_memory() -> bool:
    """Apply SETTINGS once per process; True when glibc took them all."""
    if os.environ.get("BATCHJOB_MALLOC_TUNING", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
