"""Per-row token-id settings: ``logit_bias_column`` (map<integer, number>) and
``allowed_token_ids_column`` (list<integer>) values checked and normalised (ids within the
model's vocabulary, biases finite and clamped as vLLM does), and the job's own token ids
checked against the model (``batchjob.inputs.row_settings`` reads the columns)."""

from __future__ import annotations

import math

from batchjob.config import SamplingConfig
from batchjob.config.sections import LOGIT_BIAS_LIMIT
from batchjob.errors import ConfigError


def check_token_ids(sampling: SamplingConfig, vocab_size: int | None) -> None:
    """The job's logit bias, allowed ids and stop ids name tokens of the model (else exit 3)."""
    if vocab_size is None:
        return
    for key, ids in (
        ("sampling.logit_bias", list(sampling.logit_bias)),
        ("sampling.allowed_token_ids", list(sampling.allowed_token_ids)),
        ("sampling.stop_token_ids", list(sampling.stop_token_ids)),  # vLLM refuses them too
    ):
        over = [t for t in ids if t >= vocab_size]
        if over:
            raise ConfigError(
                f"{key}: token ids {over[:5]} are not below the model's vocab_size {vocab_size}"
            )


def row_biases(
    values: list, vocab_size: int | None, reject
) -> tuple[tuple[tuple[int, float], ...] | None, ...]:
    """Each row's (token id, bias) pairs, biases clamped to [-100, 100] as vLLM does; a NaN or
    infinite bias, or an id outside the vocabulary, rejects the row."""
    out: list[tuple[tuple[int, float], ...] | None] = []
    for i, pairs in enumerate(values):
        if pairs is None:
            out.append(None)
            continue
        ids = [k for k, _ in pairs]
        biases = [v for _, v in pairs]
        problem = None
        if any(k is None or k < 0 or (vocab_size is not None and k >= vocab_size) for k in ids):
            problem = "token ids must be >= 0" + (
                f" and below the vocab_size {vocab_size}" if vocab_size is not None else ""
            )
        elif any(b is None or not math.isfinite(b) for b in biases):
            problem = "biases must be finite numbers"
        if problem is not None:
            reject(i, problem, dict(pairs))
            out.append(None)
            continue
        lim = LOGIT_BIAS_LIMIT
        out.append(tuple(sorted((int(k), min(lim, max(-lim, float(b)))) for k, b in pairs)))
    return tuple(out)


def row_allowed(values: list, vocab_size: int | None, reject) -> tuple[tuple[int, ...] | None, ...]:
    """Each row's allowed token ids (null: the job's); an empty list, a null id or an id
    outside the vocabulary rejects the row."""
    out: list[tuple[int, ...] | None] = []
    for i, ids in enumerate(values):
        if ids is None:
            out.append(None)
            continue
        if not ids:
            reject(i, "empty list (null: the job's sampling.allowed_token_ids)", ids)
        elif any(k is None or k < 0 or (vocab_size is not None and k >= vocab_size) for k in ids):
            top = f" and below the vocab_size {vocab_size}" if vocab_size is not None else ""
            reject(i, f"token ids must be >= 0{top}", ids if len(ids) <= 10 else ids[:10])
        else:
            out.append(tuple(sorted({int(k) for k in ids})))
            continue
        out.append(None)
    return tuple(out)
