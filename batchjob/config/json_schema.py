"""A JSON schema text checked and made canonical for structured output: parsed, an object,
compacted (sorted keys), and compilable by xgrammar (the grammar engine of both backends).
Used by ``sampling.json_schema`` (a bad one: exit 3) and ``input.json_schema_column`` (a bad
one rejects its row)."""

from __future__ import annotations

import json

from batchjob.config.guided import bounded_grammar_error
from batchjob.guard import check_size

XGRAMMAR_HINT = "structured output needs xgrammar: pip install 'batchjob[structured]'"


def compact_json_schema(text: str, vllm: bool = False) -> str:
    """The schema as compact JSON; ValueError saying what is wrong (LimitError past the
    per-row limits of batchjob.guard), ImportError without xgrammar. ``vllm``: also refuse
    the features vLLM's xgrammar backend refuses at submission (xgrammar itself ignores
    some, e.g. ``multipleOf``)."""
    check_size(len(text), "the JSON schema")
    try:
        schema = json.loads(text)
    except RecursionError:
        raise ValueError("invalid JSON: nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"invalid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    compact = json.dumps(schema, separators=(",", ":"), sort_keys=True)
    why = bounded_grammar_error("json", compact, "compiling the JSON schema")
    if why is not None:
        raise ValueError(f"not a usable JSON schema: {why}")
    if vllm:
        from vllm.v1.structured_output.backend_xgrammar import (
            has_xgrammar_unsupported_json_features,
        )

        try:
            unsupported = has_xgrammar_unsupported_json_features(schema)
        except RecursionError:
            raise ValueError("nested too deeply for vLLM's schema check") from None
        if unsupported:
            raise ValueError(
                "uses a JSON Schema feature vLLM's xgrammar backend refuses (multipleOf, "
                "uniqueItems/contains, an unsupported string format, pattern with lengths, ...)"
            )
    return compact
