"""Build and load the CPU paged-attention kernel (csrc/paged_attention.c) with the system gcc.

Compiled once per source, flags and CPU into a cache folder (``$BATCHJOB_KERNEL_CACHE`` or
``~/.cache/batchjob/kernels``), written atomically so concurrent processes never load half a
file. ``load_kernel()`` returns None (and says why once) when no compiler is found or the
build fails: the engine then uses the torch attention path.

The library links libgomp; torch is imported first, so the loader reuses torch's libgomp
(same soname) and both share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]
FLAGS += ["-fno-trapping-math", "-std=gnu11"]


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def cache_dir() -> Path:
    env = os.environ.get("BATCHJOB_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "batchjob" / "kernels"


def build(compiler: str | None = None) -> Path:
    """Compile (if not cached) and return the shared library's path; raises on failure."""
    cc = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"paged_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # The linker creates the file in a private temp folder beside the target (so its mode
    # follows the umask); fsync, rename, fsync the folder; the temp folder goes on any error.
    # (Same guarantees as batchjob.atomic, which kernels/ may not import.)
    tmp_dir = tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        tmp = os.path.join(tmp_dir, out.name)
        cmd = [cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        _fsync(tmp)
        os.replace(tmp, out)
        _fsync(out.parent)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The loaded library with ``batchjob_paged_attention`` typed, or None if unavailable."""
    if os.environ.get("BATCHJOB_CPU_KERNEL", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        log.warning("CPU attention kernel unavailable, using the torch path: %s", e)
        return None
    fn = lib.batchjob_paged_attention
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p, p]
    fn.argtypes += [ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib
