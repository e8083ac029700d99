"""A batched sampler and stop checks over the job's ``SamplingConfig``.

The settings, their defaults and their checks live in ``batchjob.config.SamplingConfig``
(top_k 0 = off; stop strings non-empty); a row's own decode limit is
``dataclasses.replace(cfg, max_tokens=...)``.

Reproducibility: a sampled row draws exactly one uniform number, a counter-based hash of
(seed, row_id, step), and picks the token by inverse CDF over its (temperature-scaled,
top-k/top-p filtered) distribution in token-id order. Nothing depends on the other rows of
the batch or on the order in which rows are scheduled, so the same seed gives the same
outputs whatever the schedule (given the same logits). top-k/top-p cut at a probability
*value*, so ties at the cut are all kept (tie order never matters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchjob.config import SamplingConfig

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_draw(seed: int, row_id: int, step: int) -> float:
    """A uniform number in [0, 1) determined by (seed, row_id, step) alone."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (row_id & _MASK64))
    h = _splitmix64(h ^ (step & _MASK64))
    return (h >> 11) / float(1 << 53)


def sample(
    logits: torch.Tensor,  # float32 [K, V]
    params: Sequence[SamplingConfig],  # [K]
    row_ids: Sequence[int],  # [K]: stable id of each row's request
    steps: Sequence[int],  # [K]: index of the token being generated (0 = first)
) -> torch.Tensor:  # int64 [K]
    """One token per row: argmax for greedy rows, seeded inverse-CDF draw for the others."""
    k, v = logits.shape
    out = torch.empty(k, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        out[idx] = logits[idx].argmax(dim=-1)
    if not drawn:
        return out
    dev = logits.device
    idx = torch.tensor(drawn, device=dev)
    ps = [params[i] for i in drawn]
    temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
    probs = torch.softmax(logits[idx].float() / temp[:, None], dim=-1)  # [Ks, V]
    top_k = [p.top_k if 0 < p.top_k < v else v for p in ps]
    top_p = [p.top_p for p in ps]
    if min(top_k) < v or min(top_p) < 1.0:
        probs = _filter_top_k_top_p(probs, top_k, top_p)
    cdf = probs.cumsum(dim=-1)  # [Ks, V], token-id order
    u = torch.tensor(
        [
            uniform_draw(p.seed, int(row_ids[i]), int(steps[i]))
            for p, i in zip(ps, drawn, strict=True)
        ],
        dtype=torch.float32,
        device=dev,
    )
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # first cdf > target
    out[idx] = pick.clamp_max(v - 1)
    return out


def token_logprobs(
    logits: torch.Tensor,  # [K, V], the raw logits
    tokens: torch.Tensor,  # int64 [K]: the sampled token of each row
    top_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each sampled token [K], top-N ids [K, N], their logprobs [K, N]): float32
    log-softmax of the raw logits, before temperature/top-k/top-p (as vLLM by default)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.long()[:, None]).squeeze(1)
    top = lp.topk(top_n, dim=-1, sorted=True) if top_n else None
    k = lp.shape[0]
    ids = top.indices.int() if top is not None else torch.zeros(k, 0, dtype=torch.int32)
    vals = top.values if top is not None else torch.zeros(k, 0)
    return chosen, ids, vals


def _filter_top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k / top-p set (ties at the cut kept)."""
    v = probs.shape[1]
    dev = probs.device
    k_max = max(top_k)
    if min(top_p) < 1.0:
        k_max = v  # top-p needs the whole sorted distribution
    sorted_p = probs.topk(k_max, dim=-1, sorted=True).values  # [Ks, k_max], descending
    k_t = torch.tensor(top_k, device=dev).clamp_max(k_max)
    rank = torch.arange(k_max, device=dev)[None, :]  # [1, k_max]
    sorted_p = sorted_p.masked_fill(rank >= k_t[:, None], 0.0)
    p_t = torch.tensor(top_p, dtype=torch.float32, device=dev)[:, None]  # [Ks, 1]
    cum = sorted_p.cumsum(dim=-1)  # prefix sums only: independent of k_max (batch)
    mass = cum.gather(1, k_t[:, None] - 1)  # [Ks, 1]: top-p is relative to the top-k mass
    before = cum - sorted_p  # mass strictly before each rank
    keep = (rank < k_t[:, None]) & (before < p_t * mass)  # [Ks, k_max], a prefix of ranks
    n_keep = keep.sum(dim=-1, keepdim=True)  # >= 1
    cut = sorted_p.gather(1, n_keep - 1)  # [Ks, 1]: smallest kept probability
    return probs.masked_fill(probs < cut, 0.0)


def check_stop(
    generated_token_ids: Sequence[int],
    new_token: int,
    params: SamplingConfig,
    eos_ids: Sequence[int],
) -> str | None:
    """Finish reason after ``new_token`` ("stop", "length") or None to continue.

    ``generated_token_ids`` are the tokens generated *before* ``new_token``. A stop token or
    EOS wins over the length limit. Stop strings are checked separately on the decoded text
    (``truncate_at_stop``).
    """
    if new_token in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and new_token in eos_ids:
        return "stop"
    if len(generated_token_ids) + 1 >= params.max_tokens:
        return "length"
    return None


def truncate_at_stop(text: str, stop: Sequence[str], checked: int = 0) -> tuple[str, bool]:
    """Cut ``text`` before the earliest stop string; returns (text, stopped).

    ``checked``: length of the text already searched at the previous step (incremental
    detokenization); only the tail that could hold a new match is searched.
    """
    if not stop:
        return text, False
    start = max(0, checked - max(len(s) for s in stop) + 1)
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    if not hits:
        return text, False
    return text[: min(hits)], True
