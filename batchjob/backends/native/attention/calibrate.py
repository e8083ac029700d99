"""First-use calibration: per shape class, is the C kernel or the torch path faster here?

A shape class is (ISA, torch's CPU capability, head dim, GQA ratio, KV heads, block size,
KV dtype, kind), the kind being what dominates a batch's query-key pairs: ``decode`` (one-token
queries), ``prefill`` (chunks over their own KV), ``prefill_long`` (the same over own KV of
``LONG_KV`` keys or more, pair-weighted: torch's flash kernel gains with length, so a long
prompt's chunks are judged on a long chunk) or ``prefix`` (chunks over a group's shared
prefix). On a class's first batch both backends run a small synthetic batch of that kind on
one thread, timed in CPU time of that thread (one warm-up, then ``REPS`` alternating calls
each): other processes on a busy machine neither deschedule the measurement nor stall an
OpenMP barrier. The pick is the median of the ``REPS`` paired ratios (kernel / torch, calls
side by side, so a drift of the machine's speed cancels), and torch takes a class only when
it is more than ``TORCH_MARGIN`` faster: the kernel is the path built for the job, and a
VM's noise (+-25% between calls on the 2-core EPYC) made a near tie flip a class to torch
in one process and back in the next (d128 ``prefix``: 12.5 vs 11.9 ms one run, 8.3 vs 11.1
the next; the torch path then ran that workload's prefix batches 1.7x slower).
Both backends split work over threads alike, so the one-thread ratio carries over. The
winner is cached in a JSON file beside the kernel library, written atomically, so later
processes reuse it.

``$BATCHJOB_CPU_CALIBRATE``: ``1`` (default) calibrate once and cache; ``0`` no calibration
(the kernel takes every batch it supports); ``fresh`` re-measure and overwrite the cache.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np
import torch

from batchjob.backends.native.attention.base import seq_arrays
from batchjob.backends.native.attention.meta import AttentionMetadata
from batchjob.kernels import reference as ref
from batchjob.kernels.cpu.build import cache_dir, cpu_model
from batchjob.storage.atomic import write_json_atomic
from batchjob.timing import add_calibration

log = logging.getLogger(__name__)

ENV = "BATCHJOB_CPU_CALIBRATE"
KINDS = ("decode", "prefill", "prefill_long", "prefix")
REPS = 7
TORCH_MARGIN = 1.05  # kernel / torch median ratio above which torch takes the class
LONG_KV = 1024  # own-KV keys from which a prefill batch is judged as prefill_long


@dataclass(frozen=True)
class ShapeClass:
    isa: str
    head_dim: int
    gqa: int  # query heads per KV head
    kv_heads: int
    block_size: int
    dtype: str  # the KV cache's: float32 | bfloat16
    kind: str  # one of KINDS

    @property
    def key(self) -> str:
        cap = torch.backends.cpu.get_cpu_capability()  # the fallback's own ISA
        return (
            f"{self.isa}/torch-{cap}/d{self.head_dim}/r{self.gqa}/kv{self.kv_heads}/bs{self.block_size}"
            f"/{self.dtype}/{self.kind}"
        )


class Keyed(Protocol):
    @property
    def key(self) -> str: ...


C = TypeVar("C", bound=Keyed)  # a class of decisions: ShapeClass, cpu_linear.LinearClass


@dataclass(frozen=True)
class Decision:
    use_kernel: bool
    kernel_ms: float
    torch_ms: float


def mode() -> str:
    m = os.environ.get(ENV, "1").strip().lower()
    if m not in ("0", "1", "fresh"):
        raise ValueError(f"{ENV}={m!r}: use 1 (calibrate once), 0 (off) or fresh")
    return m


def batch_kind(meta: AttentionMetadata) -> str:
    """The kind whose query-key pairs dominate the batch."""
    _, q_len, kv_len, prefix = seq_arrays(meta)
    dec = q_len == 1
    pairs = {
        "decode": float(((kv_len + prefix) * dec).sum()),
        "prefill": float((q_len * kv_len * ~dec).sum()),
        "prefix": float((q_len * prefix * ~dec).sum()),
    }
    kind = max(pairs, key=lambda k: pairs[k])
    if kind == "prefill":
        w = (q_len * kv_len * ~dec).astype(np.float64)  # the pairs each sequence adds
        if float((w * kv_len).sum()) >= LONG_KV * float(w.sum()):
            return "prefill_long"
    return kind


def synthetic_batch(cls: ShapeClass) -> ref.PagedBatch:
    """A batch of the class's kind: a few ms per call at head dim 128 (prefill tiles big
    enough that per-call overheads do not flatter either side), except ``prefill_long``:
    ~80 ms per call at head dim 128, ~1 s for its whole first-use calibration (~3.5 s at head
    dim 256 on AVX2), paid once per machine and kernel build (the decision is cached)."""
    if cls.kind == "decode":  # 4 groups x 8 members, prefix 192, own 32-95 keys
        seqs = tuple(ref.SeqSpec(1, 32 + 9 * i, group=g) for g in range(4) for i in range(8))
        prefixes: tuple[int, ...] = (192,) * 4
    elif cls.kind == "prefix":  # 12 members x 32 new tokens over a 320-token prefix
        seqs = tuple(ref.SeqSpec(32, 32, group=0) for _ in range(12))
        prefixes = (320,)
    elif cls.kind == "prefill_long":  # a 2048-token causal chunk (the default chunk size)
        seqs, prefixes = (ref.SeqSpec(2048, 2048),), ()
    else:  # one 640-token causal chunk
        seqs, prefixes = (ref.SeqSpec(640, 640),), ()
    spec = ref.BatchSpec(
        seqs,
        prefixes,
        num_q_heads=cls.gqa * cls.kv_heads,
        num_kv_heads=cls.kv_heads,
        head_dim=cls.head_dim,
        block_size=cls.block_size,
        dtype=getattr(torch, cls.dtype),
    )
    return ref.build_batch(spec, seed=0)


def measure(
    cls: ShapeClass, kernel: Callable[..., torch.Tensor], fallback: Callable[..., torch.Tensor]
) -> Decision:
    """One-thread CPU ms of ``kernel`` and ``fallback`` (``attend``-like callables) over
    ``REPS`` alternating calls on the class's synthetic batch: the fastest of each, and the
    kernel's pick from the median of the calls' paired ratios (see the module docstring)."""
    b = synthetic_batch(cls)
    args = (b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel takes its thread count from torch's
    try:
        k_s, t_s = alternated_times((kernel, fallback), args, REPS, clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    return paired_decision(k_s, t_s, TORCH_MARGIN)


def alternated_times(
    fns: Sequence[Callable[..., object]],
    args: tuple,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    before: Callable[[], object] | None = None,
) -> list[list[float]]:
    """Seconds (by ``clock``) of each timed call of each of ``fns(*args)``: one warm-up call
    each (per-batch work, caches), then ``repeats`` rounds of one call each, alternated, so a
    drift of the machine's speed reaches every side alike; ``before()`` runs untimed ahead
    of each timed call (a cache flush)."""
    for fn in fns:
        fn(*args)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            if before is not None:
                before()
            t = clock()
            fn(*args)
            ts.append(clock() - t)
    return times


def paired_decision(kernel_s: list[float], torch_s: list[float], margin: float) -> Decision:
    """The fastest call of each side, in ms, and the kernel's pick: the median of the calls'
    paired ratios (kernel / torch, from ``alternated_times``) at most ``margin``."""
    ratio = statistics.median(k / max(t, 1e-9) for k, t in zip(kernel_s, torch_s, strict=True))
    return Decision(ratio <= margin, min(kernel_s) * 1e3, min(torch_s) * 1e3)


class Calibration:
    """Decisions per shape class for one kernel library, cached in ``<stem>.calibration.json``
    beside it (in ``cache_dir()``), shared by every backend of the process."""

    def __init__(self, library: Path) -> None:
        self.path = cache_dir() / f"{library.stem}.calibration.json"
        self._decisions: dict[str, Decision] | None = None

    def _read(self) -> dict[str, Decision]:
        try:
            raw = json.loads(self.path.read_text())
            if raw.get("torch") != torch.__version__ or raw.get("cpu") != cpu_model():
                return {}
            return {k: Decision(**v) for k, v in raw["classes"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def cached(self, cls: C) -> Decision | None:
        """The decision already made for ``cls`` (this process or the cache file), if any."""
        if self._decisions is None:
            self._decisions = {} if mode() == "fresh" else self._read()
        return self._decisions.get(cls.key)

    def decide(self, cls: C, run: Callable[[C], Decision]) -> Decision:
        """The cached decision for ``cls``, else ``run(cls)``, stored."""
        fresh = mode() == "fresh"
        if self._decisions is None:
            self._decisions = {} if fresh else self._read()
        if cls.key in self._decisions:
            return self._decisions[cls.key]
        t0 = time.perf_counter()
        d = run(cls)
        add_calibration(time.perf_counter() - t0)
        log.info("calibration %s: kernel %.2f ms, torch %.2f ms", cls.key,
                 d.kernel_ms, d.torch_ms)  # fmt: skip
        self._decisions[cls.key] = d
        merged = {**({} if fresh else self._read()), **self._decisions}  # other processes'
        doc = {
            "cpu": cpu_model(),
            "torch": torch.__version__,
            "classes": {k: v.__dict__ for k, v in sorted(merged.items())},
        }
        try:
            write_json_atomic(doc, self.path)
        except OSError as e:
            log.warning("could not cache the attention calibration at %s: %s", self.path, e)
        return d


_CALIBRATIONS: dict[Path, Calibration] = {}


def calibration_for(library: Path) -> Calibration:
    key = cache_dir() / library.name
    if key not in _CALIBRATIONS:
        _CALIBRATIONS[key] = Calibration(library)
    return _CALIBRATIONS[key]
