"""What an OpenAI Batch request file asks a job to compute, read before the job is built:
the most top log-probs any request asks for, and whether a request constrains its output
(``response_format``). A value the Batch reader refuses (``batchjob.inputs.openai_batch``:
that request's ``invalid_request``) asks for nothing here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from batchjob.config.sections import MAX_LOGPROBS

COMPLETIONS_URL = "/v1/completions"  # logprobs: N there; chat: logprobs true + top_logprobs
_CONSTRAINED = ("json_object", "json_schema")


@dataclass(frozen=True)
class RequestAsks:
    logprobs: int | None  # the most top log-probs a request asks (0: its tokens' only)
    json_schema: bool  # a request has a response_format constraining its output


def _count(v: Any) -> int | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS
    return v if ok else None


def _asks(url: Any, body: dict) -> int | None:
    """The top log-probs ``body`` asks for, None when it asks for none."""
    lp = body.get("logprobs")
    if url == COMPLETIONS_URL:
        return _count(lp)
    if lp is not True:
        return None
    top = body.get("top_logprobs")
    return 0 if top is None else _count(top)


def requests_ask(path: str) -> RequestAsks:
    """One pass over the request lines of ``path`` (unreadable lines skipped)."""
    most: int | None = None
    schema = False
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw) if raw.strip() else None
            except (ValueError, UnicodeDecodeError):
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("body"), dict):
                continue
            body = obj["body"]
            n = _asks(obj.get("url"), body)
            if n is not None:
                most = max(most or 0, n)
            rf = body.get("response_format")
            schema = schema or (isinstance(rf, dict) and rf.get("type") in _CONSTRAINED)
    return RequestAsks(most, schema)
