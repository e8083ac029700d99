"""Reasoning models' outputs (``output.reasoning_parser``): the ``<think> ... </think>`` part
split from the answer, and where a constrained output's grammar starts, as vLLM's reasoning
parsers of the same names do (vllm/reasoning/, vllm/parser/qwen3.py in vLLM 0.32).

The split works on the output's text, as vLLM's ``extract_reasoning``:

- ``deepseek_r1``: the text after the first ``<think>`` (all of it when there is none); the
  reasoning is what comes before the first ``</think>``, the answer what follows it (null
  when empty). Without ``</think>`` all of it is reasoning and the answer is null.
- ``qwen3``: the output starts in the reasoning; there ``<think>`` is dropped and
  ``</think>`` (or a ``<tool_call>``, kept in the answer) ends it; in the answer a
  ``</think>`` is dropped. Each part is null when empty.

The grammar of a constrained row (json_schema, regex, choice) applies to the answer only: it
starts after the first ``</think>`` the row generates, unless the prompt ended its reasoning
already (the last marker in the prompt is ``</think>``; for qwen3 the scan stops at a chat
turn boundary). Both need ``<think>`` and ``</think>`` to be tokens of the model's tokenizer
(vLLM refuses the parser otherwise) that decoding keeps (not special tokens).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL = "<tool_call>"  # qwen3: a tool call also ends the reasoning
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")  # qwen3: a prompt's scan stops at these
_QWEN3_MARKERS = re.compile(f"({re.escape(THINK_START)}|{re.escape(THINK_END)}|{TOOL_CALL})")


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, answer) of an output's text, as vLLM's parser ``parser`` splits it."""
    if parser == "deepseek_r1":
        before, start, after = text.partition(THINK_START)
        body = after if start else before
        reasoning, end, answer = body.partition(THINK_END)
        return reasoning, (answer or None) if end else None
    if parser == "qwen3":
        parts: tuple[list[str], list[str]] = ([], [])  # reasoning, answer
        in_answer = False
        for piece in _QWEN3_MARKERS.split(text):
            if piece == THINK_START and not in_answer:
                continue
            if piece == THINK_END:
                in_answer = True
                continue
            if piece == TOOL_CALL:
                in_answer = True
            parts[in_answer].append(piece)
        return "".join(parts[0]) or None, "".join(parts[1]) or None
    raise ValueError(f"unknown reasoning parser {parser!r} (one of {', '.join(REASONING_PARSERS)})")


@dataclass(frozen=True)
class ReasoningMarkers:
    """The token ids of a parser's markers in one tokenizer."""

    parser: str
    start_id: int  # <think>
    end_id: int  # </think>: a generated one starts the grammar
    prompt_end_ids: frozenset[int]  # ids that end the reasoning when last in a prompt
    boundary_ids: frozenset[int]  # qwen3: chat turn boundaries (a prompt's scan stops)

    def open_after(self, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """bool [N]: whether each prompt (``tokens[offsets[i]:offsets[i + 1]]``) leaves its
        output inside the reasoning: vLLM's ``is_reasoning_end`` on the prompt, negated (the
        prompt's last marker is no end marker). Vectorised over the markers' positions."""
        ends = np.fromiter(self.prompt_end_ids, dtype=np.int64)
        others = np.fromiter({self.start_id, *self.boundary_ids}, dtype=np.int64)
        at = np.flatnonzero(np.isin(tokens, ends) | np.isin(tokens, others))
        last = np.searchsorted(at, offsets[1:]) - 1  # each prompt's last marker, if in it
        found = last >= 0
        found[found] = at[last[found]] >= offsets[:-1][found]
        is_end = np.zeros(len(last), dtype=bool)
        is_end[found] = np.isin(tokens[at[last[found]]], ends)
        return ~is_end


def reasoning_markers(parser: str, tokenizer) -> ReasoningMarkers:
    """``parser``'s markers in ``tokenizer`` (a ``tokenizers.Tokenizer``); ValueError saying
    why when the tokenizer lacks them or decoding would drop them (special tokens)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
    ids = {}
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    for marker in (THINK_START, THINK_END):
        tid = tokenizer.token_to_id(marker)
        if tid is None:
            raise ValueError(f"the model's tokenizer has no {marker} token (the {parser} parser)")
        if marker in special:
            raise ValueError(
                f"{marker} is a special token of the model's tokenizer: decoded outputs drop it"
            )
        ids[marker] = tid

    def present(names: Sequence[str]) -> frozenset[int]:
        found = (tokenizer.token_to_id(n) for n in names)
        return frozenset(t for t in found if t is not None)

    end = frozenset({ids[THINK_END]})
    qwen3 = parser == "qwen3"
    return ReasoningMarkers(
        parser,
        ids[THINK_START],
        ids[THINK_END],
        end | present([TOOL_CALL]) if qwen3 else end,
        present(TURN_BOUNDARIES) if qwen3 else frozenset(),
    )
