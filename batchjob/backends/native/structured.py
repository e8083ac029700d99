"""Structured output on the native engine: JSON-schema constrained decoding with xgrammar.

The schema is compiled once per distinct schema (``sampling.json_schema``, or each row's own
from ``input.json_schema_column``) against the model's tokenizer; each running request gets
its own ``GrammarMatcher``; rows without a schema are left free. Per sampling step the engine
fills the token bitmask of the constrained rows, applies it to their logits (disallowed
tokens -> -inf) before sampling, and feeds the sampled token back with ``accept``. EOS is
allowed only once the JSON is complete; a request that reaches ``max_tokens`` before that
finishes "length" with status ``json_incomplete``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


class JsonConstraint:
    """A compiled JSON schema and the live matchers of the requests it constrains."""

    def __init__(
        self,
        model_path: str | Path,
        schemas: str | Sequence[str | None],
        vocab_size: int,
        eos_ids: Sequence[int],
    ) -> None:
        """``schemas``: one for every request, or one per prompt position (None: free)."""
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_path) / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab_size, stop_token_ids=list(eos_ids)
        )
        self._xgr = xgr
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info)
        self._schemas = schemas
        self._compiled: dict[str, Any] = {}  # schema text -> xgrammar.CompiledGrammar
        # xgrammar's JSON strings admit raw control bytes (< 0x20), which strict JSON parsers
        # (Python's json, jsonschema users) reject: ban every token containing one; compact
        # JSON never needs them (escapes such as \u0004 stay possible)
        ban = [i for i, b in enumerate(info.decoded_vocab) if any(c < 0x20 for c in b)]
        self._bytes: list[bytes] = list(info.decoded_vocab)
        ban += [i for i, b in enumerate(self._bytes) if _bad_utf8_pair(b)]
        self._ban = torch.tensor(sorted(set(ban)), dtype=torch.long)
        # xgrammar admits any lead byte + continuation bytes, so surrogates (ED A0..BF) and
        # overlong/out-of-range forms slip through: after a token ending in such a lead
        # byte, ban the tokens whose first byte may not follow it
        self._after = {
            lead: torch.tensor(
                [i for i, b in enumerate(self._bytes) if b and not lo <= b[0] <= hi],
                dtype=torch.long,
            )
            for lead, (lo, hi) in _SECOND_BYTE.items()
        }
        self._pending: dict[int, int] = {}  # seq -> its output's trailing special lead byte
        self._out: dict[int, bytearray] = {}  # seq -> its output's bytes so far
        self._matchers: dict[int, Any] = {}  # xgrammar.GrammarMatcher (untyped)

    def schema(self, seq: int) -> str | None:
        return self._schemas if isinstance(self._schemas, str) else self._schemas[seq]

    def _matcher(self, seq: int):
        """The request's matcher; None for a request without a schema."""
        m = self._matchers.get(seq)
        if m is None:
            schema = self.schema(seq)
            if schema is None:
                return None
            compiled = self._compiled.get(schema)
            if compiled is None:
                # compact JSON (no free whitespace): a weak model cannot pad forever
                compiled = self._compiled[schema] = self._compiler.compile_json_schema(
                    schema, any_whitespace=False, separators=(",", ":")
                )
            m = self._matchers[seq] = self._xgr.GrammarMatcher(compiled)
        return m

    def mask(self, logits: torch.Tensor, seqs: Sequence[int]) -> None:
        """Set to -inf, in place, the logits of the tokens each row's grammar forbids now."""
        rows = [j for j, s in enumerate(seqs) if self.schema(s) is not None]
        if not rows:
            return
        bitmask = self._xgr.allocate_token_bitmask(len(seqs), self.vocab_size)
        for j in rows:
            self._matcher(seqs[j]).fill_next_token_bitmask(bitmask, j)
        idx = None if len(rows) == len(seqs) else rows
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            self._xgr.apply_token_bitmask_inplace(
                logits, bitmask, vocab_size=self.vocab_size, indices=idx
            )
        else:  # the CPU kernel takes float32 only: mask through a float32 copy
            x = logits.float().cpu()
            self._xgr.apply_token_bitmask_inplace(
                x, bitmask, vocab_size=self.vocab_size, indices=idx
            )
            logits.copy_(x.to(logits.device, logits.dtype))
        if len(self._ban):
            r = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[r[:, None], self._ban.to(logits.device)[None, :]] = float("-inf")
        for j, s in enumerate(seqs):
            lead = self._pending.get(s)
            if lead is not None:
                logits[j, self._after[lead].to(logits.device)] = float("-inf")

    def accept(self, seq: int, token: int) -> bool:
        """Feed the sampled token; True once the JSON is complete and closed by EOS."""
        m = self._matcher(seq)
        if m is None:
            return False
        if not m.accept_token(int(token)):
            raise RuntimeError(f"request {seq}: token {token} rejected by its JSON grammar")
        done = m.is_terminated()
        b = self._bytes[token] if token < len(self._bytes) and not done else b""
        self._out.setdefault(seq, bytearray()).extend(b)
        if b and b[-1] in _SECOND_BYTE:
            self._pending[seq] = b[-1]
        elif b:
            self._pending.pop(seq, None)
        return done

    def problem(self, seq: int) -> str | None:
        """Why the request's output is not a complete, valid JSON value (None: it is)."""
        if self.schema(seq) is None:
            return None
        m = self._matchers.get(seq)
        if m is None or not (m.is_terminated() or m.is_completed()):
            return "the JSON output is incomplete"
        try:
            bytes(self._out.get(seq, b"")).decode("utf-8")
        except UnicodeDecodeError as e:  # safety net: the masks above should prevent it
            return f"the JSON output is not valid UTF-8 ({e.reason})"
        return None

    def release(self, seq: int) -> None:
        self._matchers.pop(seq, None)
        self._pending.pop(seq, None)
        self._out.pop(seq, None)


# the allowed second byte after the UTF-8 lead bytes with a narrower range than 80..BF
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _bad_utf8_pair(b: bytes) -> bool:
    """True when ``b`` holds one of those lead bytes followed by a byte it may not take, or a
    byte that never occurs in UTF-8 (C0, C1, F5..FF)."""
    if any(c in (0xC0, 0xC1) or c >= 0xF5 for c in b):
        return True
    return any(
        c in _SECOND_BYTE and not _SECOND_BYTE[c][0] <= n <= _SECOND_BYTE[c][1]
        for c, n in itertools.pairwise(b)
    )
