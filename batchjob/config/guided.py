"""Guided decoding beyond JSON: a regex or a list of choices the output must match, checked
and turned into what xgrammar (the grammar engine of both backends) compiles. Used by
``sampling.regex`` / ``sampling.choice`` (a bad one: exit 3) and ``input.regex_column`` /
``input.choice_column`` (a bad one rejects its row).

``Guide`` names one row's constraint, whatever its kind (``json``, ``regex``, ``choice``); the
backends compile each distinct guide once. A choice list becomes the EBNF grammar
``root ::= "a" | "b"`` (each string a literal, escaped), as vLLM builds it from
``StructuredOutputsParams.choice``, so both backends constrain the same way.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchjob.guard import bounded, check_size

GUIDE_KINDS = ("json", "regex", "choice")
GUARD_PRELOAD = ("xgrammar",)  # what the guard process imports before its first build


@dataclass(frozen=True)
class Guide:
    """One constraint on a row's output."""

    kind: str  # json | regex | choice
    spec: str  # compact JSON schema | the regex | the choices as a JSON list

    @property
    def choices(self) -> list[str]:
        return list(json.loads(self.spec)) if self.kind == "choice" else []

    def grammar(self) -> str:
        """The EBNF grammar of a choice guide (``compile_grammar``'s input)."""
        return choice_grammar(self.choices)


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's error without its "[time] /path/file.cc:N: " prefix, first line only."""
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)[:200]


def grammar_error(kind: str, spec: str) -> str | None:
    """What xgrammar says building the grammar of a ``kind`` guide ("json": a schema,
    "regex", "ebnf"), None when it builds. ImportError without xgrammar. Run through
    ``batchjob.guard.bounded``: a build may take unbounded time or memory."""
    import xgrammar

    names = {"json": "from_json_schema", "regex": "from_regex", "ebnf": "from_ebnf"}
    build: Callable[[str], Any] = getattr(xgrammar.Grammar, names[kind])
    try:
        build(spec)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError on what it cannot parse
        return _xgrammar_message(e)
    return None


def bounded_grammar_error(kind: str, spec: str, what: str) -> str | None:
    """``grammar_error`` within the per-row limits (batchjob.guard): LimitError naming
    ``what`` when the text or the build passes them."""
    check_size(len(spec), what)
    return bounded(what, __name__, "grammar_error", kind, spec)


@functools.lru_cache(maxsize=4096)  # a job's per-row settings re-check its regex per setting
def check_regex(pattern: str) -> str:
    """``pattern`` if xgrammar compiles it; ValueError saying why not (ImportError without
    xgrammar; LimitError past the per-row limits). A NUL character is refused as vLLM
    refuses it."""
    if "\x00" in pattern:
        raise ValueError("a regex must not contain a NUL character")
    if (why := bounded_grammar_error("regex", pattern, "compiling the regex")) is not None:
        raise ValueError(f"not a usable regex: {why}")
    return pattern


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal: quotes, backslashes and control characters escaped."""
    named = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = []
    for ch in text:
        if ch in named:
            out.append(named[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose only sentences are ``choices``."""
    return "root ::= " + " | ".join(_literal(c) for c in choices)


def check_choices(choices: tuple[str, ...] | list[str]) -> str:
    """The choices as the JSON list a ``Guide`` holds; ValueError when the list is empty, holds
    an empty string or a duplicate, or does not compile (ImportError without xgrammar)."""
    return _check_choices(tuple(choices))


@functools.lru_cache(maxsize=4096)
def _check_choices(choices: tuple[str, ...]) -> str:
    if not choices:
        raise ValueError("needs at least one choice")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices must be non-empty strings")
    if len(set(choices)) != len(choices):
        raise ValueError("choices must be distinct")
    grammar = choice_grammar(list(choices))
    if (why := bounded_grammar_error("ebnf", grammar, "compiling the choices")) is not None:
        raise ValueError(f"the choices do not compile: {why}")
    return json.dumps(list(choices), ensure_ascii=False)
