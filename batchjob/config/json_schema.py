"""A JSON schema text checked and made canonical for structured output: parsed, an object,
compacted (sorted keys), and compilable by xgrammar (the grammar engine of both backends).
Used by ``sampling.json_schema`` (a bad one: exit 3) and ``input.json_schema_column`` (a bad
one rejects its row)."""

from __future__ import annotations

import json

XGRAMMAR_HINT = "structured output needs xgrammar: pip install 'batchjob[structured]'"


def compact_json_schema(text: str, vllm: bool = False) -> str:
    """The schema as compact JSON; ValueError saying what is wrong, ImportError without
    xgrammar. ``vllm``: also refuse the features vLLM's xgrammar backend refuses at
    submission (xgrammar itself ignores some, e.g. ``multipleOf``)."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"invalid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    compact = json.dumps(schema, separators=(",", ":"), sort_keys=True)
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(compact)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError on a bad schema
        raise ValueError(f"not a usable JSON schema: {str(e).splitlines()[0][:200]}") from None
    if vllm:
        from vllm.v1.structured_output.backend_xgrammar import (
            has_xgrammar_unsupported_json_features,
        )

        if has_xgrammar_unsupported_json_features(schema):
            raise ValueError(
                "uses a JSON Schema feature vLLM's xgrammar backend refuses (multipleOf, "
                "uniqueItems/contains, an unsupported string format, pattern with lengths, ...)"
            )
    return compact
