"""The native engine's loop: schedule -> build batch -> forward -> sample -> update.

Knows nothing of Parquet: it takes ``TokenizedPrompts`` and a ``Plan``, and hands each
finished request to a callback as soon as it finishes (so results stream to disk). Its
settings are the job's ``SchedulerConfig``, ``EngineConfig`` and ``SamplingConfig`` as loaded
(and checked) by ``load_job``; what it derives from them and the machine is the ``KVLayout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from batchjob.backends.base import FinishedRequest, IterationRecord
from batchjob.backends.native.batch_builder import build_batch
from batchjob.backends.native.kv_cache import KVLayout
from batchjob.backends.native.sampling import check_stop, sample, truncate_at_stop
from batchjob.backends.native.scheduler.base import (
    check_kv_budget,
    kv_blocks_needed,
    request_prefix_len,
)
from batchjob.backends.native.scheduler.output import SchedulerStats
from batchjob.backends.native.scheduler.registry import make_scheduler
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig
from batchjob.model_info import ModelInfo
from batchjob.plan.plan import Plan
from batchjob.prompts import TokenizedPrompts

GiB = 1 << 30


@dataclass(frozen=True)
class EngineRun:
    """What a run did: per-iteration records and the scheduler's counters."""

    iterations: list[IterationRecord]
    scheduler: SchedulerStats
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    wall_s: float


def kv_budget_bytes(cfg: EngineConfig, device: torch.device) -> int:
    """KV cache size in bytes: explicit, or a fraction of what the GPU has free."""
    if cfg.kv_cache_bytes is not None:
        return cfg.kv_cache_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(int(free - (1 - cfg.gpu_memory_fraction) * total), 0)
    return 2 * GiB


class Engine:
    """Runs plans on one model; the KV cache is allocated once and reused across runs."""

    def __init__(
        self,
        model: torch.nn.Module,
        info: ModelInfo,
        scheduler: SchedulerConfig,
        engine: EngineConfig,
    ) -> None:
        self.model = model
        self.info = info
        self.scheduler_cfg = scheduler
        self.engine_cfg = engine
        # ValueError when the budget holds fewer than two blocks
        self.kv = KVLayout.from_budget(
            kv_budget_bytes(engine, info.torch_device), engine.block_size, info.kv_bytes_per_token
        )
        # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
        self.kv_cache = torch.zeros(
            info.kv_cache_shape(self.kv.num_blocks, self.kv.block_size),
            dtype=info.torch_dtype,
            device=info.torch_device,
        )

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    def check_fits(self, prompts: TokenizedPrompts, plan: Plan | None) -> None:
        """Raise ValueError naming the row if a request cannot fit in the KV budget."""
        batchllm = self.scheduler_cfg.policy == "batchllm"
        grouped = plan if batchllm else None  # baseline ignores groups
        check_kv_budget(self.kv, prompts, request_prefix_len(grouped, len(prompts)))

    def rows_over_budget(self, prompts: TokenizedPrompts, plan: Plan | None) -> np.ndarray:
        """bool [N]: requests that cannot fit the KV budget even alone."""
        grouped = plan if self.scheduler_cfg.policy == "batchllm" else None
        need = kv_blocks_needed(self.kv, prompts, request_prefix_len(grouped, len(prompts)))
        return need > self.kv.num_blocks

    @torch.inference_mode()
    def run(
        self,
        prompts: TokenizedPrompts,
        plan: Plan | None,
        sampling: SamplingConfig,
        on_finish: Callable[[FinishedRequest], None],
        detokenize: Callable[[list[int]], str] | None = None,
        on_iteration: Callable[[IterationRecord], None] | None = None,
    ) -> EngineRun:
        """Generate for every prompt; ``on_finish`` gets each request as it finishes.

        Per-row ``prompts.max_tokens`` override ``sampling.max_tokens``. Stop strings need
        ``detokenize`` (token ids -> text).
        """
        if sampling.stop and detokenize is None:
            raise ValueError("stop strings need a detokenize function")
        sched = make_scheduler(self.scheduler_cfg, self.kv, prompts, plan)
        row_params = _per_row_params(sampling, prompts.max_tokens)
        eos = self.info.eos_token_ids
        generated: dict[int, list[int]] = {}
        records: list[IterationRecord] = []
        bs = self.kv.block_size
        t_start = time.perf_counter()
        while sched.has_unfinished():
            t0 = time.perf_counter()
            out = sched.schedule()
            batch = build_batch(out, bs, self.info.torch_device)
            sampled: dict[int, int] = {}
            finished: set[int] = set()
            if batch.sample_seq_ids:
                logits = self.model(
                    batch.input_ids, batch.positions, self.kv_cache, batch.meta, batch.logits_index
                )
                ids = batch.sample_seq_ids
                params = [row_params(s) for s in ids]
                steps = [len(generated.get(s, ())) for s in ids]
                rows = [int(prompts.row_ids[s]) for s in ids]
                tokens = sample(logits, params, rows, steps).tolist()
                for seq, tok, p in zip(ids, tokens, params, strict=True):
                    toks = generated.setdefault(seq, [])
                    reason = check_stop(toks, tok, p, eos)
                    toks.append(tok)
                    sampled[seq] = tok
                    text = None
                    if p.stop and detokenize is not None:
                        text, stopped = truncate_at_stop(detokenize(toks), p.stop)
                        if stopped:
                            reason = "stop"
                        else:
                            text = None
                    if reason is not None:
                        finished.add(seq)
                        on_finish(
                            FinishedRequest(
                                position=seq,
                                row_id=int(prompts.row_ids[seq]),
                                token_ids=np.asarray(toks, dtype=np.int32),
                                finish_reason=reason,
                                text=text,
                            )
                        )
                        del generated[seq]
            elif out.chunks:
                # prefill-only iteration with nothing to sample: still run the forward
                self.model(
                    batch.input_ids, batch.positions, self.kv_cache, batch.meta, batch.logits_index
                )
            sched.update(out, sampled, finished)
            rec = IterationRecord(
                iteration=out.iteration,
                decode_tokens=out.num_decode_tokens,
                prefill_tokens=out.num_prefill_tokens,
                num_seqs=len(out.chunks),
                kv_blocks_used=out.kv_blocks_used,
                kv_bytes_used=out.kv_blocks_used * bs * self.info.kv_bytes_per_token,
                preempted=len(out.preempted),
                wall_s=time.perf_counter() - t0,
            )
            records.append(rec)
            if on_iteration is not None:
                on_iteration(rec)
        return EngineRun(
            iterations=records,
            scheduler=sched.stats,
            num_blocks=self.num_blocks,
            block_size=bs,
            kv_bytes_per_token=self.info.kv_bytes_per_token,
            wall_s=time.perf_counter() - t_start,
        )


def _per_row_params(
    base: SamplingConfig, max_tokens: np.ndarray
) -> Callable[[int], SamplingConfig]:
    """Row position -> its sampling settings: ``base`` with the row's max_tokens (cached per
    distinct value; the scheduler already refused a row limit below 1)."""
    cache: dict[int, SamplingConfig] = {}

    def get(pos: int) -> SamplingConfig:
        mt = int(max_tokens[pos])
        p = cache.get(mt)
        if p is None:
            p = cache[mt] = replace(base, max_tokens=mt)
        return p

    return get
