"""The native engine behind the ``Backend`` interface: load the model, run the plan.

The job's sections go down as they are (``cfg.scheduler``, ``cfg.engine``, ``cfg.sampling``):
``load_job`` already checked every value. What only the machine can tell (the KV budget in
blocks of this model, the attention backend on this device) fails here, as a ``ConfigError``
naming the key, before the plan runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from batchjob.backends.base import (
    Backend,
    BackendConfig,
    BackendRun,
    Detokenize,
    OnFinish,
    OnIteration,
    RunSink,
)
from batchjob.backends.native.embedding import EmbeddingPooler
from batchjob.backends.native.engine import Engine
from batchjob.backends.native.models.llama import LlamaForCausalLM
from batchjob.backends.native.models.loader import load_model
from batchjob.backends.native.models.lora import attach_lora
from batchjob.backends.native.structured import GrammarConstraint
from batchjob.backends.reasoning import reasoning_markers
from batchjob.backends.scoring import RowScores, row_tries
from batchjob.errors import ConfigError
from batchjob.inputs.row_guides import row_guides
from batchjob.model.info import ModelInfo
from batchjob.model.pooling import pooling_spec
from batchjob.plan.plan import Plan
from batchjob.tokenize.bad_words import bad_words_of
from batchjob.tokenize.prompts import TokenizedPrompts


def open_reasoning(
    parser: str | None, folder, prompts: TokenizedPrompts
) -> tuple[int, list[int]] | None:
    """``output.reasoning_parser``: (the ``</think>`` id, the prompt positions whose output
    starts inside its reasoning) for ``GrammarConstraint``; None without a parser."""
    if parser is None:
        return None
    from tokenizers import Tokenizer

    markers = reasoning_markers(parser, Tokenizer.from_file(str(Path(folder) / "tokenizer.json")))
    return markers.end_id, np.flatnonzero(
        markers.open_after(prompts.tokens, prompts.offsets)
    ).tolist()


def check_device(device: str) -> None:
    """``model.device`` names a CUDA device this machine has (``load_job`` checked the form)."""
    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(device.partition(":")[2] or 0) >= count:
        raise ConfigError(f"model.device: {device!r} is not available ({count} CUDA devices here)")


class NativeBackend(Backend):
    """batchjob's own engine: paged KV, BatchLLM scheduler, prefix-shared attention."""

    name = "native"

    def __init__(
        self, cfg: BackendConfig, detokenize: Detokenize, info: ModelInfo | None = None
    ) -> None:
        check_device(cfg.model.device)
        if cfg.engine.threads:
            torch.set_num_threads(cfg.engine.threads)
        self.cfg = cfg
        self.detokenize = detokenize
        source = info or cfg.model.path  # the job's ModelInfo, read once by load_prompts
        if source is None:
            raise ConfigError("model.path: required to run the native backend")
        model, self.info = load_model(
            source,
            dtype=cfg.model.dtype,
            device=cfg.model.device,
            attention=cfg.engine.attention,
            linear=cfg.engine.linear,
        )
        self.device = str(self.info.device)
        adapters = tuple(cfg.model.adapters.items())  # index i: TokenizedPrompts.adapter i
        lora = attach_lora(model, adapters) if adapters else None
        words = cfg.sampling.bad_words  # as token ids, with the model's tokenizer
        self.bad_words = bad_words_of(cfg.model.tokenizer or self.info.path, words)
        try:
            self.engine = Engine(model, self.info, cfg.scheduler, cfg.engine, lora=lora)
        except ValueError as e:
            raise ConfigError(f"engine.kv_cache_bytes: {e}") from None

    def check_fits(self, prompts: TokenizedPrompts, plan: Plan) -> None:
        try:
            self.engine.check_fits(prompts, plan)
        except ValueError as e:
            raise ConfigError(f"engine.kv_cache_bytes: {e}") from None

    def rows_over_budget(self, prompts: TokenizedPrompts, plan: Plan) -> np.ndarray:
        """Blocks of the engine's KV layout each request needs alone (its group prefix + own
        prompt + max_tokens) over the blocks the cache holds."""
        return np.asarray(self.engine.rows_over_budget(prompts, plan), dtype=bool)

    def run(self, prompts: TokenizedPrompts, plan: Plan, sink: RunSink) -> BackendRun:
        on_finish, on_iteration = sink.on_finish, sink.on_iteration
        if self.cfg.model.task == "embed":
            return self._embed(prompts, plan, on_finish, on_iteration)
        if prompts.settings is not None and prompts.settings.labels is not None:
            return self._score(prompts, plan, on_finish, on_iteration)
        constraint = None
        guides = row_guides(self.cfg.sampling, prompts)  # per row, or the job's
        if guides is not None:
            folder = self.cfg.model.tokenizer or self.info.path
            constraint = GrammarConstraint(
                folder,
                guides,
                self.info.vocab_size,
                self.info.eos_token_ids,
                self.cfg.sampling.stop_token_ids,
                reasoning=open_reasoning(self.cfg.reasoning_parser, folder, prompts),
            )
        r = self.engine.run(
            prompts,
            plan,
            self.cfg.sampling,
            on_finish,
            detokenize=self.detokenize,
            on_iteration=on_iteration,
            constraint=constraint,
            bad_words=self.bad_words,
        )
        return self._backend_run(r)

    def _score(
        self,
        prompts: TokenizedPrompts,
        plan: Plan,
        on_finish: OnFinish,
        on_iteration: OnIteration | None,
    ) -> BackendRun:
        """Scoring mode (``backends.scoring``): one request per row on the input's own plan;
        multi-token labels are teacher-forced after the prompt on the row's own sequence
        (``Engine.score``), so the plan's sharing across rows holds for them too.
        ``prompts.max_tokens`` is each row's longest label (``load_prompts``)."""
        tries, labels = row_tries(prompts)
        scores = RowScores(tries, labels, prompts.row_ids, on_finish)
        r = self.engine.score(
            prompts, plan, [t.steps for t in tries], scores, on_iteration=on_iteration
        )
        return self._backend_run(r)

    def _embed(
        self,
        prompts: TokenizedPrompts,
        plan: Plan,
        on_finish: OnFinish,
        on_iteration: OnIteration | None,
    ) -> BackendRun:
        """Embedding mode (``native.embedding``): the plan's prefills, pooled per row."""
        spec = pooling_spec(self.cfg.model, self.info.path, self.info.config.hidden_size)
        if spec.method != "last" and self.cfg.scheduler.policy != "batchllm":
            raise ConfigError(
                f"scheduler.policy: {spec.method} pooling needs every prompt token's hidden "
                f"state, and {self.cfg.scheduler.policy!r} serves cached prompt blocks without "
                "them; use batchllm (its groups compute a shared prefix once and reuse it)"
            )
        model = self.engine.model
        if not isinstance(model, LlamaForCausalLM):
            raise TypeError(f"embeddings need the native Llama-family model, not {type(model)}")
        pooler = EmbeddingPooler(
            spec, model.norm, prompts, plan, on_finish, self.info.config.hidden_size
        )
        return self._backend_run(self.engine.embed(prompts, plan, pooler, on_iteration))

    def _backend_run(self, r) -> BackendRun:
        per_block = r.block_size * r.kv_bytes_per_token
        return BackendRun(
            iterations=r.iterations,
            computed_prefill_tokens=r.scheduler.prefill_tokens,
            recomputed_tokens=r.scheduler.recomputed_tokens,
            preemptions=r.scheduler.preemptions,
            peak_kv_bytes=r.scheduler.peak_blocks * per_block,
            kv_budget_bytes=r.num_blocks * per_block,
            wall_s=r.wall_s,
            calibration_s=r.calibration_s,
        )

    def close(self) -> None:
        del self.engine
