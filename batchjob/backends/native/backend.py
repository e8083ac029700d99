"""The native engine behind the ``Backend`` interface: load the model, run the plan."""

from __future__ import annotations

import torch

from batchjob.backends.base import BackendRun, Detokenize, OnFinish, OnIteration
from batchjob.backends.native.engine import Engine, EngineOptions
from batchjob.backends.native.models.loader import load_model
from batchjob.backends.native.sampling import SamplingParams
from batchjob.config import JobConfig
from batchjob.errors import ConfigError
from batchjob.plan.plan import Plan
from batchjob.prompts import TokenizedPrompts


def engine_options(job: JobConfig) -> EngineOptions:
    return EngineOptions(
        policy=job.scheduler.policy,
        chunk_size=job.scheduler.chunk_size,
        kv_threshold=job.scheduler.kv_threshold,
        max_num_seqs=job.scheduler.max_num_seqs,
        block_size=job.engine.block_size,
        kv_cache_bytes=job.engine.kv_cache_bytes,
        gpu_memory_fraction=job.engine.gpu_memory_fraction,
    )


def sampling_params(job: JobConfig) -> SamplingParams:
    s = job.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed,
        max_tokens=s.max_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
    )


class NativeBackend:
    """batchjob's own engine: paged KV, BatchLLM scheduler, prefix-shared attention."""

    name = "native"

    def __init__(self, job: JobConfig, detokenize: Detokenize) -> None:
        if job.engine.threads:
            torch.set_num_threads(job.engine.threads)
        self.job = job
        self.detokenize = detokenize
        model, self.info = load_model(
            job.model.path,
            dtype=job.model.dtype,
            device=job.model.device,
            attention=job.engine.attention,
        )
        self.device = str(self.info.device)
        try:
            self.engine = Engine(model, self.info, engine_options(job))
        except ValueError as e:
            raise ConfigError(f"engine.kv_cache_bytes: {e}") from None

    def check_fits(self, prompts: TokenizedPrompts, plan: Plan) -> None:
        try:
            self.engine.check_fits(prompts, plan)
        except ValueError as e:
            raise ConfigError(f"engine.kv_cache_bytes: {e}") from None

    def run(
        self,
        prompts: TokenizedPrompts,
        plan: Plan,
        on_finish: OnFinish,
        on_iteration: OnIteration | None = None,
    ) -> BackendRun:
        r = self.engine.run(
            prompts,
            plan,
            sampling_params(self.job),
            on_finish,
            detokenize=self.detokenize,
            on_iteration=on_iteration,
        )
        per_block = r.block_size * r.kv_bytes_per_token
        return BackendRun(
            iterations=r.iterations,
            computed_prefill_tokens=r.scheduler.prefill_tokens,
            recomputed_tokens=r.scheduler.recomputed_tokens,
            preemptions=r.scheduler.preemptions,
            peak_kv_bytes=r.scheduler.peak_blocks * per_block,
            kv_budget_bytes=r.num_blocks * per_block,
            wall_s=r.wall_s,
        )

    def close(self) -> None:
        del self.engine
