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
        prompt positions, ``TokenizedPrompts.lengths``)."""
        decode = plan.decode_estimate.astype(np.float64)
        prefill = plan.stats.multi_level_prefill_tokens
        if not len(decode):
            return cls(0, int(prefill))
        sizes = np.diff(plan.group_offsets)
        group = np.repeat(np.arange(plan.num_groups), sizes)
        p = plan.group_prefix_len[group].astype(np.float64)
        shared = p * (1 - 1 / sizes[group])  # KV rows of a query a group's sharing saves
        own = np.maximum(lengths[plan.members] - p, 0)
        d_saved = shared / np.maximum(p + own + decode / 2, 1)
        p_saved = shared / np.maximum(p + own / 2, 1)
        # a group's prefix tokens are computed once (saving nothing); its members' own after
        prompt = float(own.sum() + plan.group_prefix_len.sum())
        return cls(
            int(decode.sum()),
            int(prefill),
            _on_shared_step(float((decode * d_saved).sum()), float(decode.sum()), "decode"),
            _on_shared_step(float((own * p_saved).sum()), prompt, "prefill"),
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


def _on_shared_step(saved_tokens: float, tokens: float, kind: str) -> float:
    """The share of a kind's tokens the shared step stands for: their mean saved share over
    the step's, at most 1."""
    if tokens <= 0:
        return 1.0
    return min(saved_tokens / tokens / saved_share(kind), 1.0)
