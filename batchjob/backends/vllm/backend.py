"""vLLM behind the ``Backend`` interface: the plan executed by vLLM's offline engine.

The engine starts in ``rows_over_budget`` or ``check_fits``, whichever is called first (its
``max_model_len`` defaults to the model's context capped by what the KV budget holds, so a
small budget still starts and a warm engine takes later, longer requests), with its engine
core in this process and the model in a worker process (started without importing the
caller's script again: ``spawn``). ``run`` submits requests group by group in plan order (Eq. 4),
whole groups at a time while fewer than ``window`` requests are in flight, steps the engine,
and hands each request to ``on_finish`` as soon as it finishes (results stream to disk);
the scheduler class (``scheduler.py``) records every step for ``on_iteration``. One engine
serves any number of ``run`` calls; the prefix cache is reset before each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from batchjob.backends.base import (
    Backend,
    BackendConfig,
    BackendRun,
    Detokenize,
    OnFinish,
    OnIteration,
    RunSink,
)
from batchjob.backends.scoring import LabelCombiner, expand
from batchjob.backends.vllm.embedding import run_embeddings, with_kwargs
from batchjob.backends.vllm.engine_args import (
    PREFIX_ATTENTION_WORKER,
    EngineSettings,
    drop_vllm_log,
    engine_settings,
    environment,
    route_vllm_log,
    vllm_log_file,
)
from batchjob.backends.vllm.job_mix import JobMix
from batchjob.backends.vllm.requests import OutputTracker, ScoreTracker, Submission, plan_order
from batchjob.backends.vllm.run_record import RunRecorder
from batchjob.backends.vllm.scheduler import scheduler_class_path
from batchjob.backends.vllm.spawn import main_module_hidden
from batchjob.errors import EXIT_RUNTIME, BatchJobError, ConfigError
from batchjob.model.info import ModelInfo, model_info_for
from batchjob.model.pooling import PoolingSpec, pooling_spec
from batchjob.plan.build import plan_job
from batchjob.plan.intmath import cdiv
from batchjob.plan.plan import Plan
from batchjob.tokenize.bad_words import bad_words_of
from batchjob.tokenize.prompts import TokenizedPrompts

if TYPE_CHECKING:  # imports vLLM: the backend imports it at start-up only
    from batchjob.backends.vllm.attention_choice import Choice


class VllmError(BatchJobError):
    """vLLM failed to start or to run (a runtime failure: retrying may help)."""

    exit_code = EXIT_RUNTIME


_VLLM_SEE_ABOVE = ", please check the stack trace above for the root cause"


def _log_hint() -> str:
    log = vllm_log_file()
    return f" (vLLM's log: {log}; -v shows it on the terminal)" if log.exists() else ""


def _key_for(message: str) -> str:
    """The job key a vLLM start-up error is most likely about."""
    m = message.lower()
    if "kv cache" in m or "memory" in m or "num_gpu_blocks" in m:
        return "engine.kv_cache_bytes"
    if "max_model_len" in m or "max model len" in m or "max seq len" in m:
        return "model.max_model_len"
    if "block_size" in m or "block size" in m:
        return "engine.block_size"
    if "max_num_batched_tokens" in m:
        return "scheduler.chunk_size"
    if "dtype" in m:
        return "model.dtype"
    return "engine.vllm"


class VllmBackend(Backend):
    """vLLM's engine running batchjob's plan (``scheduler.policy``: batchllm | baseline)."""

    name = "vllm"

    def __init__(self, cfg: BackendConfig, detokenize: Detokenize, model: ModelInfo | None = None):
        self.cfg = cfg
        self.detokenize = detokenize
        info = model or model_info_for(cfg.model, cfg.engine.backend)
        if info is None:
            raise ConfigError('model.path: required with engine.backend = "vllm"')
        self.model: ModelInfo = info
        self.device = "cpu"
        # vLLM objects, made at start-up (``_start_for``; vLLM is imported lazily): its
        # LLMEngine, and our scheduler subclass in its engine core (scheduler.py: bj_* members)
        self.engine: Any = None
        self.scheduler: Any = None
        self.window = 0
        self._runs = 0
        self.starts = 0  # engines started by this backend (a warm Generator: one)
        self.keep_log = False  # a failure named vLLM's log: close() leaves it
        # on the CPU: the decoder layers' attention and why (attention_choice), at start-up
        self.attention: Choice | None = None
        # model.task = "embed": vLLM's pooling runner with this pooling (``vllm.embedding``)
        self.pooling: PoolingSpec | None = None
        if cfg.model.task == "embed":
            self.pooling = pooling_spec(cfg.model, info.path, info.config.hidden_size)
        # fail on settings before any data is touched (vLLM itself starts in check_fits)
        engine_settings(cfg, self.model.dtype, 2)
        words = cfg.sampling.bad_words  # as token ids, with the model's tokenizer
        self.bad_words = bad_words_of(cfg.model.tokenizer or cfg.model.path, words)

    # --- start-up ---------------------------------------------------------------------
    def _start(
        self,
        s: EngineSettings,
        longest: int,
        longest_row: int,
        prompts: TokenizedPrompts,
        plan: Plan,
    ) -> None:
        log_config = s.env.get("VLLM_LOGGING_CONFIG_PATH")
        if log_config is not None:
            route_vllm_log(Path(log_config))
        if self.pooling is not None:
            s = with_kwargs(s, self.pooling)
        s = self._choose_attention(s, prompts, plan)
        with environment(s.env):
            self._start_engine(s, longest, longest_row)
        self.starts += 1
        self.device = "cpu" if s.on_cpu else "cuda:0"
        self.window = max(2 * self.engine.vllm_config.scheduler_config.max_num_seqs, 256)

    def _choose_attention(
        self, s: EngineSettings, prompts: TokenizedPrompts, plan: Plan
    ) -> EngineSettings:
        """On the CPU with batchjob's worker extension: batchjob's prefix-shared kernel or
        vLLM's attention in the decoder layers, measured per class and weighed by the job's
        mix of shared and unshared decode and prefill work (``JobMix.of`` its ``plan``;
        ``attention_choice``; a warm ``Generator`` keeps its first job's choice); vLLM's
        passes to the worker as ``BATCHJOB_VLLM_PREFIX_ATTENTION=0``."""
        if not s.on_cpu or s.kwargs.get("worker_extension_cls") != PREFIX_ATTENTION_WORKER:
            return s
        from batchjob.backends.vllm import attention_choice

        m = self.model
        block = int(s.kwargs.get("block_size") or 16)
        mix = JobMix.of(plan, prompts.lengths)  # only here: O(rows), on the CPU path alone
        self.attention = attention_choice.choose(
            m.num_heads, m.num_kv_heads, m.head_dim, block, m.dtype, mix
        )
        if self.attention.kernel:
            return s
        return dataclasses.replace(s, env={**s.env, attention_choice.pa.ENV_SWITCH: "0"})

    def _start_engine(self, s: EngineSettings, longest: int, longest_row: int) -> None:
        import vllm.envs as envs
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        if hasattr(envs.__getattr__, "cache_clear"):  # an earlier engine cached the env
            envs.__getattr__.cache_clear()
        hint = f" (the longest request, row_id {longest_row}, needs {longest} tokens)"
        try:
            config = EngineArgs(**s.kwargs).create_engine_config()
        except Exception as e:  # vLLM validates with ValueError, TypeError, pydantic errors
            msg = " ".join(str(e).split())
            raise ConfigError(f"{_key_for(msg)}: vLLM refused the settings: {msg}{hint}") from None
        sc = config.scheduler_config
        policy = self.cfg.scheduler.policy
        if self.pooling is not None:  # pooling requests: vLLM's own policy, recorded
            policy = "baseline"
        sc.scheduler_cls = scheduler_class_path(policy, bool(sc.async_scheduling))
        try:
            with main_module_hidden():  # a script without a __main__ guard: not run again
                self.engine = LLMEngine(
                    vllm_config=config,
                    executor_class=Executor.get_class(config),
                    log_stats=False,
                    multiprocess_mode=False,
                )
        except Exception as e:
            msg = " ".join(str(e).split())
            key = _key_for(msg)
            if key in ("engine.kv_cache_bytes", "engine.block_size"):
                raise ConfigError(f"{key}: vLLM could not start: {msg}{hint}") from None
            msg = msg.replace(_VLLM_SEE_ABOVE, "")  # the trace is in vLLM's log
            self.keep_log = True
            raise VllmError(f"vLLM failed to start: {msg}{_log_hint()}") from e
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        if self.cfg.scheduler.policy == "batchllm" and self.pooling is None:
            self.scheduler.bj_kv_threshold = self.cfg.scheduler.kv_threshold_for("vllm")

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    @property
    def num_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # null block

    @property
    def block_bytes(self) -> int:
        kv = self.scheduler.kv_cache_config
        return sum(t.size for t in kv.kv_cache_tensors) // max(kv.num_blocks, 1)

    def _check_budget(self, s: EngineSettings, tokens: int, row_id: int) -> None:
        """Before vLLM starts: an explicit KV budget that cannot hold the longest request."""
        budget = self.cfg.engine.kv_cache_bytes
        if budget is None:
            return
        # the block size vLLM will run (vLLM's GPU default, 16, where it chooses itself)
        bs = s.kwargs.get("block_size", 16)
        blocks = budget // (bs * self.model.kv_bytes_per_token)
        if cdiv(tokens, bs) > blocks:
            raise ConfigError(
                f"engine.kv_cache_bytes: {budget} bytes hold {blocks} KV blocks of {bs} tokens; "
                f"row_id {row_id} needs {cdiv(tokens, bs)} ({tokens} tokens)"
            )

    def _engine_len(self, longest: int) -> int:
        """The max_model_len vLLM starts with when the job sets none: the model's context,
        capped by what the KV budget holds (vLLM refuses to start a context its cache cannot
        hold), so later runs of the same engine (a warm ``Generator``) take longer requests
        without a restart; ``longest`` where the budget is known only once vLLM runs (a GPU's
        engine.gpu_memory_fraction)."""
        s = engine_settings(self.cfg, self.model.dtype, longest)
        budget = s.kwargs.get("kv_cache_memory_bytes")
        if budget is None:
            return longest
        bs = int(s.kwargs.get("block_size", 16))
        held = (int(budget) // (bs * self.model.kv_bytes_per_token) - 1) * bs  # a block spare
        return max(longest, min(self.model.max_model_len, held))

    def _start_for(self, longest: int, row_id: int, prompts: TokenizedPrompts, plan: Plan) -> None:
        """Start vLLM for requests of at least ``longest`` tokens (``_engine_len``) and the
        job of ``prompts`` and ``plan``."""
        s = engine_settings(self.cfg, self.model.dtype, self._engine_len(longest))
        self._check_budget(s, longest, row_id)
        self._start(s, longest, row_id, prompts, plan)

    def _over_before_start(self, need: np.ndarray) -> np.ndarray:
        """bool [N]: requests of ``need`` tokens over the KV blocks vLLM will have, as
        ``_check_budget`` counts them: ``kv_cache_memory_bytes`` (engine.kv_cache_bytes, or
        the CPU default) at the block size it will run. None over where vLLM sizes the cache
        itself at start-up (a GPU's engine.gpu_memory_fraction): known once it runs."""
        s = engine_settings(self.cfg, self.model.dtype, int(need.max()))
        budget = s.kwargs.get("kv_cache_memory_bytes")
        if budget is None:
            return np.zeros(len(need), dtype=bool)
        bs = int(s.kwargs.get("block_size", 16))
        blocks = int(budget) // (bs * self.model.kv_bytes_per_token)
        return np.asarray(cdiv(need, bs) > blocks, dtype=bool)

    def rows_over_budget(self, prompts: TokenizedPrompts, plan: Plan) -> np.ndarray:
        """Requests whose prompt + max_tokens need more of vLLM's KV blocks than its cache
        holds (its block size; its blocks less the null block), what ``check_fits`` refuses.
        Before vLLM runs, estimated from the budget it will start with
        (``_over_before_start``), and vLLM is started for the longest request that fits, so
        its max_model_len leaves the others out; the started engine's own count decides."""
        need = (prompts.lengths + prompts.max_tokens).astype(np.int64)
        if not len(need):
            return np.zeros(0, dtype=bool)
        over = np.zeros(len(need), dtype=bool)
        if self.engine is None:
            over = self._over_before_start(need)
            if over.all():
                return over  # nothing can run: check_fits raises, naming the row
            i = int(np.argmax(np.where(over, -1, need)))
            self._start_for(int(need[i]), int(prompts.row_ids[i]), prompts, plan)
        return over | np.asarray(cdiv(need, self.block_size) > self.num_blocks, dtype=bool)

    def check_fits(self, prompts: TokenizedPrompts, plan: Plan) -> None:
        if len(prompts) == 0:
            return
        need = prompts.lengths + prompts.max_tokens
        i = int(need.argmax())
        if self.engine is None:
            self._start_for(int(need[i]), int(prompts.row_ids[i]), prompts, plan)
        max_len = self.engine.vllm_config.model_config.max_model_len
        blocks = -(-int(need[i]) // self.block_size)
        problem = None
        if need[i] > max_len:
            problem = (
                f"model.max_model_len: row_id {int(prompts.row_ids[i])} needs {int(need[i])} "
                f"tokens (prompt + max_tokens), the engine's limit is {max_len}"
            )
        elif blocks > self.num_blocks:
            problem = (
                f"engine.kv_cache_bytes: row_id {int(prompts.row_ids[i])} needs {blocks} KV "
                f"blocks, the cache holds {self.num_blocks}"
            )
        if problem is not None:
            self.close()  # the caller closes only what runs
            raise ConfigError(problem)

    # --- running ----------------------------------------------------------------------
    def run(self, prompts: TokenizedPrompts, plan: Plan, sink: RunSink) -> BackendRun:
        if self.pooling is not None:
            self.check_fits(prompts, plan)
            self._runs += 1
            if not self.engine.reset_prefix_cache():
                raise VllmError("vLLM could not reset its prefix cache (requests still running)")
            return run_embeddings(
                self.engine, prompts, plan, self.pooling, sink, self.window, f"r{self._runs}",
                self.scheduler.bj, self.block_bytes, self.num_blocks,
            )  # fmt: skip
        if prompts.settings is not None and prompts.settings.labels is not None:
            return self._score(prompts, plan, sink)
        self.check_fits(prompts, plan)
        self._runs += 1
        sampling, eos = self.cfg.sampling, self.model.config.eos_token_ids
        tag = f"r{self._runs}"
        adapters = tuple(self.cfg.model.adapters.items())
        groups = plan_order(
            prompts,
            plan,
            sampling,
            eos,
            tag,
            seeded=self.device != "cpu",
            adapters=adapters,
            bad_words=self.bad_words,
        )
        tracker = OutputTracker(prompts, sampling, eos, self.detokenize, self.cfg.reasoning_parser)
        return self._execute(prompts, groups, tracker, sink.on_finish, sink.on_iteration)

    def _score(self, prompts: TokenizedPrompts, plan: Plan, sink: RunSink) -> BackendRun:
        """Scoring mode (``batchjob.backends.scoring``): one greedy step per label-trie node, each
        returning the log-probs of its child tokens (vLLM's ``logprob_token_ids``, raw
        log-softmax); the requests of a row share its prompt through vLLM's prefix cache.
        Single-token labels run the input's plan as is."""
        from vllm.sampling_params import MAX_LOGPROB_TOKEN_IDS

        req = expand(prompts)
        widest = max((len(t) for t in req.targets), default=0)
        if widest > MAX_LOGPROB_TOKEN_IDS:
            key = "input.labels_column" if self.cfg.labels_column else "sampling.labels"
            raise ConfigError(
                f"{key}: {widest} labels differ at the same token; the vLLM backend scores at "
                f"most {MAX_LOGPROB_TOKEN_IDS} (vLLM's logprob_token_ids limit)"
            )
        if not req.same_rows:
            plan = plan_job(req.prompts, self.cfg.scheduler)
        self.check_fits(req.prompts, plan)
        self._runs += 1
        combiner = LabelCombiner(req, prompts.row_ids, sink.on_finish)
        eos = self.model.config.eos_token_ids
        sampling = dataclasses.replace(self.cfg.sampling, stop=())  # FINAL_ONLY outputs
        groups = plan_order(
            req.prompts, plan, sampling, eos, f"r{self._runs}", score_targets=req.targets
        )
        tracker = ScoreTracker(req.prompts, req.targets)
        return self._execute(req.prompts, groups, tracker, combiner.on_request, sink.on_iteration)

    def _execute(
        self,
        prompts: TokenizedPrompts,
        groups: Iterator[list[Submission]],
        tracker: OutputTracker | ScoreTracker,
        on_finish: OnFinish,
        on_iteration: OnIteration | None,
    ) -> BackendRun:
        """Submit ``groups`` in order (whole groups while fewer than ``window`` requests are
        in flight), step the engine, hand each finished request to ``on_finish``."""
        engine, counters = self.engine, self.scheduler.bj
        if not engine.reset_prefix_cache():  # no run reuses another's prefixes
            raise VllmError("vLLM could not reset its prefix cache (requests still running)")
        self.scheduler.bj_new_run()  # batchllm: decode lengths learned per run
        positions: dict[str, int] = {}
        recorder = RunRecorder(counters, self.block_bytes, on_iteration)
        pending = True
        from vllm.inputs import TokensPrompt

        while True:
            while pending and len(positions) < self.window:  # whole groups, in plan order
                subs = next(groups, None)
                if subs is None:
                    pending = False
                    break
                for sub in subs:
                    positions[sub.request_id] = sub.position
                    prompt = TokensPrompt(prompt_token_ids=sub.tokens)
                    engine.add_request(sub.request_id, prompt, sub.params, lora_request=sub.lora)
            if not positions:
                break
            try:
                outputs = engine.step()
            except Exception as e:
                msg = str(e).replace(_VLLM_SEE_ABOVE, "")  # the trace is in the log
                self.keep_log = True
                raise VllmError(f"vLLM failed while running: {msg}{_log_hint()}") from e
            for out in outputs:
                done, abort = tracker.update(out, positions[out.request_id])
                if abort:
                    engine.abort_request([out.request_id])
                if done is not None:
                    del positions[out.request_id]
                    on_finish(done)
            recorder.collect()
        first_time = int(prompts.lengths.sum()) - tracker.cached_tokens
        return recorder.finish(first_time, self.num_blocks)

    def attention_stats(self) -> dict[str, int] | None:
        """The worker's prefix-shared attention counts (prefix_attention.STATS, since the
        engine started), or None where that backend is not loaded (GPUs; a job's own
        ``worker_extension_cls``)."""
        if self.engine is None:
            return None
        try:
            stats = self.engine.collective_rpc("batchjob_prefix_attention_stats")
        except Exception:
            return None
        return stats[0] if stats and stats[0] else None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.engine_core.shutdown()
            self.engine = self.scheduler = None
        if not self.keep_log:
            drop_vllm_log()
