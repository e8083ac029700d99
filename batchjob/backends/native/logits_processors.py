"""vLLM's logits processors on the native engine, batched: allowed token ids, min_tokens,
logit bias and the presence / frequency / repetition penalties, applied to the logits before
the greedy argmax or the temperature (min_p comes after the temperature, in ``sampling.py``).

Order and arithmetic follow vLLM v1's sampler (``vllm/v1/sample/sampler.py``, 0.32), so a
greedy row picks the same token and a drawn row draws from the same distribution:

1. the batch rows' logits in float32 (a grammar's mask already applied, as vLLM's model
   runner does before its sampler);
2. allowed token ids: every other id -inf; then ``bad_words``: each bad sequence's last
   token -inf where the output so far ends with the rest of it (``tokenize.bad_words``);
3. min_tokens: while fewer than min_tokens tokens are out, the row's stop ids and the model's
   EOS ids (EOS even with ``ignore_eos``, as vLLM's ``all_stop_token_ids``) -inf; a
   grammar-constrained row left with no finite logit gets those stop logits back;
4. logit bias: added;
5. repetition penalty over the tokens of the prompt or the output so far (a positive logit
   times 1/p, any other times p), then frequency (minus f x the token's count in the output),
   then presence (minus p where the count is > 0): penalties over output tokens only, except
   the repetition penalty.

Work is per batch, never per token: the settings are ragged arrays over the distinct settings
(``Ragged``), gathered for a batch with one index; output-token counts come from a buffer of
the running requests' generated tokens (``OutputHistory``) by one scatter-add.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.config import SamplingConfig
from batchjob.tokenize.bad_words import banned_next


@dataclass(frozen=True)
class Ragged:
    """One int id list (and optional float values) per distinct setting, flat."""

    offsets: np.ndarray  # int64 [C+1]
    ids: np.ndarray  # int64 [total]
    values: np.ndarray  # float32 [total] (zeros where the lists carry none)

    @classmethod
    def of(cls, lists: Sequence[Sequence[int]], values: Sequence[Sequence[float]] = ()) -> Ragged:
        lengths = np.asarray([len(x) for x in lists], dtype=np.int64)
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = [t for x in lists for t in x]
        vals = [v for x in values for v in x] if values else [0.0] * len(flat)
        return cls(offsets, np.asarray(flat, np.int64), np.asarray(vals, np.float32))

    def take(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(owner [T]: index into ``c``, ids [T], values [T]) of the lists of settings ``c``."""
        owner, ids, values = ragged_take(self.offsets, c, self.ids, self.values)
        return owner, ids, values


def ragged_take(offsets: np.ndarray, c: np.ndarray, *flat: np.ndarray) -> tuple[np.ndarray, ...]:
    """(owner [T], then each of ``flat`` gathered [T]) for the ranges ``offsets[c]..[c+1]``."""
    starts = offsets[c]
    lengths = offsets[c + 1] - starts
    owner = np.repeat(np.arange(len(c)), lengths)
    begin = np.cumsum(lengths) - lengths  # where each range starts in the output
    pos = np.arange(int(lengths.sum())) - np.repeat(begin - starts, lengths)
    return (owner, *(f[pos] for f in flat))


@dataclass(frozen=True)
class Processors:
    """The logits processors of every distinct setting (``RowParams.configs``) as arrays."""

    active: np.ndarray  # bool [C]: any processor before the temperature
    any: bool  # active.any()
    allowed: Ragged  # allowed token ids ([] : every id)
    has_allowed: np.ndarray  # bool [C]
    min_tokens: np.ndarray  # int64 [C]
    min_stop: Ragged  # the ids min_tokens masks: stop_token_ids + EOS
    bias: Ragged  # logit bias ids and values (clamped at load)
    has_bias: np.ndarray  # bool [C]
    presence: np.ndarray  # float32 [C]
    frequency: np.ndarray  # float32 [C]
    repetition: np.ndarray  # float32 [C]
    penalized: np.ndarray  # bool [C]: any penalty
    any_penalty: bool
    min_p: np.ndarray  # float32 [C]
    any_min_p: bool
    bad_words: tuple[tuple[int, ...], ...] = ()  # sampling.bad_words' token ids (every row)

    @property
    def keeps_history(self) -> bool:
        """Whether the rows' output tokens are kept (penalties count them, bad words match)."""
        return self.any_penalty or bool(self.bad_words)

    @classmethod
    def build(
        cls,
        configs: Sequence[SamplingConfig],
        eos_ids: Sequence[int],
        bad_words: tuple[tuple[int, ...], ...] = (),
    ) -> Processors:
        def arr(f, dtype) -> np.ndarray:
            return np.asarray([f(c) for c in configs], dtype=dtype)

        presence = arr(lambda c: c.presence_penalty, np.float32)
        frequency = arr(lambda c: c.frequency_penalty, np.float32)
        repetition = arr(lambda c: c.repetition_penalty, np.float32)
        penalized = (presence != 0) | (frequency != 0) | (repetition != 1)
        has_allowed = arr(lambda c: bool(c.allowed_token_ids), bool)
        has_bias = arr(lambda c: bool(c.logit_bias), bool)
        min_tokens = arr(lambda c: c.min_tokens, np.int64)
        active = penalized | has_allowed | has_bias | (min_tokens > 0) | bool(bad_words)
        min_p = arr(lambda c: c.min_p, np.float32)
        return cls(
            active=active,
            any=bool(active.any()),
            allowed=Ragged.of([c.allowed_token_ids for c in configs]),
            has_allowed=has_allowed,
            min_tokens=min_tokens,
            min_stop=Ragged.of(
                [sorted({*c.stop_token_ids, *eos_ids}) if c.min_tokens else () for c in configs]
            ),
            bias=Ragged.of(
                [list(c.logit_bias) for c in configs],
                [list(c.logit_bias.values()) for c in configs],
            ),
            has_bias=has_bias,
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            penalized=penalized,
            any_penalty=bool(penalized.any()),
            min_p=min_p,
            any_min_p=bool((min_p > 0).any()),
            bad_words=bad_words,
        )


class OutputHistory:
    """The tokens generated so far by the running requests that have a penalty: one row of a
    growing int32 buffer per request, reused once the request finishes."""

    def __init__(self, num_requests: int) -> None:
        self.slot = np.full(num_requests, -1, dtype=np.int64)  # [N]: its buffer row, -1: none
        self.free: list[int] = []
        self.used = 0  # buffer rows handed out so far
        self.buf = np.zeros((16, 16), dtype=np.int32)  # [rows, tokens]

    def record(self, seqs: np.ndarray, tokens: np.ndarray, steps: np.ndarray) -> None:
        """Token ``tokens[j]`` is request ``seqs[j]``'s output number ``steps[j]``."""
        if not len(seqs):
            return
        slots = self.slot[seqs]
        new = np.flatnonzero(slots < 0)
        if len(new):
            reuse = min(len(new), len(self.free))
            got = self.free[len(self.free) - reuse :]
            del self.free[len(self.free) - reuse :]
            fresh = list(range(self.used, self.used + len(new) - reuse))
            self.used += len(fresh)
            slots[new] = got + fresh
            self.slot[seqs[new]] = slots[new]
        rows, width = self.buf.shape
        last = int(steps.max())
        if self.used > rows or last >= width:  # grow by doubling: amortised O(1) per token
            new_rows = max(self.used, 2 * rows) if self.used > rows else rows
            new_width = max(last + 1, 2 * width) if last >= width else width
            grown = np.zeros((new_rows, new_width), dtype=np.int32)
            grown[:rows, :width] = self.buf
            self.buf = grown
        self.buf[slots, steps] = tokens

    def counts(self, seqs: np.ndarray, steps: np.ndarray, vocab: int) -> torch.Tensor:
        """int64 [K, V]: how often each token occurs in each request's first ``steps`` outputs."""
        k = len(seqs)
        t = int(steps.max()) if k else 0
        out = torch.zeros(k, vocab + 1, dtype=torch.long)
        if t == 0:
            return out[:, :vocab]
        slots = np.maximum(self.slot[seqs], 0)
        toks = self.buf[slots, :t].astype(np.int64)  # [K, t]
        toks[np.arange(t)[None, :] >= steps[:, None]] = vocab  # not generated yet: padding
        out.scatter_add_(1, torch.from_numpy(toks), torch.ones(k, t, dtype=torch.long))
        return out[:, :vocab]

    def tokens(self, seq: int, n: int) -> list[int]:
        """Request ``seq``'s first ``n`` output tokens."""
        s = int(self.slot[seq])
        return [] if s < 0 or n == 0 else self.buf[s, :n].tolist()

    def release(self, seq: int) -> None:
        s = int(self.slot[seq])
        if s >= 0:
            self.free.append(s)
            self.slot[seq] = -1


class DecodeState:
    """What the processors need beyond a batch's logits, for one run: the prompts' tokens
    (repetition penalty), the output history (penalties), which requests a grammar constrains
    (min_tokens' restore); ``inplace``: the caller no longer needs the raw logits."""

    def __init__(
        self,
        procs: Processors,
        prompt_tokens: np.ndarray,  # int32 flat
        prompt_offsets: np.ndarray,  # int64 [N+1]
        constrained: np.ndarray | None,  # bool [N]
        inplace: bool,
    ) -> None:
        self.procs = procs
        self.prompt_tokens = prompt_tokens
        self.prompt_offsets = prompt_offsets
        self.constrained = constrained
        self.inplace = inplace
        n = len(prompt_offsets) - 1
        self.history = OutputHistory(n) if procs.keeps_history else None

    def record(self, seqs: np.ndarray, cfg: np.ndarray, tokens: np.ndarray, steps: np.ndarray):
        """After a step: the sampled tokens of the penalized rows (every row, with bad words)
        go into the history."""
        if self.history is not None:
            pen = self.procs.penalized[cfg] | bool(self.procs.bad_words)
            self.history.record(seqs[pen], tokens[pen], steps[pen])

    def release(self, seq: int) -> None:
        if self.history is not None:
            self.history.release(seq)


def apply_processors(
    logits: torch.Tensor,  # [K, V]
    procs: Processors,
    cfg: np.ndarray,  # int64 [K]: each row's settings
    steps: np.ndarray,  # int64 [K]: tokens each row has generated
    seqs: np.ndarray,  # int64 [K]: each row's request (prompt position)
    state: DecodeState,
) -> torch.Tensor:  # float32 [K, V]
    """Steps 1-5 of the module docstring for the rows whose settings have a processor; the
    others' logits unchanged. A new tensor unless ``state.inplace``."""
    rows = np.flatnonzero(procs.active[cfg])
    if not len(rows):
        return logits
    x = logits.float()
    if x is logits and not state.inplace:
        x = x.clone()
    v = x.shape[1]
    dev = x.device
    c = cfg[rows]
    neg_inf = float("-inf")

    a = procs.has_allowed[c]
    if a.any():  # 2. allowed ids: a mask of the others
        owner, ids, _ = procs.allowed.take(c[a])
        r = torch.from_numpy(rows[a]).to(dev)
        others = torch.ones(len(r), v, dtype=torch.bool, device=dev)
        others[torch.from_numpy(owner).to(dev), torch.from_numpy(ids).to(dev)] = False
        x[r] = x[r].masked_fill(others, neg_inf)

    if procs.bad_words and state.history is not None:  # 2b. bad words, per row
        for row in rows.tolist():
            past = state.history.tokens(int(seqs[row]), int(steps[row]))
            banned = banned_next(procs.bad_words, past)
            if banned:
                x[row, torch.tensor(banned, device=dev)] = neg_inf

    m = steps[rows] < procs.min_tokens[c]
    if m.any():  # 3. min_tokens: stop ids and EOS masked
        owner, ids, _ = procs.min_stop.take(c[m])
        r = torch.from_numpy(rows[m][owner]).to(dev)
        t = torch.from_numpy(ids).to(dev)
        cons = state.constrained
        held = None
        if cons is not None and cons[seqs[rows[m]]].any():
            held = x[r, t].clone()
        x[r, t] = neg_inf
        if held is not None and cons is not None:  # a grammar row left with nothing: restore
            grammar_row = torch.from_numpy(cons[seqs[rows[m]]][owner]).to(dev)
            dead = torch.isneginf(x[r]).all(dim=-1)
            back = grammar_row & dead & torch.isfinite(held)
            x[r[back], t[back]] = held[back]

    b = procs.has_bias[c]
    if b.any():  # 4. logit bias
        owner, ids, vals = procs.bias.take(c[b])
        r = torch.from_numpy(rows[b][owner]).to(dev)
        bias = torch.from_numpy(vals).to(dev)
        x.index_put_((r, torch.from_numpy(ids).to(dev)), bias, accumulate=True)

    p = procs.penalized[c]
    if p.any():  # 5. penalties
        _penalize(x, rows[p], c[p], procs, steps, seqs, state)
    return x


def _penalize(
    x: torch.Tensor,
    rows: np.ndarray,  # [Kp]: the batch rows with a penalty
    c: np.ndarray,  # [Kp]: their settings
    procs: Processors,
    steps: np.ndarray,
    seqs: np.ndarray,
    state: DecodeState,
) -> None:
    """Repetition, then frequency, then presence penalty, in place on rows ``rows`` of ``x``."""
    assert state.history is not None
    v = x.shape[1]
    dev = x.device
    everyone = len(rows) == x.shape[0]
    r = None if everyone else torch.from_numpy(rows).to(dev)
    sub = x if r is None else x[r]  # [Kp, V]
    counts = state.history.counts(seqs[rows], steps[rows], v).to(dev)  # [Kp, V]
    seen = counts > 0
    rep = procs.repetition[c]
    if (rep != 1).any():
        owner, toks = ragged_take(state.prompt_offsets, seqs[rows], state.prompt_tokens)
        in_prompt = torch.zeros_like(seen)
        in_prompt[
            torch.from_numpy(owner).to(dev), torch.from_numpy(toks.astype(np.int64)).to(dev)
        ] = True
        p = torch.from_numpy(rep).to(dev)[:, None]  # [Kp, 1]
        hit = in_prompt | seen
        scale = torch.where(sub > 0, 1.0 / p, p)
        sub.mul_(torch.where(hit, scale, torch.ones((), device=dev)))
    freq, pres = procs.frequency[c], procs.presence[c]
    if (freq != 0).any():
        sub.sub_(torch.from_numpy(freq).to(dev)[:, None] * counts)
    if (pres != 0).any():
        sub.sub_(torch.from_numpy(pres).to(dev)[:, None] * seen)
    if r is not None:
        x[r] = sub
