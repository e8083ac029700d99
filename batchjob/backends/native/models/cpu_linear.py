"""Linear layers on the CPU: kernels/cpu/linear.c over weights packed once.

A decode step multiplies tens of rows by every weight matrix. torch's sgemm (MKL) packs the
weight on every call and runs such shapes far below its large-matrix speed, worse still with
the weights cold after attention streamed the KV cache (an AVX2 EPYC: 1.3-4x slower than the
packed kernel at 1-128 rows, docs/kernels.md "CPU linear layers"). On some
CPUs the packed kernel also beats MKL on prefill chunks of 512-2048 rows (an AVX-512 EPYC,
where MKL's large sgemm reached ~160 GFLOP/s of ~220), so the buckets run up to the default
chunk size and the calibration decides each.

``use_cpu_linear(model)`` swaps each float32 ``nn.Linear`` of a CPU model (and the logits
projection) for a ``PackedLinear``: the weight packed into the kernel's panels and, where this
torch build has oneDNN, into oneDNN's blocked layout too (``onednn_ops``: what vLLM's
``onednn_mm`` does), beside the original. The "torch side" of a layer is oneDNN's product on
its packed copy (``F.linear`` without one): it beats ``F.linear`` at every row count and the
kernel from a few hundred rows up (an AVX-512 EPYC, float32: 1.1-1.8x over the kernel at
256-2,048 rows, 2x over ``F.linear``; bench_cpu_linear.py). Per layer shape and row bucket
(``BUCKETS``; above the last, always the torch side) a calibration times the kernel against
the torch side (``measure``: alternated calls, median of paired ratios, cached with
attention's in the kernel library's calibration file) and the kernel takes the bucket only if
it is faster, so a layer never runs slower than torch's own. A layer whose buckets all go to
the torch side frees its kernel copy after calibration. Calibration runs at load
(``calibrate_at_load``), never inside the engine loop: cached classes are read, new ones
measured smallest bucket first within ``CALIB_BUDGET_S``; what the budget leaves unmeasured
takes the kernel up to ``RULE_ROWS`` rows (where it beat torch's sgemm on the CPUs in
docs/kernels.md) and is measured by a later load. Wide layers are calibrated on their first
``CALIB_COLS`` output columns (the kernel's work is per column panel; the logits projection
of a 150k vocabulary would otherwise take seconds a call).

Memory: each layer keeps oneDNN's copy and the kernel's where a bucket picks it; its plain
weight is released once it is packed (after calibration for the one layer per shape that
calibration measures), so a load peaks near two copies of the weights. Where those would
take more than ``packed_weights.MAX_MEMORY_SHARE`` of the memory available at load, one copy
is made (oneDNN's, else the kernel's), and none (``F.linear``) where even that would not fit.
``engine.linear = "torch"`` turns it off; ``$BATCHJOB_CPU_CALIBRATE`` applies as for attention.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from batchjob.backends.native.attention import calibrate as calib
from batchjob.backends.native.models.onednn_linear import use_onednn_linear
from batchjob.backends.native.models.onednn_ops import onednn_available, onednn_linear, onednn_pack
from batchjob.backends.native.models.packed_weights import linear_targets
from batchjob.kernels.cpu.build import CpuKernel, load_kernel

log = logging.getLogger(__name__)

BUCKETS = (16, 64, 128, 256, 512, 1024, 2048)  # batch rows: a batch takes the decision of
# the first bucket >= its rows (the last is scheduler.chunk_size's native default)
CALIB_COLS = 2048  # output columns a calibration measures at most
REPS, REPS_LARGE = 7, 3  # timed calls per side; LARGE above 256 rows (tens of ms each)
FLUSH_MIN, FLUSH_MAX = 32 << 20, 512 << 20  # bytes read before each timed call (flush_bytes)
CALIB_BUDGET_S = 8.0  # seconds of linear calibration at a model's load; the rest by RULE_ROWS
RULE_ROWS = 128  # a bucket left unmeasured: the kernel up to this many rows, torch above


@dataclass(frozen=True)
class LinearClass:
    """A calibration class: kernel build, threads, layer shape (columns as measured) and row
    bucket."""

    isa: str
    threads: int
    in_features: int
    out_features: int
    rows: int
    torch_side: str = "onednn"  # what the kernel is measured against: "onednn" or "torch"

    @property
    def key(self) -> str:
        cap = torch.backends.cpu.get_cpu_capability()
        shape = f"k{self.in_features}/n{self.out_features}/m{self.rows}"
        return f"linear/{self.isa}/{self.torch_side}-{cap}/t{self.threads}/{shape}"


def _bucket(rows: int) -> int | None:
    return next((b for b in BUCKETS if rows <= b), None)


class PackedLinear(nn.Module):
    """``F.linear(x, weight, bias)``; float32 2-D inputs of up to ``BUCKETS[-1]`` rows (inner
    stride 1, any row stride) go to the C kernel where the calibration picked it for their
    bucket, the rest to the torch side (oneDNN on its packed copy when ``onednn``)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: CpuKernel,
        calibrate: bool,
        onednn: bool = False,
    ) -> None:
        super().__init__()
        self.weight: torch.Tensor | None = weight  # shared with the module this replaces
        self.bias = bias
        self.kernel, self.calibrate = kernel, calibrate
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        self.packed: torch.Tensor | None = pack(weight, kernel)
        self.onednn = onednn_pack(weight) if onednn else None
        self._picks: dict[int, bool] = {}  # bucket -> the kernel takes it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        b = _bucket(rows) if rows else None
        if b is not None and x.dtype == torch.float32 and x.stride(1) == 1 and self._pick(b):
            return self.kernel_forward(x)
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn is not None and x.dim() >= 2 and x.dtype == torch.float32:
            if not x.numel():
                return x.new_empty(*x.shape[:-1], self.out_features)
            return onednn_linear(x, self.onednn, self.bias, self.out_features)
        assert self.weight is not None, "float32 inputs only: the plain weight was released"
        return F.linear(x, self.weight, self.bias)

    def release_plain_weight(self) -> bool:
        """Drop this module's reference to the plain weight once oneDNN's copy serves every
        float32 batch the kernel does not (after calibration, which reads it; a weight shared
        with the embedding stays alive there): returns whether it did."""
        if self.onednn is None or self.weight is None:
            return False
        self.weight = None
        return True

    def drop_unused_kernel_copy(self) -> bool:
        """Free the kernel's packed copy when no bucket picks the kernel (after calibration,
        with a torch side that runs every batch as fast): returns whether it did."""
        if self.onednn is None or self.packed is None:
            return False
        if len(self._picks) < len(BUCKETS) or any(self._picks.values()):
            return False
        self.packed = None
        return True

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        m, n, k = x.shape[0], self.out_features, self.in_features
        assert self.packed is not None, "the kernel's copy was dropped: no bucket picks it"
        y = torch.empty(m, n, dtype=torch.float32)
        bias = self.bias.data_ptr() if self.bias is not None else None
        self.kernel.linear(x.data_ptr(), x.stride(0), self.packed.data_ptr(), bias,
                           y.data_ptr(), n, m, n, k, torch.get_num_threads())  # fmt: skip
        return y

    def _pick(self, bucket: int) -> bool:
        if bucket not in self._picks:
            self._picks[bucket] = self.packed is not None and (
                not self.calibrate or self._calibrated(bucket)
            )
        return self._picks[bucket]

    def linear_class(self, bucket: int) -> LinearClass:
        cols = min(self.out_features, CALIB_COLS)
        side = "onednn" if self.onednn is not None else "torch"
        threads = torch.get_num_threads()
        return LinearClass(self.kernel.isa, threads, self.in_features, cols, bucket, side)

    def _calibrated(self, bucket: int) -> bool:
        cal = calib.calibration_for(self.kernel.path)
        cls = self.linear_class(bucket)
        return cal.decide(cls, lambda c: measure(c, self, self.kernel)).use_kernel


def _measure_layer(layer: PackedLinear, cls: LinearClass) -> calib.Decision:
    return measure(cls, layer, layer.kernel)


def calibrate_at_load(layers: list[PackedLinear], budget_s: float = CALIB_BUDGET_S) -> int:
    """Every layer's decision for every bucket, made now: cached classes read, new ones
    measured (smallest bucket first, one layer per shape) while ``budget_s`` lasts, the rest
    by ``RULE_ROWS``. Returns how many classes were measured."""
    todo = [layer for layer in layers if layer.calibrate]
    if not todo:
        return 0
    cal = calib.calibration_for(todo[0].kernel.path)
    t0, measured = time.perf_counter(), 0
    by_class: dict[str, bool] = {}
    for bucket in BUCKETS:
        for layer in todo:
            cls = layer.linear_class(bucket)
            if cls.key not in by_class:
                d = cal.cached(cls)
                if d is None and time.perf_counter() - t0 < budget_s:
                    d = cal.decide(cls, functools.partial(_measure_layer, layer))
                    measured += 1
                by_class[cls.key] = d.use_kernel if d is not None else bucket <= RULE_ROWS
            layer._picks[bucket] = by_class[cls.key]
    if measured:
        log.info("linear layers: %d classes calibrated in %.1f s", measured,
                 time.perf_counter() - t0)  # fmt: skip
    return measured


def pack(weight: torch.Tensor, kernel: CpuKernel) -> torch.Tensor:
    """The kernel's panel layout of ``weight`` [N, K]: cdiv(N, NP) x K x NP floats."""
    n, k = weight.shape
    np_ = kernel.linear_panel_cols
    out = torch.empty((n + np_ - 1) // np_ * k * np_, dtype=torch.float32)
    w = weight.detach().contiguous()
    kernel.linear_pack(w.data_ptr(), out.data_ptr(), n, k)
    return out


def measure(cls: LinearClass, layer: PackedLinear, kernel: CpuKernel) -> calib.Decision:
    """Wall ms of the kernel and torch on ``cls.rows`` random rows against the layer's first
    ``cls.out_features`` output columns, with the engine's threads and cold caches, as in a
    decode step (alternated calls, fewer for the large buckets; a buffer larger than the
    last-level cache is read before each). Unlike attention's one-thread CPU-time
    calibration: how torch's sgemm splits a few-row product over threads is much of what
    the kernel gains."""
    assert layer.weight is not None, "calibrated before the plain weight is released"
    w = layer.weight.detach()[: cls.out_features].contiguous()
    b = layer.bias.detach()[: cls.out_features].contiguous() if layer.bias is not None else None
    part = PackedLinear(w, b, kernel, calibrate=False, onednn=layer.onednn is not None)
    x = torch.randn(cls.rows, cls.in_features, generator=torch.Generator().manual_seed(0))
    fns = (part.kernel_forward, part.forward_torch)
    flush = torch.ones(flush_bytes() // 4)
    reps = REPS if cls.rows <= 256 else REPS_LARGE
    k_s, t_s = calib.alternated_times(fns, (x,), reps, before=flush.sum)
    return calib.paired_decision(k_s, t_s, 1.0)


def flush_bytes() -> int:
    """Twice the last-level cache (sysfs), within [FLUSH_MIN, FLUSH_MAX]."""
    size = FLUSH_MAX // 2
    try:
        caches = Path("/sys/devices/system/cpu/cpu0/cache")
        last = max(caches.glob("index*"), key=lambda p: int((p / "level").read_text()))
        text = (last / "size").read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        size = int(text.rstrip("KMG")) * unit
    except (OSError, ValueError):
        pass
    return min(max(2 * size, FLUSH_MIN), FLUSH_MAX)


def use_cpu_linear(model: nn.Module, isa: str | None = None) -> int:
    """Swap ``model``'s float32 CPU ``nn.Linear`` modules (and its logits projection, through
    ``model.logits_linear``) for ``PackedLinear``; returns how many (0 when the kernel did not
    build, or the packed copies would not fit ``MAX_MEMORY_SHARE``)."""
    kernel = load_kernel(isa)
    onednn = onednn_available(torch.float32)
    copies = int(kernel is not None) + int(onednn)
    if copies == 0:
        return 0
    found = linear_targets(model, torch.float32, copies)
    if found is None and copies == 2:  # room for one copy at most: oneDNN's (see above)
        kernel, found = None, linear_targets(model, torch.float32)
    if found is None:
        return 0
    if kernel is None:
        return use_onednn_linear(model, torch.float32)
    targets, head_w = found.layers, found.head
    on = calib.mode() != "0"

    def packed_of(w: torch.Tensor, b: torch.Tensor | None) -> PackedLinear:
        assert kernel is not None
        return PackedLinear(w, b, kernel, on, onednn=onednn)

    # Each layer's plain weight goes as soon as the layer is packed, except the first of each
    # calibration shape (what calibrate_at_load measures): the load peaks near two copies.
    packed, measured_shapes, n_layers = [], set(), len(targets)
    while targets:  # popped: the list would keep each replaced nn.Linear (and weight) alive
        parent, name, child = targets.pop(0)
        layer = packed_of(child.weight, child.bias)
        setattr(parent, name, layer)
        del child
        shape = (layer.in_features, min(layer.out_features, CALIB_COLS))
        if shape in measured_shapes:
            layer.release_plain_weight()
        measured_shapes.add(shape)
        packed.append(layer)
    if head_w is not None:
        model.logits_linear = packed_of(head_w, None)
        packed.append(model.logits_linear)
    calibrate_at_load(packed)
    dropped = sum(layer.drop_unused_kernel_copy() for layer in packed)
    if dropped:
        log.info("linear layers: %d of %d run oneDNN at every row count", dropped, len(packed))
    for layer in packed[:n_layers]:  # not the logits projection's (the embedding's)
        layer.release_plain_weight()
    return len(packed)
