"""``sampling.bad_words`` as token-id sequences, as vLLM's ``SamplingParams`` builds them
(``update_from_tokenizer``): each word encoded as written (leading spaces stripped) and, where
that gives a different first token of the same length, with one leading space, so the word is
banned at the start of the text and after a space. A word that encodes to no token is a
ConfigError. How the sequences ban tokens: ``banned_next``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from batchjob.errors import ConfigError
from batchjob.tokenize.tokenizer import PromptTokenizer, load_tokenizer


def bad_words_of(folder: str | Path | None, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """``words`` as token-id sequences with the tokenizer of ``folder`` (() for none)."""
    if not words:
        return ()
    if folder is None:
        raise ConfigError("sampling.bad_words: needs the model's tokenizer (model.path)")
    return bad_words_token_ids(load_tokenizer(folder), words)


def bad_words_token_ids(
    tokenizer: PromptTokenizer, words: Sequence[str]
) -> tuple[tuple[int, ...], ...]:
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.tokenizer.encode(word.lstrip(), add_special_tokens=False).ids)
        if not plain:
            raise ConfigError(f"sampling.bad_words: {word!r} encodes to no tokens")
        out.append(plain)
        ids = tokenizer.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
        spaced = tuple(ids)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def banned_next(bad: Sequence[Sequence[int]], past: Sequence[int]) -> list[int]:
    """The tokens a request may not generate next after its output tokens ``past`` (vLLM's
    rule): a bad sequence's last token where the output ends with the rest of it."""
    banned = []
    for ids in bad:
        head = len(ids) - 1
        if head > len(past):
            continue
        if head == 0 or list(past[len(past) - head :]) == list(ids[:head]):
            banned.append(ids[-1])
    return banned
