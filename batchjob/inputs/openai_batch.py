"""OpenAI Batch API files: requests in (``input.path`` ending in .jsonl), responses out.

Requests: one JSON object a line, ``{"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body": {"model", "messages" | "prompt", ...}}``,
one url for the whole file (as the Batch API requires). Lines become rows of an Arrow table,
in line order (row_id = request index): ``custom_id``, ``line``, ``url``, ``model``,
``messages`` (list<struct<role, content>>) or ``prompt``, and one column per honoured body
field: ``max_tokens`` (``max_completion_tokens`` too), ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop``, ``n``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias`` and vLLM's ``repetition_penalty``, ``min_p``, ``min_tokens`` (the per-row
settings, ``input.*_column``, which a .jsonl input names itself), ``logprobs`` and
``top_logprobs`` (checked against ``sampling.logprobs``, written by the output side),
``json_schema`` (from ``response_format``; runs through ``input.json_schema_column``). Chat
messages go through the model's chat template (``inputs.prompt_builder``); a
``/v1/completions`` prompt reaches the model as raw text, whatever the chat settings.

A line that is not valid JSON or not a valid request, or that asks for anything this job
does not honour (``best_of`` > 1, tools, ``echo``, ``suffix``, more log-probs than
``sampling.logprobs``, ...), becomes a row with status ``invalid_request`` and a message naming
the line and the field (its result row and its error line are still written). A field set to
null, or to the value that changes nothing (``best_of: 1``, ``stream: false``), is fine.

Responses (``output.format = "openai-jsonl"``, ``batchjob.outputs.openai_batch``): written
from the committed Parquet results (the source of truth for resume), keyed by ``custom_id``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import pyarrow as pa

from batchjob.config import MAX_LOGPROBS, InputConfig, ModelConfig, SamplingConfig
from batchjob.errors import InputDataError
from batchjob.inputs.prompt_builder import ERROR_COLUMN, make_builder
from batchjob.inputs.table import TableDataset, open_table
from batchjob.status import STATUS_INVALID_REQUEST

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
JSON_OBJECT_SCHEMA = '{"type":"object"}'  # response_format {"type": "json_object"}


_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"([^"\\]+)"')

# body fields read into columns, per endpoint; "model", "user" and "metadata" identify the
# request and change nothing in its output
_HONOURED = {"model", "user", "metadata", "max_tokens", "max_completion_tokens", "temperature"}
_HONOURED |= {"top_p", "top_k", "seed", "stop", "logprobs", "n"}
# OpenAI's penalties and logit_bias, and the sampling fields vLLM's server takes besides
_PROCESSOR_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_HONOURED |= {*_PROCESSOR_FIELDS, "min_tokens", "logit_bias"}
_FIELDS = {
    CHAT_URL: _HONOURED | {"messages", "top_logprobs", "response_format"},
    COMPLETIONS_URL: _HONOURED | {"prompt"},
}
# fields not honoured, fine at the value that changes nothing; anything else: invalid_request
_NO_EFFECT: dict[str, tuple[Any, str]] = {
    "best_of": (1, "one choice per request"),
    "stream": (False, "a batch is not streamed"),
    "echo": (False, "the prompt is not echoed"),
    "suffix": ("", "suffix is not implemented"),
    "parallel_tool_calls": (False, "tools are not implemented"),
}


class _Bad(ValueError):
    """A request line that cannot run (message without the line number)."""


def _content(v: Any) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", ...})."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in v):
        return "".join(str(p.get("text", "")) for p in v)
    raise _Bad("message content must be a string or a list of text parts")


def _number(body: dict, key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _Bad(f"body.{key} must be a number, got {v!r}")
    return float(v)


def _logit_bias(v: Any) -> list[tuple[int, float]] | None:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs; ids and biases checked
    against the model later, with the row's other settings."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _Bad(f"body.logit_bias must be an object of token id: bias, got {v!r}")
    pairs = []
    for k, b in v.items():
        if not re.fullmatch(r"[0-9]+", str(k)) or int(k) >= 2**31:
            raise _Bad(f"body.logit_bias key {k!r} is not a token id")
        if isinstance(b, bool) or not isinstance(b, int | float) or not math.isfinite(b):
            raise _Bad(f"body.logit_bias[{k!r}] must be a number, got {b!r}")
        pairs.append((int(k), float(b)))
    return pairs


def _int64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _unhonoured(url: str, body: dict) -> None:
    """_Bad naming the first body field this request sets that batchjob does not honour."""
    for key, v in body.items():
        if v is None or key in _FIELDS[url]:
            continue
        if key in _NO_EFFECT:
            default, why = _NO_EFFECT[key]
            if v == default and type(v) in (type(default), int, float):
                continue
            raise _Bad(f"body.{key} = {v!r} is not honoured ({why}); leave it out or {default!r}")
        raise _Bad(f"body.{key} is not honoured by batchjob (not implemented); leave it out")


def _logprobs(url: str, body: dict) -> tuple[bool | None, int | None]:
    """-> (the request asks for log-probs: True/False, None when it says nothing; how many
    top tokens, None when it says nothing)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if url == COMPLETIONS_URL:  # logprobs: N, the top N of each token (legacy completions)
        if lp is None:
            return None, None
        if not _int64(lp) or not 0 <= lp <= MAX_LOGPROBS:
            raise _Bad(f"body.logprobs must be an integer in [0, {MAX_LOGPROBS}], got {lp!r}")
        return True, lp
    if lp is not None and not isinstance(lp, bool):
        raise _Bad(f"body.logprobs must be true or false, got {lp!r}")
    if top is not None:
        if not _int64(top) or not 0 <= top <= MAX_LOGPROBS:
            raise _Bad(f"body.top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
        if lp is not True:
            raise _Bad("body.top_logprobs needs body.logprobs = true")
    return lp, top


def _json_schema(body: dict) -> str | None:
    """response_format -> the row's JSON schema text (None: free text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _Bad("body.response_format.json_schema.schema must be a JSON object")
        return json.dumps(schema, separators=(",", ":"), sort_keys=True)
    raise _Bad(
        f'body.response_format.type must be "text", "json_object" or "json_schema", got {kind!r}'
    )


def _request(obj: Any) -> dict[str, Any]:
    """One parsed line -> its row (raises _Bad)."""
    if not isinstance(obj, dict):
        raise _Bad("a request must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise _Bad("custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise _Bad(f"method must be POST, got {obj.get('method')!r}")
    url, body = obj.get("url"), obj.get("body")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise _Bad(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    if not isinstance(body, dict):
        raise _Bad("body must be a JSON object")
    row: dict[str, Any] = {"custom_id": cid, "url": url, "model": body.get("model")}
    if not isinstance(row["model"], str | None):
        raise _Bad("body.model must be a string")
    if url == CHAT_URL:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _Bad("body.messages must be a non-empty list")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
            raise _Bad("each message needs a string role")
        row["messages"] = [{"role": m["role"], "content": _content(m.get("content"))} for m in msgs]
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1:
            p = p[0]
        if not isinstance(p, str):
            raise _Bad("body.prompt must be a string (one prompt per request)")
        row["prompt"] = p
    _unhonoured(url, body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(key)  # the newer max_completion_tokens wins where both are set
    if mt is not None and not _int64(mt):
        raise _Bad(f"body.{key} must be an integer, got {mt!r}")
    row.update(max_tokens=mt, temperature=_number(body, "temperature"))
    row["top_p"] = _number(body, "top_p")
    seed, stop, top_k = body.get("seed"), body.get("stop"), body.get("top_k")
    if seed is not None and not _int64(seed):
        raise _Bad(f"body.seed must be an integer, got {seed!r}")
    if top_k is not None and not _int64(top_k):
        raise _Bad(f"body.top_k must be an integer, got {top_k!r}")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise _Bad(f"body.stop must be a string or a list of strings, got {stop!r}")
    n, min_tokens = body.get("n"), body.get("min_tokens")
    if n is not None and not _int64(n):
        raise _Bad(f"body.n must be an integer, got {n!r}")
    if min_tokens is not None and not _int64(min_tokens):
        raise _Bad(f"body.min_tokens must be an integer, got {min_tokens!r}")
    for key in _PROCESSOR_FIELDS:
        row[key] = _number(body, key)
    row["min_tokens"] = min_tokens
    row["logit_bias"] = _logit_bias(body.get("logit_bias"))
    row.update(seed=seed, stop=stop, top_k=0 if top_k == -1 else top_k)  # vLLM's -1: off
    row["n"] = n  # choices: one sample each (sampling.n, through input.n_column)
    row["logprobs"], row["top_logprobs"] = _logprobs(url, body)
    row["json_schema"] = _json_schema(body)
    return row


def read_requests(path: str) -> tuple[pa.Table, str]:
    """-> (one row per request line, the file's url). InputDataError: unreadable file, no
    request, or two endpoints in one file."""
    rows: list[dict[str, Any]] = []
    url0: str | None = None
    seen: dict[str, int] = {}
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below); decoded per line
    except OSError as e:
        raise InputDataError(f"input.path: cannot read {path}: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            obj: Any = None
            line = raw.decode("utf-8", errors="replace")
            try:
                obj = json.loads(raw)  # bytes: invalid UTF-8 is a JSON error of this line
                row = _request(obj)
                if url0 is None:
                    url0 = row["url"]
                elif row["url"] != url0:
                    raise InputDataError(
                        f"{path}: line {lineno}: url {row['url']} differs from {url0} of the "
                        "first request; one batch file holds requests for one endpoint"
                    )
                if row["custom_id"] in seen:
                    raise _Bad(
                        f"custom_id {row['custom_id']!r} repeats line {seen[row['custom_id']]}"
                    )
                seen[row["custom_id"]] = lineno
                row[ERROR_COLUMN] = None
            except (ValueError, UnicodeDecodeError) as e:
                what = "invalid JSON" if isinstance(e, json.JSONDecodeError) else "bad request"
                cid = obj.get("custom_id") if isinstance(obj, dict) else None
                if obj is None and (m := _CUSTOM_ID.search(line)):  # broken JSON: best effort
                    cid = m.group(1)
                row = {"custom_id": cid if isinstance(cid, str) else None}
                row[ERROR_COLUMN] = f"{STATUS_INVALID_REQUEST}\tline {lineno}: {what}: {e}"
            row["line"] = lineno
            rows.append(row)
    if not rows:
        raise InputDataError(f"input.path: {path} holds no request lines")
    url = url0 or CHAT_URL
    chat = url == CHAT_URL
    cols: dict[str, pa.Array] = {
        "custom_id": pa.array([r.get("custom_id") for r in rows], pa.string()),
        "line": pa.array([r["line"] for r in rows], pa.int64()),
        "url": pa.array([url] * len(rows), pa.string()),
        "model": pa.array([r.get("model") for r in rows], pa.string()),
        ("messages" if chat else "prompt"): pa.array(
            [r.get("messages" if chat else "prompt") for r in rows],
            MESSAGES_TYPE if chat else pa.string(),
        ),
        "max_tokens": pa.array([r.get("max_tokens") for r in rows], pa.int64()),
        "temperature": pa.array([r.get("temperature") for r in rows], pa.float64()),
        "top_p": pa.array([r.get("top_p") for r in rows], pa.float64()),
        "top_k": pa.array([r.get("top_k") for r in rows], pa.int64()),
        "seed": pa.array([r.get("seed") for r in rows], pa.int64()),
        "n": pa.array([r.get("n") for r in rows], pa.int64()),
        **{k: pa.array([r.get(k) for r in rows], pa.float64()) for k in _PROCESSOR_FIELDS},
        "min_tokens": pa.array([r.get("min_tokens") for r in rows], pa.int64()),
        "logit_bias": pa.array(
            [r.get("logit_bias") for r in rows], pa.map_(pa.int32(), pa.float64())
        ),
        "stop": pa.array([r.get("stop") for r in rows], pa.list_(pa.string())),
        "logprobs": pa.array([r.get("logprobs") for r in rows], pa.bool_()),
        "top_logprobs": pa.array([r.get("top_logprobs") for r in rows], pa.int64()),
        "json_schema": pa.array([r.get("json_schema") for r in rows], pa.string()),
        ERROR_COLUMN: pa.array([r[ERROR_COLUMN] for r in rows], pa.string()),
    }
    return pa.table(cols), url


def _job_checks(table: pa.Table, cfg: InputConfig, sampling: SamplingConfig) -> pa.Table:
    """Rows asking for what this job does not compute -> invalid_request naming the field:
    log-probs beyond ``sampling.logprobs``, a response_format without
    ``input.json_schema_column``."""
    errors = table.column(ERROR_COLUMN).to_pylist()
    lines = table.column("line").to_pylist()
    asks = table.column("logprobs").to_pylist()
    tops = table.column("top_logprobs").to_pylist()
    schemas = table.column("json_schema").to_pylist()
    chat = table.column("url")[0].as_py() == CHAT_URL
    n = sampling.logprobs
    changed = False
    for i, (err, ask, top, schema) in enumerate(zip(errors, asks, tops, schemas, strict=True)):
        why = None
        field = "top_logprobs" if chat and top is not None else "logprobs"
        if err is not None:
            continue
        if ask and n is None:
            why = (
                f"body.{field}: this job computes no log-probabilities "
                f"(set sampling.logprobs = {top or 0} or more)"
            )
        elif ask and top is not None and n is not None and top > n:
            why = f"body.{field} = {top} is more than this job's sampling.logprobs = {n}"
        elif schema is not None and cfg.json_schema_column is None:
            why = (
                "body.response_format: structured output is off in this job "
                '(set input.json_schema_column = "json_schema"; needs xgrammar)'
            )
        if why is not None:
            errors[i] = f"{STATUS_INVALID_REQUEST}\tline {lines[i]}: bad request: {why}"
            changed = True
    if not changed:
        return table
    idx = table.schema.get_field_index(ERROR_COLUMN)
    return table.set_column(idx, ERROR_COLUMN, pa.array(errors, pa.string()))


def open_requests(
    cfg: InputConfig, model: ModelConfig | None, sampling: SamplingConfig | None = None
) -> TableDataset:
    """The request file as an in-memory dataset (Batch API files are at most 200 MB).
    ``sampling``: the job's, to refuse rows asking for more log-probs than it computes
    (None: metadata only)."""
    if not os.path.isfile(cfg.path):
        raise InputDataError(f"input.path: {cfg.path!r} is not a file")
    table, url = read_requests(cfg.path)
    if sampling is not None:
        table = _job_checks(table, cfg, sampling)
    chat = url == CHAT_URL
    builder = make_builder(
        cfg,
        model,
        messages_col="messages" if chat else None,
        prompt_column=None if chat else "prompt",
        error_column=ERROR_COLUMN,
        chat_prompts=chat,  # a /v1/completions prompt is raw text, never a chat turn
    )
    columns = dataclasses.replace(
        cfg, prompt_column="messages" if chat else "prompt", max_tokens_column="max_tokens"
    )
    return open_table(columns, model, table, name=cfg.path, builder=builder)


# ---------------------------------------------------------------------------------------
# responses
