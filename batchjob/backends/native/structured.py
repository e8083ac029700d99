"""Structured output on the native engine: constrained decoding with xgrammar, by a JSON
schema, a regex or a list of choices (``batchjob.config.guided.Guide``).

Each distinct guide (``sampling.json_schema`` / ``regex`` / ``choice``, or a row's own from
``input.json_schema_column`` / ``regex_column`` / ``choice_column``) is compiled once against
the model's tokenizer: a schema as compact JSON, a regex with xgrammar's regex compiler, a
choice list as the EBNF grammar vLLM builds from it. Each running request gets its own
``GrammarMatcher``; rows without a guide are left free. Per sampling step the engine fills
the token bitmask of the constrained rows, applies it to their logits (disallowed tokens ->
-inf) before sampling, and feeds the sampled token back with ``accept``. EOS is allowed only
once the output is complete; a request that reaches ``max_tokens`` before that finishes
"length" with status ``json_incomplete``, ``regex_incomplete`` or ``choice_incomplete``.

With ``output.reasoning_parser`` (``reasoning``), a row whose prompt leaves it inside its
reasoning is free until it generates ``</think>``; its guide constrains what follows (the
end token itself is not fed to the grammar), as vLLM's structured output does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchjob.config.guided import Guide
from batchjob.status import STATUS_INCOMPLETE

_UNFINISHED = {
    "json": "the JSON output is incomplete",
    "regex": "the output does not match the regex yet",
    "choice": "the output is not one of the choices yet",
}


class GrammarConstraint:
    """The compiled guides and the live matchers of the requests they constrain."""

    def __init__(
        self,
        model_path: str | Path,
        guides: Guide | Sequence[Guide | None],
        vocab_size: int,
        eos_ids: Sequence[int],
        stop_ids: Sequence[int] = (),
        reasoning: tuple[int, Sequence[int]] | None = None,
    ) -> None:
        """``guides``: one for every request, or one per prompt position (None: free).
        ``stop_ids``: ``sampling.stop_token_ids``; with EOS they may end a complete output
        (vLLM gives its grammars every stop id of the request). ``reasoning``: (the
        ``</think>`` id, the positions that start inside their reasoning)."""
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_path) / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab_size, stop_token_ids=list(eos_ids)
        )
        self._xgr = xgr
        self.vocab_size = vocab_size
        self._stops = sorted({*eos_ids, *stop_ids})
        self._compiler = xgr.GrammarCompiler(info)
        self._guides = guides
        self._compiled: dict[Guide, Any] = {}  # guide -> xgrammar.CompiledGrammar
        # xgrammar's JSON strings admit raw control bytes (< 0x20), which strict JSON parsers
        # (Python's json, jsonschema users) reject: for JSON, ban every token containing one;
        # compact JSON never needs them (escapes such as \u0004 stay possible)
        self._bytes: list[bytes] = list(info.decoded_vocab)
        ban = [i for i, b in enumerate(self._bytes) if _bad_utf8_pair(b)]
        control = [i for i, b in enumerate(self._bytes) if any(c < 0x20 for c in b)]
        self._ban = torch.tensor(sorted(set(ban)), dtype=torch.long)
        self._ban_json = torch.tensor(sorted({*ban, *control}), dtype=torch.long)
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
        self._end_id = reasoning[0] if reasoning is not None else -1
        self._thinking: set[int] = set(reasoning[1]) if reasoning is not None else set()

    def guide(self, seq: int) -> Guide | None:
        return self._guides if isinstance(self._guides, Guide) else self._guides[seq]

    def constrained(self, n: int) -> np.ndarray:
        """bool [n]: which of the ``n`` prompt positions have a guide."""
        if isinstance(self._guides, Guide):
            return np.ones(n, dtype=bool)
        return np.fromiter((g is not None for g in self._guides), dtype=bool, count=n)

    def _compile(self, guide: Guide):
        if guide.kind == "json":  # compact JSON (no free whitespace): no padding forever
            return self._compiler.compile_json_schema(
                guide.spec, any_whitespace=False, separators=(",", ":")
            )
        if guide.kind == "regex":
            return self._compiler.compile_regex(guide.spec)
        return self._compiler.compile_grammar(guide.grammar())

    def _matcher(self, seq: int):
        """The request's matcher; None for a request without a guide."""
        m = self._matchers.get(seq)
        if m is None:
            guide = self.guide(seq)
            if guide is None:
                return None
            compiled = self._compiled.get(guide)
            if compiled is None:
                compiled = self._compiled[guide] = self._compile(guide)
            m = self._matchers[seq] = self._xgr.GrammarMatcher(
                compiled, override_stop_tokens=self._stops
            )
        return m

    def mask(self, logits: torch.Tensor, seqs: Sequence[int]) -> None:
        """Set to -inf, in place, the logits of the tokens each row's grammar forbids now."""
        guides = [self.guide(s) for s in seqs]
        thinking = self._thinking
        rows = [j for j, g in enumerate(guides) if g is not None and seqs[j] not in thinking]
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
        for ban, kinds in ((self._ban_json, ("json",)), (self._ban, ("regex", "choice"))):
            sel = [j for j in rows if guides[j].kind in kinds]  # type: ignore[union-attr]
            if sel and len(ban):
                r = torch.tensor(sel, dtype=torch.long, device=logits.device)
                logits[r[:, None], ban.to(logits.device)[None, :]] = float("-inf")
        for j, s in enumerate(seqs):
            lead = self._pending.get(s)
            if lead is not None:
                logits[j, self._after[lead].to(logits.device)] = float("-inf")

    def accept(self, seq: int, token: int) -> bool:
        """Feed the sampled token; True once the output is complete and closed by EOS."""
        if seq in self._thinking:  # reasoning: free, until its end token
            if token == self._end_id:
                self._thinking.discard(seq)
            return False
        m = self._matcher(seq)
        if m is None:
            return False
        if not m.accept_token(int(token)):
            raise RuntimeError(f"request {seq}: token {token} rejected by its grammar")
        done = m.is_terminated()
        b = self._bytes[token] if token < len(self._bytes) and not done else b""
        self._out.setdefault(seq, bytearray()).extend(b)
        if b and b[-1] in _SECOND_BYTE:
            self._pending[seq] = b[-1]
        elif b:
            self._pending.pop(seq, None)
        return done

    def problem(self, seq: int) -> tuple[str, str] | None:
        """(status, why) when the request's output is not complete and valid (None: it is)."""
        guide = self.guide(seq)
        if guide is None:
            return None
        status = STATUS_INCOMPLETE[guide.kind]
        if seq in self._thinking:
            return status, "the reasoning did not end (no </think>)"
        m = self._matchers.get(seq)
        if m is None or not (m.is_terminated() or m.is_completed()):
            return status, _UNFINISHED[guide.kind]
        try:
            bytes(self._out.get(seq, b"")).decode("utf-8")
        except UnicodeDecodeError as e:  # safety net: the masks above should prevent it
            return status, f"the output is not valid UTF-8 ({e.reason})"
        return None

    def release(self, seq: int) -> None:
        self._thinking.discard(seq)
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
