"""Prefix-shared attention inside vLLM on the CPU: batchjob's C kernel on vLLM's KV cache.

vLLM's CPU attention reads a shared document's KV once per request; on long shared prefixes
that is most of a decode step. This backend subclasses vLLM's ``CPUAttentionBackend`` and is
registered in its place through vLLM's public registry (``register_backend``) in the worker
process, by ``prefix_attention_worker`` (the ``worker_extension_cls`` that ``engine_args``
names, which vLLM imports before it builds the model). vLLM stays unpatched: its cache
tensor, block tables, prefix cache and metadata are its own.

A block is opaque to vLLM's scheduler, so the layers this backend takes keep their blocks in
the native engine's layout: [2, BS, Hkv, D] per block (K rows, then V rows, each row all KV
heads), written by ``do_kv_cache_update`` (vLLM's kernel stores K transposed). Per step, the
metadata builder finds the requests sharing leading KV blocks (``prefix_groups``) and builds the
native kernel's work units once; every layer then runs ``batchjob_paged_attention_strided``
(kernels/cpu/paged_attention.c) on the cache in place: each group's prefix read once per group,
as on the native engine. Layers the kernel does not take (sliding windows, ALiBi, soft caps,
sinks, fp8 or fp16 caches, head dims not a multiple of the build's vector width, encoder
attention, no C compiler) keep vLLM's layout and kernel throughout. bf16 caches on an AMX CPU
take the kernel too, its key-major tiles one KV head a unit (``whole_tiles``): the units its AMX
path runs. ``BATCHJOB_VLLM_PREFIX_ATTENTION=0`` turns the backend off (vLLM's attention in every
layer): the driver sets it for the worker where its measurement per class found vLLM's
attention faster on this CPU (``attention_choice``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_interface import AttentionSpec

from batchjob.backends.native.attention.cpu import (
    DST,
    KV_DTYPES,
    MAX_WHOLE_ROWS,
    build_units,
    kernel_takes,
    kv_rows_fit,
    run_units,
    tile_tokens,
    whole_tiles,
)
from batchjob.backends.vllm.prefix_groups import NativeBatch, native_metadata
from batchjob.kernels.cpu.build import CpuKernel, load_kernel

logger = init_logger(__name__)
ENV_SWITCH = "BATCHJOB_VLLM_PREFIX_ATTENTION"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


_KERNEL: list[CpuKernel | None] = []
# this worker's counts, for the driver (prefix_attention_worker.PrefixAttentionWorker)
STATS = dict(steps=0, kernel_steps=0, grouped_steps=0, groups=0, grouped_requests=0)
STATS["saved_kv_reads"] = 0  # KV tokens a layer did not read: (members - 1) x prefix, summed


def kernel() -> CpuKernel | None:
    """The native CPU kernel build for this CPU (built on first use), or None."""
    if not _KERNEL:
        _KERNEL.append(load_kernel() if enabled() else None)
    return _KERNEL[0]


@dataclass
class _Work:
    """One step's kernel work, shared by every layer."""

    batch: NativeBatch
    units: np.ndarray
    blocks: np.ndarray
    has_prefix: bool
    threads: int
    # the kernel's pout and lse, made by the step's first layer and reused by the others
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class PrefixSharedMetadata(CPUAttentionMetadata):
    work: _Work | None = None


class PrefixSharedMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata, plus the native kernel's work units for the step."""

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PrefixSharedMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        meta = PrefixSharedMetadata(**vars(base))
        kn = kernel()
        cm = common_attn_metadata
        STATS["steps"] += 1
        if (
            kn is None
            or meta.causal is not True
            or meta.dynamic_causal is not None
            or self.window_size != -1
            or self.is_cross_attention
            or self.is_encoder_only_attention
            or not kernel_takes(
                kn, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size
            )
        ):
            return meta
        r = cm.num_reqs
        meta.work = step_work(
            kn,
            cm.block_table_tensor[:r].cpu().numpy(),
            cm.seq_lens[:r].cpu().numpy(),
            cm.query_start_loc_cpu[: r + 1].numpy(),
            self.block_size,
            self.num_heads,
            self.num_kv_heads,
            kv_bf16=isinstance(spec := self.kv_cache_spec, AttentionSpec)
            and spec.dtype == torch.bfloat16,
        )
        return meta


def step_work(
    kn: CpuKernel,
    table: np.ndarray,
    seq_lens: np.ndarray,
    query_start: np.ndarray,
    block_size: int,
    heads: int,
    kv_heads: int,
    *,
    kv_bf16: bool,
) -> _Work:
    """The kernel's work for one step of vLLM's batch (block tables, sequence lengths, query
    offsets; ``kv_bf16``: the cache is bfloat16), built once and run by every layer. A
    request whose query rows (tokens x query heads per KV head) fill a whole tile joins no
    prefix group: its own tiles read the prefix as often as a group's would, and splitting its
    attention in two partials merged after only adds work (natural-qa and 200/2000 prefill
    steps 7-20% faster, 8/2 and 8/8 x 128)."""
    max_group_q = tile_tokens(kn.max_rows, heads, kv_heads)
    batch = native_metadata(table, seq_lens, query_start, block_size, max_group_q)
    threads = torch.get_num_threads()
    whole = whole_tiles(kn, kv_bf16)
    units, blocks = build_units(
        batch.meta, heads, kv_heads, kn.max_rows, kn.lanes, threads, whole, MAX_WHOLE_ROWS
    )
    _count(batch)
    return _Work(batch, units, blocks, bool(units[:, DST].any()), threads)


def _count(batch: NativeBatch) -> None:
    m = batch.meta
    STATS["kernel_steps"] += 1
    if m.num_groups:
        group = m.seq_group.numpy()
        sizes = np.bincount(group[group >= 0], minlength=m.num_groups)
        STATS["grouped_steps"] += 1
        STATS["groups"] += m.num_groups
        STATS["grouped_requests"] += int(sizes.sum())
        STATS["saved_kv_reads"] += int(((sizes - 1) * m.prefix_len.numpy()).sum())


class PrefixSharedImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with decoder self-attention on the native kernel where it fits
    (decided once per layer, on its first call: the cache layout follows the choice)."""

    _native: bool | None = None

    def _uses_native(self, kv_cache: torch.Tensor) -> bool:
        if self._native is None:
            _, hkv, bs, two_d = kv_cache.shape
            kn = kernel()
            self._native = (
                kn is not None
                and self.attn_type == AttentionType.DECODER
                and self.alibi_slopes is None
                and self.sliding_window == -1
                and not self.logits_soft_cap
                and self.sinks is None
                and not self.is_fp8_kv_cache
                and kv_cache.dtype in KV_DTYPES
                and kv_cache.is_contiguous()
                and kernel_takes(kn, self.num_heads, hkv, two_d // 2, bs)
            )
            if self._native and kn is not None:
                logger.info_once("batchjob prefix-shared attention (CPU kernel, %s)", kn.isa)
        return self._native

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if not self._uses_native(kv_cache):
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # one call into C with plain attributes (no torch op first): in a run, each torch
        # op here costs 10-40 us, its state evicted by the layer's weights
        nb, hkv, bs, two_d = kv_cache.shape
        d = two_d // 2
        n = slot_mapping.shape[0]
        kn = kernel()
        fits = (
            key.shape[0] >= n
            and value.shape[0] >= n
            and slot_mapping.is_contiguous()
            and kv_rows_fit(key, value, slot_mapping, kv_cache.dtype, hkv, d)
        )
        elt = kv_cache.element_size()
        if not fits or kn is None or kn.write_kv(
            key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), kv_cache.data_ptr(),
            kv_cache.data_ptr() + bs * hkv * d * elt, slot_mapping.data_ptr(), n, nb * bs,
            hkv * d, elt, torch.get_num_threads(), bs,
        ) != 0:  # fmt: skip
            # the torch path (a slot out of range raises the index error here)
            kv = native_view(kv_cache)  # [blocks, 2, BS, Hkv, D]
            blk, pos = slot_mapping // bs, slot_mapping % bs
            kv[blk, 0, pos] = key[:n].to(kv.dtype)
            kv[blk, 1, pos] = value[:n].to(kv.dtype)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is None or not self._uses_native(kv_cache):
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )  # fmt: skip
        work = getattr(attn_metadata, "work", None)
        kn = kernel()
        if work is None or kn is None or output_scale is not None:
            raise RuntimeError("prefix-shared attention: a batch without kernel work units")
        t = attn_metadata.num_actual_tokens
        d = kv_cache.shape[3] // 2
        h = query.shape[1]
        q = query[:t]  # float32 or bf16 read in place by the kernel; other dtypes widened
        if q.dtype not in KV_DTYPES or q.stride(2) != 1 or q.stride(1) != d:
            q = q.to(torch.float32).contiguous()
        out3 = output[:t].view(t, h, d)
        direct = out3.dtype == torch.float32 and out3.is_contiguous()
        half = out3.dtype == torch.bfloat16 and out3.is_contiguous()  # the kernel rounds
        if work.scratch is None or work.scratch[0].shape != (t, h, d):
            pout = torch.empty(t, h, d, dtype=torch.float32)
            work.scratch = (pout, torch.empty(2, t, h, dtype=torch.float32))
        out = run_units(
            kn, q, *native_cache(kv_cache), work.units, work.blocks, work.has_prefix, work.threads,
            kv_cache.dtype == torch.bfloat16, self.scale, out3 if direct else None,
            work.batch.token_order, work.scratch, out3 if half else None,
        )  # fmt: skip
        if not (direct or half):
            out3.copy_(out.to(out3.dtype))
        return output


def native_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int, tuple[int, int, int]]:
    """vLLM's [blocks, Hkv, BS, 2 * D] cache tensor in the native layout (``native_view``) as
    ``run_units`` takes it: the K and V base pointers (a block's V rows follow its K rows),
    KV heads, block size and the (block, key row, KV head) strides in elements."""
    _, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    base = kv_cache.data_ptr()
    v_ptr = base + bs * hkv * d * kv_cache.element_size()
    return base, v_ptr, hkv, bs, (2 * bs * hkv * d, hkv * d, d)


def native_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's [blocks, Hkv, BS, 2 * D] cache tensor as the native layout [blocks, 2, BS, Hkv, D]
    (the same memory: only the layers this backend takes use it so)."""
    nb, hkv, bs, two_d = kv_cache.shape
    return kv_cache.view(nb, 2, bs, hkv, two_d // 2)


class PrefixSharedCpuBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with the prefix-shared kernel (see the module doc)."""

    @staticmethod
    def get_impl_cls() -> type[PrefixSharedImpl]:
        return PrefixSharedImpl

    @staticmethod
    def get_builder_cls() -> type[PrefixSharedMetadataBuilder]:
        return PrefixSharedMetadataBuilder


BACKEND_PATH = f"{__name__}.PrefixSharedCpuBackend"


def register() -> None:
    """Make vLLM's CPU attention this backend in this process (idempotent)."""
    if enabled():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
