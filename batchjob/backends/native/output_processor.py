"""The native engine's output processor: a step's sampled tokens -> finished requests.

``Engine.run`` is the loop (schedule, forward, grammar mask, sample); each step it hands the
tokens it sampled, with their logits, to ``OutputProcessor.process``, which decides which
requests finish and builds their ``FinishedRequest``: the finish reason (a stop token or the
length limit from ``finish_codes``, a complete grammar, a stop string in the detokenized text
past ``min_tokens``), the text cut before a stop string, the tokens' log-probs collected step
by step, the prompt log-probs, and a constrained output's ``*_incomplete`` status. What a
finished request held (the logits processors' state, the grammar's matcher) is released here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from batchjob.backends.base import FinishedRequest, TokenLogprobs
from batchjob.backends.native.logits_processors import DecodeState
from batchjob.backends.native.prompt_logprobs import PromptLogprobs
from batchjob.backends.native.sampling import (
    FINISH_REASONS,
    RowParams,
    token_logprobs,
    truncate_at_stop,
)
from batchjob.backends.native.structured import GrammarConstraint

StepLogprob = tuple[float, np.ndarray, np.ndarray]  # (the token's, top-N ids, top-N log-probs)


class OutputProcessor:
    """Finishes the requests of one ``Engine.run``; ``on_finish`` gets each as it finishes.

    ``output_tokens(seq)``: the tokens the request generated before this step (the
    scheduler's). ``detokenize`` is needed for stop strings; ``top_n`` (``sampling.logprobs``)
    collects each request's token log-probs; ``state`` and ``constraint`` are released for a
    finished request; ``prompt_lp`` gives its prompt log-probs."""

    def __init__(
        self,
        row_ids: np.ndarray,
        table: RowParams,
        on_finish: Callable[[FinishedRequest], None],
        output_tokens: Callable[[int], list[int]],
        detokenize: Callable[[list[int]], str] | None = None,
        top_n: int | None = None,
        constraint: GrammarConstraint | None = None,
        state: DecodeState | None = None,
        prompt_lp: PromptLogprobs | None = None,
    ) -> None:
        self.row_ids = row_ids
        self.table = table
        self.on_finish = on_finish
        self.output_tokens = output_tokens
        self.detokenize = detokenize
        self.top_n = top_n
        self.constraint = constraint
        self.state = state
        self.prompt_lp = prompt_lp
        self.floors: dict[int, int] = {}  # min_tokens + stop strings: the text stops can't end in
        self.logprobs: dict[int, list[StepLogprob]] = {}
        # otherwise only rows that finish or have stop strings need Python work in a step
        self.visit_all = constraint is not None or top_n is not None

    def process(
        self,
        logits: torch.Tensor,
        sampled: torch.Tensor,
        ids: list[int],
        tokens: list[int],
        cfg: np.ndarray,
        steps: np.ndarray,
        codes: np.ndarray,
    ) -> set[int]:
        """One step: request ``ids[j]`` sampled ``tokens[j]`` (``sampled``, from ``logits``
        row j) with settings ``cfg[j]``, having generated ``steps[j]`` tokens before it;
        ``codes``: ``finish_codes``. Returns the requests that finished (each already given
        to ``on_finish``)."""
        table, constraint, detokenize = self.table, self.constraint, self.detokenize
        lp_of = _step_logprobs(logits, sampled, self.top_n) if self.top_n is not None else None
        visit = (
            range(len(ids))
            if self.visit_all
            else np.flatnonzero(codes | table.stop_strings[cfg]).tolist()
        )
        finished: set[int] = set()
        for j in visit:
            seq, tok = ids[j], tokens[j]
            p = table.configs[cfg[j]]
            reason = FINISH_REASONS[codes[j]]
            if constraint is not None and constraint.accept(seq, tok):
                reason = "stop"  # the JSON is complete (closed by EOS)
            if lp_of is not None:
                self.logprobs.setdefault(seq, []).append(lp_of(j))
            toks: list[int] | None = None
            text = None
            if p.stop and detokenize is not None and steps[j] >= p.min_tokens:
                toks = [*self.output_tokens(seq), tok]
                floor = self.floors.get(seq)
                if floor is None:  # vLLM: no stop string within the first min_tokens
                    floor = len(detokenize(toks[: p.min_tokens])) if p.min_tokens else 0
                    self.floors[seq] = floor
                text, stopped = truncate_at_stop(detokenize(toks), p.stop, min_end=floor)
                if stopped:
                    reason = "stop"
                else:
                    text = None
            if reason is None:
                continue
            finished.add(seq)
            if toks is None:
                toks = [*self.output_tokens(seq), tok]
            self._finish(seq, toks, reason, text, p.max_tokens)
        return finished

    def _finish(
        self, seq: int, toks: list[int], reason: str, text: str | None, max_tokens: int
    ) -> None:
        """Release what request ``seq`` held and hand it to ``on_finish``."""
        self.floors.pop(seq, None)
        if self.state is not None:
            self.state.release(seq)
        status = message = None
        constraint = self.constraint
        if constraint is not None:
            problem = constraint.problem(seq)
            if problem is not None:
                status, what = problem
                why = (
                    f"max_tokens = {max_tokens} reached"
                    if reason == "length"
                    else f"finish {reason}"
                )
                message = f"row {int(self.row_ids[seq])}: {what} ({why})"
            constraint.release(seq)
        prompt_lp = self.prompt_lp
        self.on_finish(
            FinishedRequest(
                position=seq,
                row_id=int(self.row_ids[seq]),
                token_ids=np.asarray(toks, dtype=np.int32),
                finish_reason=reason,
                text=text,
                logprobs=_collect(self.logprobs.pop(seq, None), self.top_n),
                prompt_logprobs=prompt_lp.finish(seq) if prompt_lp else None,
                status=status,
                message=message,
            )
        )


def _step_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> Callable[[int], StepLogprob]:
    """Batch row j -> (logprob of its token, top-N ids, top-N logprobs), one batched call."""
    chosen, ids, vals = token_logprobs(logits, tokens, min(top_n, logits.shape[-1]))
    c, i, v = chosen.cpu().numpy(), ids.cpu().numpy(), vals.float().cpu().numpy()
    return lambda j: (float(c[j]), i[j], v[j])


def _collect(steps: list[StepLogprob] | None, top_n: int | None) -> TokenLogprobs | None:
    if steps is None or top_n is None:
        return None
    return TokenLogprobs(
        logprob=np.asarray([s[0] for s in steps], dtype=np.float32),
        top_ids=np.stack([s[1] for s in steps]).astype(np.int32),
        top_logprobs=np.stack([s[2] for s in steps]).astype(np.float32),
    )
