"""Which attention the vllm backend's decoder layers run on the CPU, decided by measurement.

batchjob's prefix-shared kernel (``prefix_attention``) reads a shared prefix once per group,
but per query-key pair it may be slower than vLLM's own CPU attention on some CPU classes
(vLLM's AMX kernel keeps V packed for its tiles in the cache; batchjob's packs it per span).
So, as the native engine calibrates its kernel against torch's attention, the backend times
both kernels once per class (vLLM version, kernel build, heads, KV heads, head dim, block
size, KV dtype) before vLLM starts, on synthetic steps of one layer (``job_mix.STEPS``): a
decode step (128 requests in 16 groups of 8 over a 1,024-token prefix, 64 own tokens each),
a prefill step (16 requests of 128 new tokens over one cached 512-token prefix), and the
same two with nothing shared. Each side runs on one thread, timed in that thread's CPU time,
calls alternated (``calibrate.alternated_times``). The step times are weighed by the job's
own mix (``job_mix.JobMix``: the plan's decode tokens over a decode step's 128 query tokens,
the prefill tokens vLLM's prefix cache leaves to compute over a prefill step's 2,048, each
split between the shared and the unshared step by how much of its KV reads the job's sharing
saves), so a prefill-heavy job follows the prefill steps' winner, a decode-heavy one the
decode steps', and a job that shares little the unshared steps'; without a plan, three
shared decode steps per shared prefill step (``WEIGHTS``). Only the kinds a job weighs are
measured. batchjob's kernel keeps the layers unless the job's estimate takes more than
``MARGIN`` times vLLM's. The measurements are cached with the native engine's calibrations
(``calibrate.Calibration``), so a class is measured once per machine (all four steps 3-4 s
at 0.1-0.5B shapes, 9-15 s at 1-8B, in float32 on an AVX2 Zen 3); ``$BATCHJOB_CPU_CALIBRATE``
applies as there (``0``: no measurement, the kernel everywhere it fits; ``fresh``: measure
again).

``BATCHJOB_VLLM_PREFIX_ATTENTION``: unset, the measured choice; ``1`` batchjob's kernel
without measuring; ``0`` vLLM's attention in every layer.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchjob.backends.native.attention import calibrate as calib
from batchjob.backends.native.attention.cpu import kernel_takes, run_units
from batchjob.backends.vllm import prefix_attention as pa
from batchjob.backends.vllm.job_mix import STEPS, WEIGHTS, JobMix
from batchjob.backends.vllm.prefix_groups import block_tables

log = logging.getLogger(__name__)

MARGIN = 1.05  # batchjob's / vLLM's weighted step times above which vLLM's attention is used
LAYERS = 4  # caches the timed calls cycle through: each as cold as a model's other layers
CACHE_BYTES = 256 << 20  # at most this much KV over those caches (fewer layers where larger:
# a layer's cache over the CPU's last-level cache is cold on its own)
REPS = 5


@dataclass(frozen=True)
class AttentionClass:
    """One layer's attention as the two kernels see it, and the step kind timed."""

    vllm: str  # vLLM's version: its kernel's speed is part of the class
    isa: str
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the KV cache's: float32 | bfloat16
    kind: str  # a key of job_mix.STEPS

    @property
    def key(self) -> str:
        return (
            f"vllm-attention/{self.vllm}/{self.isa}/h{self.heads}/kv{self.kv_heads}"
            f"/d{self.head_dim}/bs{self.block_size}/{self.dtype}/{self.kind}"
        )


@dataclass(frozen=True)
class Choice:
    """The layers' attention and the measurements behind it (ms of one layer's call, one
    thread; None where nothing was measured)."""

    kernel: bool  # batchjob's prefix-shared kernel; else vLLM's attention
    reason: str
    kernel_ms: float | None = None  # the steps' times weighed by the job's mix (or WEIGHTS)
    vllm_ms: float | None = None
    weights: dict[str, float] | None = None  # the steps of each kind weighed


def step_batch(
    groups: int, members: int, prefix: int, own: int, qlen: int, block_size: int
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A vLLM-style step of ``groups`` x ``members`` requests (``prefix_groups.block_tables``),
    the same blocks every time (a fixed generator)."""
    g = torch.Generator().manual_seed(0)
    return block_tables(groups, members, prefix, own, qlen, block_size, g)


def call_pair(
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    step: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor],
    layers: int = 1,
) -> tuple[Callable[[], None], Callable[[], None], int]:
    """Two callables running one layer's attention of ``step`` (``step_batch``'s, blocks of
    ``bs`` tokens): vLLM's ``cpu_attention_with_kv_cache`` on its cache layout, and
    batchjob's kernel on the same cache tensor in the native layout (the backend's forward
    without the module around it), each call on the next of ``layers`` caches (fewer where
    they would take more than ``CACHE_BYTES``); and the step's prefix groups."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    kn = pa.kernel()
    if kn is None:
        raise RuntimeError("no C kernel build")
    nblocks, table, seq, qsl = step
    r, t = len(seq), int(qsl[-1])
    bf16 = dtype == torch.bfloat16
    one = nblocks * hkv * bs * 2 * d * dtype.itemsize
    layers = max(1, min(layers, CACHE_BYTES // one))
    kvs = [torch.randn(nblocks, hkv, bs, 2 * d).to(dtype) for _ in range(layers)]
    halves = itertools.cycle([kv.view(nblocks, hkv, 2 * bs, d).chunk(2, dim=2) for kv in kvs])
    natives = itertools.cycle([pa.native_cache(kv) for kv in kvs])
    q = torch.randn(t, hq, d).to(dtype)
    out = torch.empty(t, hq, d, dtype=dtype)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=r, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=seq,
        dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa=_get_attn_isa(dtype, bs, d), enable_kv_split=False,
    )  # fmt: skip

    def vllm() -> None:
        key_cache, value_cache = next(halves)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=seq, scale=d**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
            scheduler_metadata=meta, s_aux=None,
        )  # fmt: skip

    work = pa.step_work(kn, table.numpy(), seq.numpy(), qsl.numpy(), bs, hq, hkv, kv_bf16=bf16)
    scratch = (torch.empty(t, hq, d), torch.empty(2, t, hq))

    def ours() -> None:
        run_units(
            kn, q, *next(natives), work.units, work.blocks, work.has_prefix, work.threads,
            bf16, d**-0.5, None if bf16 else out, work.batch.token_order, scratch,
            out if bf16 else None,
        )  # fmt: skip

    return vllm, ours, work.batch.meta.num_groups


def measure(cls: AttentionClass) -> calib.Decision:
    """One-thread CPU ms of batchjob's kernel and vLLM's attention on the class's step, calls
    alternated; ``torch_ms`` holds vLLM's (the calibration file's name for the other side)."""
    step = step_batch(*STEPS[cls.kind], cls.block_size)
    dtype = getattr(torch, cls.dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both kernels take their thread count from it
    try:
        vllm, ours, _ = call_pair(
            cls.heads, cls.kv_heads, cls.head_dim, cls.block_size, dtype, step, LAYERS
        )
        k_s, v_s = calib.alternated_times((ours, vllm), (), REPS, clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    return calib.paired_decision(k_s, v_s, MARGIN)


def choose(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    mix: JobMix | None = None,
) -> Choice:
    """The decoder layers' attention for this model on this CPU and the job ``mix`` (the
    module doc): a ``Choice`` the backend passes to vLLM's worker through
    ``prefix_attention.ENV_SWITCH``."""
    switch = os.environ.get(pa.ENV_SWITCH, "").strip()
    if switch == "0":
        return Choice(False, f"{pa.ENV_SWITCH}=0")
    kn = pa.kernel()
    if kn is None:
        return Choice(False, "no C kernel build here")
    if dtype not in ("float32", "bfloat16") or not kernel_takes(
        kn, heads, kv_heads, head_dim, block_size
    ):
        return Choice(False, "a shape or dtype the kernel does not take")
    if switch == "1":
        return Choice(True, f"{pa.ENV_SWITCH}=1")
    if calib.mode() == "0":
        return Choice(True, f"{calib.ENV}=0 (no measurement)")
    import vllm

    cal = calib.calibration_for(kn.path)
    w = mix.weights() if mix is not None else dict(WEIGHTS)
    ms = {}
    try:
        for kind in (k for k in STEPS if w[k] > 0):
            cls = AttentionClass(
                vllm.__version__, kn.isa, heads, kv_heads, head_dim, block_size, dtype, kind
            )
            ms[kind] = cal.decide(cls, measure)
    except Exception as e:  # a vLLM whose CPU attention ops differ: the kernel, as before
        log.warning("vllm backend attention: not measured (%s); batchjob's kernel", e)
        return Choice(True, f"not measured: {e}")
    k = sum(w[kind] * d.kernel_ms for kind, d in ms.items())
    v = sum(w[kind] * d.torch_ms for kind, d in ms.items())
    detail = ", ".join(
        f"{kind} {d.kernel_ms:.2f} vs {d.torch_ms:.2f} ms x {w[kind]:.3g}" for kind, d in ms.items()
    )
    use = k <= MARGIN * v
    choice = Choice(use, f"measured one layer's steps: batchjob vs vLLM {detail}", k, v, w)
    log.info(
        "vllm backend attention: %s (%s)", "batchjob's kernel" if use else "vLLM's", choice.reason
    )
    return choice
