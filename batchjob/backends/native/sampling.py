"""A batched sampler and stop checks over the job's ``SamplingConfig``.

The settings, their defaults and their checks live in ``batchjob.config.SamplingConfig``
(top_k 0 = off; stop strings non-empty); a row's own decode limit is
``dataclasses.replace(cfg, max_tokens=...)``.

Order (vLLM v1's): the logits processors of ``logits_processors.py`` (allowed ids,
min_tokens, logit bias, penalties), then greedy rows take the argmax; drawn rows' logits are
divided by the temperature, softmaxed, cut by min_p (below min_p x the top probability), then
by top-k and top-p.

Reproducibility: a sampled row draws exactly one uniform number, a counter-based hash of
(seed, row_id, step), and picks the token by inverse CDF over its (temperature-scaled,
min_p/top-k/top-p filtered) distribution in token-id order. Nothing depends on the other rows of
the batch or on the order in which rows are scheduled, so the same seed gives the same
outputs whatever the schedule (given the same logits). top-k/top-p cut at a probability
*value*, so ties at the cut are all kept (tie order never matters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.backends.native.logits_processors import DecodeState, Processors, apply_processors
from batchjob.config import SamplingConfig

_MASK64 = (1 << 64) - 1
# finish codes of ``finish_codes`` (index into FINISH_REASONS)
CONTINUE, STOP, LENGTH = 0, 1, 2
FINISH_REASONS: tuple[str | None, ...] = (None, "stop", "length")


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


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    """``_splitmix64`` over a uint64 array (numpy's uint64 arithmetic wraps mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniform_draws(seeds: np.ndarray, row_ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """float64 [K]: ``uniform_draw`` of each (seed, row_id, step), in one numpy pass."""

    def u64(a: np.ndarray) -> np.ndarray:  # two's complement, as ``& _MASK64`` on a Python int
        return np.asarray(a).astype(np.int64).astype(np.uint64)

    h = _splitmix64_np(u64(seeds))
    h = _splitmix64_np(h ^ u64(row_ids))
    h = _splitmix64_np(h ^ u64(steps))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass(frozen=True)
class RowParams:
    """Every request's sampling settings as arrays over its distinct settings (built once per
    run), so a batch gathers them with one index instead of a Python call per row."""

    configs: tuple[SamplingConfig, ...]  # [C]: the distinct settings
    index: np.ndarray  # int64 [N]: settings of each request (prompt position)
    greedy: np.ndarray  # bool [C]
    temperature: np.ndarray  # float32 [C]
    top_k: np.ndarray  # int64 [C]: 0 = off
    top_p: np.ndarray  # float32 [C]
    seed: np.ndarray  # uint64 [C]
    max_tokens: np.ndarray  # int64 [C]
    stop_ids: tuple[np.ndarray, ...]  # [C]: int64 ids that finish "stop" (stop ids + EOS)
    stop_strings: np.ndarray  # bool [C]: has stop strings (checked on the decoded text)
    procs: Processors  # the logits processors (penalties, bias, masks, min_p)

    @classmethod
    def build(
        cls,
        configs: Sequence[SamplingConfig],
        index: np.ndarray,
        eos_ids: Sequence[int],
        bad_words: tuple[tuple[int, ...], ...] = (),
    ) -> RowParams:
        def arr(f, dtype) -> np.ndarray:
            return np.asarray([f(c) for c in configs], dtype=dtype)

        return cls(
            configs=tuple(configs),
            index=np.asarray(index, dtype=np.int64),
            greedy=arr(lambda c: c.greedy, bool),
            temperature=arr(lambda c: c.temperature, np.float32),
            top_k=arr(lambda c: c.top_k, np.int64),
            top_p=arr(lambda c: c.top_p, np.float32),
            seed=arr(lambda c: c.seed & _MASK64, np.uint64),
            max_tokens=arr(lambda c: c.max_tokens, np.int64),
            stop_ids=tuple(
                np.asarray(
                    sorted({*c.stop_token_ids, *(() if c.ignore_eos else eos_ids)}), np.int64
                )
                for c in configs
            ),
            stop_strings=arr(lambda c: bool(c.stop), bool),
            procs=Processors.build(configs, eos_ids, bad_words),
        )


def sample(
    logits: torch.Tensor,  # float32 [K, V]
    params: Sequence[SamplingConfig],  # [K]
    row_ids: Sequence[int],  # [K]: stable id of each row's request
    steps: Sequence[int],  # [K]: index of the token being generated (0 = first)
) -> torch.Tensor:  # int64 [K]
    """One token per row: argmax for greedy rows, seeded inverse-CDF draw for the others."""
    distinct = list(dict.fromkeys(params))
    where = {p: i for i, p in enumerate(distinct)}
    table = RowParams.build(distinct, np.asarray([where[p] for p in params], np.int64), ())
    return sample_batch(
        logits,
        table,
        table.index,
        np.asarray(list(row_ids), np.int64),
        np.asarray(list(steps), np.int64),
    )


def sample_batch(
    logits: torch.Tensor,  # float32 [K, V]
    table: RowParams,
    cfg: np.ndarray,  # int64 [K]: each row's settings (index into table.configs)
    row_ids: np.ndarray,  # int64 [K]: stable id of each row's request
    steps: np.ndarray,  # int64 [K]: index of the token being generated (0 = first)
    seqs: np.ndarray | None = None,  # int64 [K]: each row's request (with ``state``)
    state: DecodeState | None = None,  # the run's processor state (table.procs.any)
    samples: np.ndarray | None = None,  # int [K]: sample index of each row (sampling.n)
) -> torch.Tensor:  # int64 [K]
    """``sample`` for a whole batch at once: the logits processors batched, greedy rows in
    one argmax, the drawn rows' temperature/min_p/top-k/top-p/seeds as gathered arrays (no
    Python work per row)."""
    if table.procs.any:
        if state is None or seqs is None:
            raise ValueError("settings with logits processors need the run's DecodeState")
        logits = apply_processors(logits, table.procs, cfg, steps, seqs, state)
    k = logits.shape[0]
    greedy = table.greedy[cfg]
    if greedy.all():
        return _argmax(logits)
    dev = logits.device
    out = torch.empty(k, dtype=torch.long, device=dev)
    if greedy.any():
        g = torch.from_numpy(np.flatnonzero(greedy)).to(dev)
        out[g] = _argmax(logits[g])
    drawn = np.flatnonzero(~greedy)
    c = cfg[drawn]
    idx = torch.from_numpy(drawn).to(dev)
    probs = _drawn_probs(logits[idx], table, c)  # [Ks, V]
    seeds = table.seed[c]
    if samples is not None:  # sample k of a row draws with seed + k (as vLLM's n children)
        seeds = seeds + np.asarray(samples, dtype=np.uint64)[drawn]
    out[idx] = _inverse_cdf(probs, uniform_draws(seeds, row_ids[drawn], steps[drawn]))
    return out


def _inverse_cdf(probs: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    """int64 [K]: each row's token at uniform ``u`` of its (not renormalised) ``probs``."""
    cdf = probs.cumsum(dim=-1)  # [K, V], token-id order
    u_t = torch.from_numpy(u.astype(np.float32)).to(probs.device)
    total = cdf[:, -1]
    target = torch.minimum(u_t * total, torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # first cdf > target
    return pick.clamp_max(probs.shape[1] - 1)


def draw_tokens(
    scaled: torch.Tensor,  # [K, V]: logits already divided by the temperature, min_p applied
    seeds: np.ndarray,  # uint64 [K]: seed (+ sample index)
    row_ids: np.ndarray,  # int64 [K]
    steps: np.ndarray,  # int64 [K]
    top_k: np.ndarray,  # int64 [K]: 0 = off
    top_p: np.ndarray,  # float32 [K]
) -> torch.Tensor:  # int64 [K]
    """``sample_batch``'s draw for rows whose logits another engine has brought to the
    temperature-scaled stage (``batchjob.backends.vllm.seeded_draw``): softmax, top-k,
    top-p, the same inverse CDF at the same (seed, row_id, step) uniform."""
    probs = _top_k_top_p(torch.softmax(scaled.float(), dim=-1), top_k, top_p)
    return _inverse_cdf(probs, uniform_draws(seeds, row_ids, steps))


def _drawn_probs(logits: torch.Tensor, table: RowParams, c: np.ndarray) -> torch.Tensor:
    """float32 [Ks, V]: the drawn rows' distribution (not renormalised), rows with settings
    ``c``: softmax of the temperature-scaled logits, then min_p, top-k and top-p."""
    temp = torch.from_numpy(table.temperature[c]).to(logits.device)
    probs = torch.softmax(logits.float() / temp[:, None], dim=-1)  # [Ks, V]
    if table.procs.any_min_p:
        min_p = table.procs.min_p[c]
        if min_p.max() > 0:  # below min_p x the row's top probability: dropped
            mp = torch.from_numpy(min_p).to(logits.device)[:, None]
            probs = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * mp, 0.0)
    return _top_k_top_p(probs, table.top_k[c], table.top_p[c])


def _top_k_top_p(probs: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """``probs`` [K, V] cut by each row's top-k (0 or >= V: off) and top-p (1: off)."""
    v = probs.shape[1]
    k = np.where((top_k > 0) & (top_k < v), top_k, v)
    if k.min() < v or top_p.min() < 1.0:
        probs = _filter_top_k_top_p(probs, k.tolist(), top_p.tolist())
    return probs


def sampling_probs(
    logits: torch.Tensor,  # [K, V]
    table: RowParams,
    cfg: np.ndarray,  # int64 [K]
    steps: np.ndarray,  # int64 [K]
    seqs: np.ndarray | None = None,
    state: DecodeState | None = None,
) -> torch.Tensor:  # float32 [K, V], rows summing to 1
    """The distribution each (drawn) row's token is sampled from: what ``sample_batch`` draws
    by inverse CDF, processors and filters applied."""
    if table.procs.any:
        assert state is not None and seqs is not None
        logits = apply_processors(logits, table.procs, cfg, steps, seqs, state)
    probs = _drawn_probs(logits, table, cfg)
    return probs / probs.sum(dim=-1, keepdim=True)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 [K]: first index of each row's maximum, as ``torch.argmax``; on CPU numpy's
    (same first-index rule, ~10x faster than torch's CPU argmax on [1000, 1000])."""
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    return torch.from_numpy(x.numpy().argmax(axis=-1).astype(np.int64, copy=False))


def finish_codes(
    tokens: np.ndarray,  # int64 [K]: the tokens just sampled
    table: RowParams,
    cfg: np.ndarray,  # int64 [K]
    steps: np.ndarray,  # int64 [K]: tokens generated before these
) -> np.ndarray:  # int8 [K]: CONTINUE, STOP or LENGTH
    """``check_stop`` for a whole batch: one ``isin`` per distinct settings in the batch."""
    stop = np.zeros(len(tokens), dtype=bool)
    present = np.unique(cfg) if len(table.configs) > 1 else np.zeros(1, np.int64)
    for c in present.tolist():
        ids = table.stop_ids[c]
        if len(ids):
            hit = np.isin(tokens, ids)
            stop |= hit if len(present) == 1 else hit & (cfg == c)
    length = steps + 1 >= table.max_tokens[cfg]
    return np.where(stop, STOP, np.where(length, LENGTH, CONTINUE)).astype(np.int8)


LOGPROB_SLICE_BYTES = 1 << 28  # float32 log-softmax rows computed at a time (256 MiB)


def token_logprobs(
    logits: torch.Tensor,  # [K, V], the raw logits
    tokens: torch.Tensor,  # int64 [K]: the sampled token of each row
    top_n: int,
    slice_bytes: int = LOGPROB_SLICE_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each sampled token [K], top-N ids [K, N], their logprobs [K, N]): float32
    log-softmax of the raw logits, before temperature/top-k/top-p (as vLLM by default).

    Computed over slices of rows of at most ``slice_bytes`` of float32 log-softmax: a prefill
    chunk's prompt log-probs are thousands of rows, and a whole [K, V] float32 copy of them
    at a 128k vocabulary is 0.5 GB per 1,000 rows on top of the logits themselves."""
    k, v = logits.shape
    step = max(1, slice_bytes // (4 * max(v, 1)))
    tokens = tokens.long().to(logits.device)
    chosen = torch.empty(k, dtype=torch.float32, device=logits.device)
    ids = torch.zeros(k, top_n, dtype=torch.int32, device=logits.device)
    vals = torch.zeros(k, top_n, dtype=torch.float32, device=logits.device)
    for a in range(0, k, step):
        lp = torch.log_softmax(logits[a : a + step].float(), dim=-1)
        chosen[a : a + step] = lp.gather(1, tokens[a : a + step, None]).squeeze(1)
        if top_n:
            top = lp.topk(top_n, dim=-1, sorted=True)
            ids[a : a + step], vals[a : a + step] = top.indices, top.values
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


def truncate_at_stop(
    text: str, stop: Sequence[str], checked: int = 0, min_end: int = 0
) -> tuple[str, bool]:
    """Cut ``text`` before the earliest stop string; returns (text, stopped).

    ``checked``: length of the text already searched at the previous step (incremental
    detokenization); only the tail that could hold a new match is searched. ``min_end``:
    only a match ending after this many characters counts (min_tokens: the text of the first
    min_tokens tokens cannot stop the row, as in vLLM).
    """
    if not stop:
        return text, False
    start = max(0, checked - max(len(s) for s in stop) + 1)
    hits = [i for i in (text.find(s, max(start, min_end - len(s) + 1)) for s in stop) if i >= 0]
    if not hits:
        return text, False
    return text[: min(hits)], True
