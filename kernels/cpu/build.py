"""Build and load the CPU paged-attention kernel (paged_attention.c) with the system gcc, once
per ISA target.

The same source is compiled per instruction set with explicit flags, never ``-march=native``
(``ISA_FLAGS``): ``amx`` (``avx512bf16`` plus AMX-BF16 tiles for bfloat16 caches' prefill work; the
process asks the OS for AMX state on first use and keeps to vdpbf16ps if refused), ``avx512bf16``
(``avx512`` plus AVX512-BF16: bfloat16 caches' key-major tiles on vdpbf16ps, e.g. AMD Zen 4, Intel
Cooper Lake), ``avx512`` (16 lanes, 32 vector registers), ``avx2`` (AVX2 + FMA, 8 lanes, 16
registers) and ``generic`` (no ISA flags: SSE2 on x86-64, NEON on arm64). The source sizes its
register tiles from the ISA macros the compiler defines. ``cpu_isas()`` lists the targets this CPU
runs, read from its flags; ``select_isa()`` picks the widest, or the one ``$BATCHJOB_CPU_ISA``
(``amx|avx512bf16|avx512|avx2|generic|auto``) or the caller names, narrowed to what the CPU has, so
tests run every path a wider CPU can execute.

Libraries are cached by source, compiler, flags and ISA in a folder (``$BATCHJOB_KERNEL_CACHE``
or ``~/.cache/batchjob/kernels``), written atomically so concurrent processes never load half
a file. ``load_kernel()`` returns None (and says why once) when no compiler is found or the
build fails: the engine then uses the torch attention path.

The library links libgomp; torch is imported first, so the loader reuses torch's libgomp
(same soname) and both share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours)

log = logging.getLogger(__name__)

# one library: the attention kernel, the layer glue that gained from C (RoPE in place, the KV
# write, bf16 RMSNorm) and the linear layers over packed weights
SOURCES = tuple(
    Path(__file__).parent / f
    for f in ("paged_attention.c", "rope.c", "kv_write.c", "linear.c", "glue.c")
)
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math"]
FLAGS += ["-std=gnu11"]
ISA_ENV = "BATCHJOB_CPU_ISA"
# widest first; the CPU flags (/proc/cpuinfo) each target needs, and its compiler flags
ISAS = ("amx", "avx512bf16", "avx512", "avx2", "generic")
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"})
ISA_CPU_FLAGS = {
    "amx": _AVX512 | {"amx_tile", "amx_bf16", "avx512_bf16"},
    "avx512bf16": _AVX512 | {"avx512_bf16"},
    "avx512": _AVX512,
    "avx2": frozenset({"avx2", "fma"}),
    "generic": frozenset(),
}
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]
ISA_FLAGS = {
    "amx": [*_AVX512_FLAGS, "-mamx-tile", "-mamx-bf16", "-mavx512bf16"],
    "avx512bf16": [*_AVX512_FLAGS, "-mavx512bf16"],
    "avx512": _AVX512_FLAGS,
    "avx2": ["-mavx2", "-mfma"],
    "generic": [],
}


@dataclass(frozen=True)
class CpuKernel:
    """A loaded build: ``fn`` is ``batchjob_paged_attention`` (typed); ``lanes``: floats per
    vector (head dims must be multiples); ``max_rows``: query rows one work unit may hold;
    ``linear``/``linear_pack``: linear.c's entry points, ``linear_panel_cols`` its panel
    width."""

    isa: str
    path: Path
    lanes: int
    max_rows: int
    fn: ctypes._CFuncPtr  # type: ignore[name-defined]
    rope: ctypes._CFuncPtr  # type: ignore[name-defined]  # batchjob_rope (rope.c)
    write_kv: ctypes._CFuncPtr  # type: ignore[name-defined]  # batchjob_write_kv (kv_write.c)
    linear: ctypes._CFuncPtr  # type: ignore[name-defined]  # batchjob_linear (linear.c)
    linear_pack: ctypes._CFuncPtr  # type: ignore[name-defined]
    linear_panel_cols: int
    # batchjob_paged_attention_strided: ``fn`` for caches of another layout (vLLM's)
    strided: ctypes._CFuncPtr  # type: ignore[name-defined]
    rms_norm_bf16: ctypes._CFuncPtr  # type: ignore[name-defined]  # glue.c


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (the first ``flags`` line of /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isas(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The targets this CPU can run, widest first (``generic`` always)."""
    flags = cpu_flags() if flags is None else flags
    x86 = platform.machine() in ("x86_64", "AMD64", "i686")
    return tuple(i for i in ISAS if i == "generic" or (x86 and ISA_CPU_FLAGS[i] <= flags))


def select_isa(requested: str | None = None) -> str:
    """``requested`` (else ``$BATCHJOB_CPU_ISA``, else ``auto``) as a target this CPU runs:
    ``auto`` is the widest; a wider one than the CPU has narrows to the widest it has."""
    req = (requested or os.environ.get(ISA_ENV) or "auto").strip().lower()
    have = cpu_isas()
    if req == "auto":
        return have[0]
    if req not in ISAS:
        raise ValueError(f"{ISA_ENV}={req!r}: use one of auto, {', '.join(ISAS)}")
    if req in have:
        return req
    narrower = [i for i in ISAS[ISAS.index(req) :] if i in have]
    log.warning("CPU has no %s (flags); using the %s kernel", req, narrower[0])
    return narrower[0]


def cache_dir() -> Path:
    env = os.environ.get("BATCHJOB_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "batchjob" / "kernels"


def build(isa: str = "generic", compiler: str | None = None) -> Path:
    """Compile (if not cached) the ``isa`` target and return the library's path; raises on
    failure."""
    cc = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    flags = [*FLAGS, *ISA_FLAGS[isa]]
    src = b"".join(f.read_bytes() for f in SOURCES)
    key = hashlib.sha256(src + " ".join([cc, *flags, platform.machine()]).encode()).hexdigest()
    out = cache_dir() / f"paged_attention-{isa}-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # The linker creates the file in a private temp folder beside the target (so its mode
    # follows the umask); fsync, rename, fsync the folder; the temp folder goes on any error.
    # (Same guarantees as batchjob.storage.atomic, which kernels/ may not import.)
    tmp_dir = tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        tmp = os.path.join(tmp_dir, out.name)
        cmd = [cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"]
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
def _load(isa: str) -> CpuKernel | None:
    try:
        path = build(isa)
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as e:
        log.warning("CPU attention kernel (%s) unavailable, using the torch path: %s", isa, e)
        return None
    lib.batchjob_kernel_isa.restype = ctypes.c_char_p
    built = lib.batchjob_kernel_isa().decode()
    if built != isa:  # e.g. a compiler that ignores -mavx512*: never run a mislabelled path
        log.warning("kernel built for %s reports %s; using the torch path", isa, built)
        return None
    fn = lib.batchjob_paged_attention
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p, p]
    fn.argtypes += [ctypes.c_int, ctypes.c_int]  # threads, kv_bf16
    fn.restype = ctypes.c_int
    strided = lib.batchjob_paged_attention_strided
    strided.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, i64, p, i64]
    strided.argtypes += [ctypes.c_float, p, p, p, ctypes.c_int, ctypes.c_int]
    strided.argtypes += [ctypes.c_int, p]  # q_bf16, out_bf16 (NULL: float32 out only)
    strided.restype = ctypes.c_int
    rope = lib.batchjob_rope
    rope.argtypes = [p, i64, i64, i64, i64, i64, p, p, ctypes.c_int, ctypes.c_int]
    rope.restype = ctypes.c_int
    write_kv = lib.batchjob_write_kv
    write_kv.argtypes = [p, p, i64, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int, i64]
    write_kv.restype = ctypes.c_int
    linear, linear_pack = lib.batchjob_linear, lib.batchjob_linear_pack
    linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int]
    linear.restype = ctypes.c_int
    linear_pack.argtypes = [p, p, i64, i64]
    linear_pack.restype = None
    norm = lib.batchjob_rms_norm_bf16
    i32, f32 = ctypes.c_int, ctypes.c_float
    norm.argtypes = [p, i64, p, i64, p, p, i64, i64, i64, f32, i32, i32]
    norm.restype = ctypes.c_int
    lanes, rows = lib.batchjob_kernel_lanes(), lib.batchjob_kernel_max_rows()
    cols = lib.batchjob_linear_panel_cols()
    return CpuKernel(
        isa, path, lanes, rows, fn, rope, write_kv, linear, linear_pack, cols, strided, norm
    )


def load_kernel(isa: str | None = None) -> CpuKernel | None:
    """The kernel for ``select_isa(isa)``, built on first use, or None if unavailable
    (``$BATCHJOB_CPU_KERNEL=0``, no compiler, a failed build)."""
    if os.environ.get("BATCHJOB_CPU_KERNEL", "1") == "0":
        return None
    want = select_isa(isa)
    for target in (i for i in ISAS[ISAS.index(want) :] if i in cpu_isas()):
        kernel = _load(target)  # a compiler without e.g. -mamx-tile: the next narrower build
        if kernel is not None:
            return kernel
    return None
