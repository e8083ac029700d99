"""A job's attention work as the vllm backend's timed steps count it (``attention_choice``).

The backend times one layer's attention on four synthetic steps per class (``STEPS``): a
decode step and a prefill step whose requests share a document's KV blocks, and the same
two with nothing shared (each request's context its own, the same length). batchjob's
prefix-shared kernel reads a shared prefix once per group; vLLM's attention reads it once
per request, so how much of a job's KV reads sharing saves decides how far the shared
steps' timings speak for it. ``JobMix.of`` counts that from the plan: a decode token of a
member of a group of ``m`` over a ``P``-token prefix with ``O`` tokens of its own context
saves ``P (1 - 1/m) / (P + O)`` of its reads; a prompt token after the prefix saves
``P (1 - 1/m) / (P + L/2)`` (``L``: the member's own prompt tokens); the prefix's own tokens
and rows that share nothing save none. The job's token-weighted savings over the shared
step's (``saved_share``) put it between the two steps, linearly (a step's time is about
linear in the KV rows it reads), never past the shared step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchjob.plan.plan import Plan

# (groups, members a group, shared prefix tokens, own tokens, query tokens a request)
STEPS = {
    "decode": (16, 8, 1024, 64, 1),  # 128 requests, 8 a document
    "decode_alone": (32, 1, 0, 1088, 1),  # 32 requests, the same context each, unshared
    "prefill": (1, 16, 512, 128, 128),  # 16 questions over one cached document
    "prefill_alone": (16, 1, 0, 640, 128),  # 16 prompts' last 128 tokens, nothing cached
}
# steps of each kind where no job is known: three shared decode steps per shared prefill step
WEIGHTS = {"decode": 3.0, "decode_alone": 0.0, "prefill": 1.0, "prefill_alone": 0.0}
_SHARED = {"decode": "decode_alone", "prefill": "prefill_alone"}
CHUNK = 1 << 20  # plan members ``JobMix.of`` counts at a time


def step_tokens(kind: str) -> int:
    """Query tokens one timed step of ``kind`` runs (``STEPS``)."""
    groups, members, _, _, qlen = STEPS[kind]
    return groups * members * qlen


def saved_share(kind: str) -> float:
    """The share of its KV reads a query token of the shared step ``kind`` saves by sharing
    (as ``JobMix.of`` counts a job's)."""
    _, m, prefix, own, qlen = STEPS[kind]
    context = prefix + (own - qlen / 2 if qlen > 1 else own)
    return prefix * (1 - 1 / m) / context


@dataclass(frozen=True)
class JobMix:
    """A job's attention work: the tokens it decodes (the plan's decode estimates), the
    prompt tokens left to compute once shared prefixes are cached (the plan's multi-level
    prefill tokens), and for each the share its sharing puts on the shared step (0: all on
    the unshared step; 1, the default: all on the shared one)."""

    decode_tokens: int
    prefill_tokens: int
    decode_shared: float = 1.0
    prefill_shared: float = 1.0

    @classmethod
    def of(cls, plan: Plan, lengths: np.ndarray) -> JobMix:
        """The mix of ``plan`` over prompts of ``lengths`` tokens (indexed by the plan's
        prompt positions, ``TokenizedPrompts.lengths``), counted ``CHUNK`` members at a
        time (a plan of 100M rows: no array of that length is made)."""
        n = len(plan.members)
        sums = np.zeros(4)  # decode tokens, their saved share, own prompt tokens, theirs
        for a in range(0, n, CHUNK):
            sums += _member_sums(plan, lengths, a, min(a + CHUNK, n))
        decode, d_saved, own, p_saved = (float(x) for x in sums)
        # a group's prefix tokens are computed once (saving nothing); its members' own after
        prompt = own + float(plan.group_prefix_len.sum())
        return cls(
            int(decode),
            int(plan.stats.multi_level_prefill_tokens),
            _on_shared_step(d_saved, decode, "decode"),
            _on_shared_step(p_saved, prompt, "prefill"),
        )

    def weights(self) -> dict[str, float]:
        """Steps of each kind (``STEPS``) the job's tokens make (``WEIGHTS`` for a job of no
        tokens)."""
        tokens = {"decode": self.decode_tokens, "prefill": self.prefill_tokens}
        if sum(tokens.values()) <= 0:
            return dict(WEIGHTS)
        on_shared = {"decode": self.decode_shared, "prefill": self.prefill_shared}
        w = {}
        for kind, alone in _SHARED.items():
            n = max(tokens[kind], 0)
            w[kind] = n * on_shared[kind] / step_tokens(kind)
            w[alone] = n * (1 - on_shared[kind]) / step_tokens(alone)
        return w


def _member_sums(plan: Plan, lengths: np.ndarray, a: int, b: int) -> np.ndarray:
    """Over the plan's members ``a:b``: their decode tokens and the reads those save (in
    tokens: each token times its saved share), their own prompt tokens and the reads those
    save."""
    group = np.searchsorted(plan.group_offsets, np.arange(a, b), side="right") - 1
    size = (plan.group_offsets[group + 1] - plan.group_offsets[group]).astype(np.float64)
    p = plan.group_prefix_len[group].astype(np.float64)
    shared = p * (1 - 1 / size)  # KV rows of a query its group's sharing saves
    decode = plan.decode_estimate[a:b].astype(np.float64)
    own = np.maximum(lengths[plan.members[a:b]] - p, 0)
    d_saved = shared / np.maximum(p + own + decode / 2, 1)
    p_saved = shared / np.maximum(p + own / 2, 1)
    return np.array([decode.sum(), (decode * d_saved).sum(), own.sum(), (own * p_saved).sum()])


def _on_shared_step(saved_tokens: float, tokens: float, kind: str) -> float:
    """The share of a kind's tokens the shared step stands for: their mean saved share over
    the step's, at most 1."""
    if tokens <= 0:
        return 1.0
    return min(saved_tokens / tokens / saved_share(kind), 1.0)
