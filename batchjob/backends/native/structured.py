"""Structured output on the native engine: JSON-schema constrained decoding with xgrammar.

The schema is compiled once (per distinct schema) against the model's tokenizer; each running
request gets its own ``GrammarMatcher``. Per sampling step the engine fills the token bitmask
of the constrained rows, applies it to their logits (disallowed tokens -> -inf) before
sampling, and feeds the sampled token back with ``accept``. EOS is allowed only once the JSON
is complete; a request that reaches ``max_tokens`` before that finishes "length" with status
``json_incomplete``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

STATUS_JSON_INCOMPLETE = "json_incomplete"


class JsonConstraint:
    """A compiled JSON schema and the live matchers of the requests it constrains."""

    def __init__(
        self, model_path: str | Path, schema: str, vocab_size: int, eos_ids: Sequence[int]
    ) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_path) / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab_size, stop_token_ids=list(eos_ids)
        )
        self._xgr = xgr
        self.vocab_size = vocab_size
        # compact JSON (no free whitespace): a weak model cannot pad forever between tokens
        self.compiled = xgr.GrammarCompiler(info).compile_json_schema(
            schema, any_whitespace=False, separators=(",", ":")
        )
        # xgrammar's JSON strings admit raw control bytes (< 0x20), which strict JSON parsers
        # (Python's json, jsonschema users) reject: ban every token containing one; compact
        # JSON never needs them (escapes such as \u0004 stay possible)
        ban = [i for i, b in enumerate(info.decoded_vocab) if any(c < 0x20 for c in b)]
        self._ban = torch.tensor(ban, dtype=torch.long)
        self._matchers: dict[int, object] = {}

    def _matcher(self, seq: int):
        m = self._matchers.get(seq)
        if m is None:
            m = self._xgr.GrammarMatcher(self.compiled)
            self._matchers[seq] = m
        return m

    def mask(self, logits: torch.Tensor, seqs: Sequence[int]) -> None:
        """Set to -inf, in place, the logits of the tokens each row's grammar forbids now."""
        bitmask = self._xgr.allocate_token_bitmask(len(seqs), self.vocab_size)
        for j, s in enumerate(seqs):
            self._matcher(s).fill_next_token_bitmask(bitmask, j)
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        else:  # the CPU kernel takes float32 only: mask through a float32 copy
            x = logits.float().cpu()
            self._xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=self.vocab_size)
            logits.copy_(x.to(logits.device, logits.dtype))
        if len(self._ban):
            logits[:, self._ban.to(logits.device)] = float("-inf")

    def accept(self, seq: int, token: int) -> bool:
        """Feed the sampled token; True once the JSON is complete and closed by EOS."""
        m = self._matcher(seq)
        if not m.accept_token(int(token)):
            raise RuntimeError(f"request {seq}: token {token} rejected by its JSON grammar")
        return m.is_terminated()

    def complete(self, seq: int) -> bool:
        """True when the request's output so far is a complete JSON value of the schema."""
        m = self._matchers.get(seq)
        return m is not None and (m.is_terminated() or m.is_completed())

    def release(self, seq: int) -> None:
        self._matchers.pop(seq, None)
