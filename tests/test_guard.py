"""batchjob.guard: the per-row limits on code a model folder or a user brings. Native compiles
run in the guard process: one past MAX_SECONDS or MAX_BYTES costs its row (LimitError, a
ValueError) and the process is replaced; the chat template shares the same limits."""

from __future__ import annotations

import time

import pytest

from batchjob import guard
from batchjob.config.guided import check_regex
from batchjob.config.json_schema import compact_json_schema

pytest.importorskip("xgrammar")


def nested_schema(levels: int) -> str:
    """An object nested ``levels`` deep: xgrammar's build time grows about as levels**3
    (450: ~28 s on one busy core; before the guard it held the reader that long, 2,000 levels
    with no end in sight)."""
    head = '{"type":"object","properties":{"a":'
    return head * levels + '{"type":"string"}' + "}}" * levels


def test_a_runaway_schema_compile_is_stopped_at_the_limit() -> None:
    assert compact_json_schema('{"type": "string"}') == '{"type":"string"}'  # warm
    t0 = time.monotonic()
    with pytest.raises(guard.LimitError, match=r"JSON schema took more than 2 s"):
        compact_json_schema(nested_schema(450))
    assert time.monotonic() - t0 < guard.MAX_SECONDS + 3
    assert check_regex("[a-z]+") == "[a-z]+"  # the replacement process answers
    with pytest.raises(ValueError, match="not a usable regex"):
        check_regex("a(")


def test_sizes_past_the_limit_are_refused_before_compiling() -> None:
    big = '{"enum": ["' + "x" * guard.MAX_CHARS + '"]}'
    with pytest.raises(guard.LimitError, match="more than 16777216"):
        compact_json_schema(big)
    with pytest.raises(ValueError, match="nested too deeply"):  # was a RecursionError
        compact_json_schema(nested_schema(2000))


def test_memory_past_the_limit_costs_the_call_only() -> None:
    with pytest.raises(guard.LimitError, match="more than 2 GiB of memory"):
        guard.bounded("allocating", "builtins", "bytearray", guard.MAX_BYTES + (1 << 30))
    assert guard.bounded("a sum", "builtins", "sum", [1, 2, 3]) == 6


def test_the_chat_template_shares_the_limits() -> None:
    from batchjob.inputs import chat_template

    assert chat_template.MAX_RENDER_SECONDS == guard.MAX_SECONDS
    assert chat_template.MAX_RENDER_CHARS == guard.MAX_CHARS
    assert issubclass(chat_template.RenderLimitError, guard.LimitError)
