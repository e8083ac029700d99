"""The native engine's loop: schedule -> build batch -> forward -> sample -> update; what a
step's sampled tokens finish (stop strings, log-probs, grammar status) is the output
processor's (``output_processor.OutputProcessor``).

Knows nothing of Parquet: it takes ``TokenizedPrompts`` and a ``Plan``, and hands each
finished request to a callback as soon as it finishes (so results stream to disk). Its
settings are the job's ``SchedulerConfig``, ``EngineConfig`` and ``SamplingConfig`` as loaded
(and checked) by ``load_job``; what it derives from them and the machine is the ``KVLayout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from batchjob.backends.base import FinishedRequest, IterationRecord
from batchjob.backends.native.batch_builder import ModelBatch, SeqAdapters, build_batch
from batchjob.backends.native.embedding import EmbeddingPooler
from batchjob.backends.native.kv_cache import KVLayout
from batchjob.backends.native.logits_processors import DecodeState
from batchjob.backends.native.malloc_tuning import keep_freed_memory
from batchjob.backends.native.models.llama import LlamaForCausalLM
from batchjob.backends.native.models.logits_buffer import LogitsBuffer
from batchjob.backends.native.models.lora import LoraRouter
from batchjob.backends.native.output_processor import OutputProcessor
from batchjob.backends.native.prompt_logprobs import PromptLogprobs
from batchjob.backends.native.sampling import RowParams, finish_codes, sample_batch
from batchjob.backends.native.scheduler.base import (
    Scheduler,
    check_kv_budget,
    kv_blocks_needed,
    request_prefix_len,
)
from batchjob.backends.native.scheduler.output import SchedulerOutput, SchedulerStats
from batchjob.backends.native.scheduler.registry import make_scheduler
from batchjob.backends.native.structured import GrammarConstraint
from batchjob.backends.scoring import RowScores
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig
from batchjob.inputs.row_settings import RowSettings
from batchjob.model.info import ModelInfo
from batchjob.plan.plan import Plan
from batchjob.timing import LoopClock
from batchjob.tokenize.prompts import TokenizedPrompts

GiB = 1 << 30
NATIVE_BLOCK_SIZE = 16  # engine.block_size unset: small blocks, little padding per group


@dataclass(frozen=True)
class EngineRun:
    """What a run did: per-iteration records and the scheduler's counters."""

    iterations: list[IterationRecord]
    scheduler: SchedulerStats
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    wall_s: float  # the loop's wall time less its first-use calibrations
    calibration_s: float = 0.0  # first-use kernel calibrations inside the loop


def kv_budget_bytes(cfg: EngineConfig, device: torch.device) -> int:
    """KV cache size in bytes: explicit, or a fraction of what the GPU has free.

    Blocks torch's allocator holds but no tensor uses (a freed engine's cache) count as free:
    without ``empty_cache`` a second engine in one process saw 0 bytes (measured on an H100).
    """
    if cfg.kv_cache_bytes is not None:
        return cfg.kv_cache_bytes
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return max(int(free - (1 - cfg.gpu_memory_fraction) * total), 0)
    return 2 * GiB


def graphed_forward(
    model: torch.nn.Module, info: ModelInfo, cfg: EngineConfig, kv: KVLayout
) -> Callable[..., torch.Tensor]:
    """The model's forward; on a GPU with ``engine.cuda_graph_max_tokens`` set (> 0) the
    forward whose non-attention work replays CUDA graphs for batches up to that many tokens
    (``models.cuda_graphs``). The graphs are the model's: engines on one model share them
    (kept on the model). Unset: eager; the graphs stay opt-in until the CUDA cases of
    tests/backends/native/test_cuda_graphs.py have passed on a GPU."""
    limit = cfg.cuda_graph_max_tokens or 0
    if info.torch_device.type != "cuda" or limit == 0 or not isinstance(model, LlamaForCausalLM):
        return model
    if model.sliding_rope is not None:  # pieces carry one RoPE table: Gemma3's layers two
        return model
    from batchjob.backends.native.models.cuda_graphs import PiecewiseForward

    # a position is below its sequence's length: the model's limit and the whole KV cache's
    longest = min(info.max_position, kv.num_blocks * kv.block_size)
    graphed = getattr(model, "graphed_forward", None)
    if not isinstance(graphed, PiecewiseForward) or graphed.sizes[-1] != limit:
        graphed = PiecewiseForward(model, limit, max_position=longest)
        model.graphed_forward = graphed  # type: ignore[assignment]  # nn.Module attribute
    graphed.max_position = max(graphed.max_position, longest)
    return graphed


class Engine:
    """Runs plans on one model; the KV cache is allocated once and reused across runs."""

    def __init__(
        self,
        model: torch.nn.Module,
        info: ModelInfo,
        scheduler: SchedulerConfig,
        engine: EngineConfig,
        lora: LoraRouter | None = None,
    ) -> None:
        """``lora``: the router of the model's LoRA layers (``models.lora.attach_lora``);
        each batch binds its adapters' tokens to it (no CUDA graphs then)."""
        self.model = model
        self.lora = lora
        self.info = info
        self.scheduler_cfg = scheduler
        self.engine_cfg = engine
        if info.torch_device.type == "cpu":
            keep_freed_memory()  # no page-fault churn on each step's activations
            if isinstance(model, LlamaForCausalLM):  # each step's logits read before the next
                model.logits_buffer = LogitsBuffer()
        # ValueError when the budget holds fewer than two blocks
        self.kv = KVLayout.from_budget(
            kv_budget_bytes(engine, info.torch_device),
            engine.block_size or NATIVE_BLOCK_SIZE,
            info.kv_bytes_per_token,
        )
        # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]. Zeroed here, which faults its
        # pages in now: uninitialised (torch.empty) pages fault in during the run instead,
        # ~0.2-0.3 s per used GiB inside the timed window. No slot's content reaches
        # an output before it is written (test_unwritten_kv_slots_never_reach_outputs).
        self.kv_cache = torch.zeros(
            info.kv_cache_shape(self.kv.num_blocks, self.kv.block_size),
            dtype=info.torch_dtype,
            device=info.torch_device,
        )
        eager = lora is not None  # graphs would replay one batch's adapter tokens
        self.forward = model if eager else graphed_forward(model, info, engine, self.kv)

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
        constraint: GrammarConstraint | None = None,
        bad_words: tuple[tuple[int, ...], ...] = (),
    ) -> EngineRun:
        """Generate for every prompt; ``on_finish`` gets each request as it finishes.

        Per-row ``prompts.max_tokens`` and ``prompts.settings`` override ``sampling``. Stop
        strings need ``detokenize`` (token ids -> text). ``sampling.logprobs``: each request
        carries its tokens' log-probs. ``constraint`` (structured output): every constrained
        request's tokens are masked by its grammar; it finishes "stop" when the output is
        complete, or "length" with status ``json_incomplete`` (``regex_incomplete``,
        ``choice_incomplete``) before that. Penalties, logit bias, allowed ids, min_tokens
        and min_p (``logits_processors``) act in the sampler, after the grammar's mask, and
        so do ``bad_words`` (``sampling.bad_words`` as token ids, ``tokenize.bad_words``).
        """
        if sampling.stop and detokenize is None:
            raise ValueError("stop strings need a detokenize function")
        sched = make_scheduler(self.scheduler_cfg, self.kv, prompts, plan)
        table = _row_params(sampling, prompts, self.info.eos_token_ids, bad_words)
        row_ids = np.asarray(prompts.row_ids, dtype=np.int64)
        samples = prompts.sample_index  # sampling.n: sample k draws with seed + k
        n_gen = np.zeros(len(prompts), dtype=np.int64)  # tokens generated by each request
        top_n = sampling.logprobs
        prompt_lp = None  # sampling.prompt_logprobs: read in the prefill chunks
        if sampling.prompt_logprobs is not None:
            prompt_lp = PromptLogprobs(prompts, plan, sampling.prompt_logprobs)
        self.prompt_logprob_rows = 0
        state = None  # the logits processors' state, when any row has one
        if table.procs.any:
            grammar = constraint.constrained(len(prompts)) if constraint is not None else None
            state = DecodeState(
                table.procs, prompts.tokens, prompts.offsets, grammar, inplace=top_n is None
            )
        outputs = OutputProcessor(
            row_ids,
            table,
            on_finish,
            sched.output_tokens,
            detokenize=detokenize,
            top_n=top_n,
            constraint=constraint,
            state=state,
            prompt_lp=prompt_lp,
        )
        records: list[IterationRecord] = []
        clock = LoopClock.start()
        for t0, out, batch in self._steps(sched, self._adapters(prompts, plan)):
            sampled: dict[int, int] = {}
            finished: set[int] = set()
            seqs = batch.sample_seqs
            ids = seqs.tolist()
            if out.kv_copies is not None:  # samples of a row: the first one's prompt KV
                self._copy_blocks(*out.kv_copies)
            if out.chunks:  # a prefill-only iteration runs the forward with nothing to sample
                index = batch.logits_index
                extra = prompt_lp.select(out.chunks) if prompt_lp is not None else None
                if extra is not None and len(extra):
                    index = torch.cat([index, torch.from_numpy(extra).to(index.device)])
                logits = self.forward(
                    batch.input_ids, batch.positions, self.kv_cache, batch.meta, index
                )
                if extra is not None and len(extra):
                    assert prompt_lp is not None
                    prompt_lp.take(logits[len(ids) :])
                    logits = logits[: len(ids)]
            if ids:
                cfg = table.index[seqs]
                steps = n_gen[seqs]
                if constraint is not None:
                    constraint.mask(logits, ids)
                sampled_t = sample_batch(
                    logits,
                    table,
                    cfg,
                    row_ids[seqs],
                    steps,
                    seqs,
                    state,
                    None if samples is None else samples[seqs],
                )
                tokens_np = sampled_t.cpu().numpy()
                codes = finish_codes(tokens_np, table, cfg, steps)
                if state is not None:
                    state.record(seqs, cfg, tokens_np, steps)
                n_gen[seqs] += 1
                tokens = tokens_np.tolist()
                sampled = dict(zip(ids, tokens, strict=True))
                finished = outputs.process(logits, sampled_t, ids, tokens, cfg, steps, codes)
            sched.update(out, sampled, finished)
            self._record(records, out, t0, on_iteration)
        self.prompt_logprob_rows = prompt_lp.rows if prompt_lp is not None else 0
        return self._engine_run(records, sched.stats, clock)

    @torch.inference_mode()
    def score(
        self,
        prompts: TokenizedPrompts,
        plan: Plan | None,
        label_steps: Sequence[tuple[tuple[int, np.ndarray, np.ndarray], ...]],
        scores: RowScores,
        on_iteration: Callable[[IterationRecord], None] | None = None,
    ) -> EngineRun:
        """Scoring mode (``backends.scoring``): one request per prompt, run on ``plan``; with
        and after its prompt, each request is teacher-forced through ``label_steps[i]`` (the
        scheduler rewinds its KV between steps). The float32 log-softmax of every scored
        position's target tokens goes into ``scores.buf`` (one gather per iteration); a
        request the scheduler finishes goes to ``scores.finish``. ``prompts.max_tokens`` must
        be each row's longest label (its KV need: the prompt + the longest label - 1)."""
        sched = make_scheduler(self.scheduler_cfg, self.kv, prompts, plan, label_steps)
        records: list[IterationRecord] = []
        clock = LoopClock.start()
        for t0, out, batch in self._steps(sched, self._adapters(prompts, plan)):
            logits = self.forward(
                batch.input_ids, batch.positions, self.kv_cache, batch.meta, batch.logits_index
            )
            if len(batch.score_seqs):  # logits rows: the scored positions (nothing sampled)
                rep, tok, dest = scores.gather_index(batch.score_seqs, batch.score_nodes)
                x = logits.float()
                lse = torch.logsumexp(x, dim=-1)
                r = torch.from_numpy(rep).to(x.device)
                vals = x[r, torch.from_numpy(tok).to(x.device)] - lse[r]
                scores.buf[dest] = vals.cpu().numpy()
            for pos in sched.update(out, {}, set()):
                scores.finish(pos)
            self._record(records, out, t0, on_iteration)
        return self._engine_run(records, sched.stats, clock)

    @torch.inference_mode()
    def embed(
        self,
        prompts: TokenizedPrompts,
        plan: Plan | None,
        pooler: EmbeddingPooler,
        on_iteration: Callable[[IterationRecord], None] | None = None,
    ) -> EngineRun:
        """Embedding mode (``embedding``): every prompt prefilled on ``plan``, nothing sampled;
        each batch's last-layer hidden states go to ``pooler``, and a request finishes (its
        KV freed) once its whole prompt is computed: as scoring with no label steps."""
        model = self.model
        if not isinstance(model, LlamaForCausalLM):
            raise TypeError(f"embeddings need the native Llama-family model, not {type(model)}")
        steps: tuple[tuple, ...] = ((),) * len(prompts)
        sched = make_scheduler(self.scheduler_cfg, self.kv, prompts, plan, steps)
        records: list[IterationRecord] = []
        clock = LoopClock.start()
        for t0, out, batch in self._steps(sched, self._adapters(prompts, plan)):
            h = model.last_hidden(batch.input_ids, batch.positions, self.kv_cache, batch.meta)
            pooler.add(out, h)
            for pos in sched.update(out, {}, set()):
                pooler.finish(pos)
            self._record(records, out, t0, on_iteration)
        return self._engine_run(records, sched.stats, clock)

    def _adapters(self, prompts: TokenizedPrompts, plan: Plan | None) -> SeqAdapters | None:
        """Each sequence's LoRA adapter (a group prefix's: its members'); None without."""
        if self.lora is None or prompts.adapter is None:
            return None
        rows = np.asarray(prompts.adapter, dtype=np.int64)
        if plan is None or not plan.num_groups:
            return SeqAdapters(rows, np.zeros(0, dtype=np.int64))
        return SeqAdapters(
            rows, rows[plan.members[np.minimum(plan.group_offsets[:-1], len(plan.members) - 1)]]
        )

    def _steps(
        self, sched: Scheduler, adapters: SeqAdapters | None = None
    ) -> Iterator[tuple[float, SchedulerOutput, ModelBatch]]:
        """Every scheduler step until no request is left: (its start time, the scheduler's
        output, the model batch built from it, its adapters' tokens bound to ``self.lora``)."""
        dev = self.info.torch_device
        while sched.has_unfinished():
            t0 = time.perf_counter()
            out = sched.schedule()
            batch = build_batch(out, self.kv.block_size, dev, adapters=adapters)
            if self.lora is not None:
                self.lora.bind(batch.lora_tokens)
            yield t0, out, batch

    def _copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """KV blocks ``src`` copied into ``dst`` (every layer, K and V), before the forward."""
        dev = self.kv_cache.device
        s = torch.from_numpy(src.astype(np.int64)).to(dev)
        d = torch.from_numpy(dst.astype(np.int64)).to(dev)
        self.kv_cache[:, :, d] = self.kv_cache[:, :, s]

    def _record(
        self,
        records: list[IterationRecord],
        out: SchedulerOutput,
        t0: float,
        on_iteration: Callable[[IterationRecord], None] | None,
    ) -> None:
        rec = IterationRecord(
            iteration=out.iteration,
            decode_tokens=out.num_decode_tokens,
            prefill_tokens=out.num_prefill_tokens,
            num_seqs=len(out.chunks),
            kv_blocks_used=out.kv_blocks_used,
            kv_bytes_used=out.kv_blocks_used * self.kv.block_size * self.info.kv_bytes_per_token,
            preempted=len(out.preempted),
            wall_s=time.perf_counter() - t0,
        )
        records.append(rec)
        if on_iteration is not None:
            on_iteration(rec)

    def _engine_run(
        self, records: list[IterationRecord], stats: SchedulerStats, clock: LoopClock
    ) -> EngineRun:
        calibrating = clock.calibration_s()
        return EngineRun(
            iterations=records,
            scheduler=stats,
            num_blocks=self.num_blocks,
            block_size=self.kv.block_size,
            kv_bytes_per_token=self.info.kv_bytes_per_token,
            wall_s=clock.wall_s(),
            calibration_s=calibrating,
        )


def _per_row_params(
    base: SamplingConfig, prompts: TokenizedPrompts
) -> Callable[[int], SamplingConfig]:
    """Row position -> its sampling settings: ``base`` with the row's max_tokens and its
    per-row overrides (``prompts.settings``), cached per distinct combination (the scheduler
    already refused a row limit below 1; ``load_prompts`` rejected bad per-row values)."""
    cache: dict[tuple, SamplingConfig] = {}
    max_tokens = prompts.max_tokens
    rs = prompts.settings if prompts.settings and prompts.settings.overrides_sampling else None

    def get(pos: int) -> SamplingConfig:
        mt = int(max_tokens[pos])
        row = rs.key(rs.index(int(prompts.row_ids[pos]))) if rs is not None else None
        p = cache.get((mt, row))
        if p is None:
            p = replace(base, max_tokens=mt)
            if row is not None:
                p = RowSettings.apply(p, row)
            cache[(mt, row)] = p
        return p

    return get


def _row_params(
    base: SamplingConfig,
    prompts: TokenizedPrompts,
    eos: Sequence[int],
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> RowParams:
    """Every request's settings (``_per_row_params``) as ``RowParams`` arrays, built once;
    ``bad_words``: ``sampling.bad_words`` as token ids."""
    n = len(prompts)
    rs = prompts.settings if prompts.settings and prompts.settings.overrides_sampling else None
    if rs is None:  # settings differ by max_tokens only
        uniq, index = np.unique(np.asarray(prompts.max_tokens), return_inverse=True)
        configs = [replace(base, max_tokens=int(m)) for m in uniq]
        return RowParams.build(configs, index.reshape(-1), eos, bad_words)
    get = _per_row_params(base, prompts)
    seen: dict[SamplingConfig, int] = {}
    index = np.fromiter((seen.setdefault(get(i), len(seen)) for i in range(n)), np.int64, n)
    return RowParams.build(list(seen), index, eos, bad_words)
