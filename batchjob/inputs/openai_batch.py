"""OpenAI Batch API files: requests in (``input.path`` ending in .jsonl), responses out.

Requests: one JSON object a line, ``{"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body": {"model", "messages" | "prompt",
"max_tokens", "temperature", "top_p", ...}}``, one url for the whole file (as the Batch API
requires). Lines become rows of an Arrow table, in line order (row_id = request index):
``custom_id``, ``url``, ``model``, ``messages`` (list<struct<role, content>>) or ``prompt``,
``max_tokens`` (``max_completion_tokens`` too), ``temperature``, ``top_p``; chat messages go
through the model's chat template (``inputs.prompt_builder``). A line that is not valid JSON
or not a valid request becomes a row with status ``invalid_request`` and a message naming
the line (its result row and its error line are still written).

Responses (``output.format = "openai-jsonl"``): written from the committed Parquet results
(the source of truth for resume), one line per row keyed by ``custom_id``, atomically.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchjob.config import InputConfig, ModelConfig
from batchjob.errors import InputDataError
from batchjob.inputs.parquet import InputDataset, PromptBatch
from batchjob.inputs.prompt_builder import ERROR_COLUMN, make_builder
from batchjob.status import STATUS_INVALID_REQUEST

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"([^"\\]+)"')


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


def _int64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


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
    mt = body.get("max_tokens", body.get("max_completion_tokens"))
    if mt is not None and not _int64(mt):
        raise _Bad(f"body.max_tokens must be an integer, got {mt!r}")
    if body.get("n", 1) != 1:
        raise _Bad(f"body.n must be 1, got {body.get('n')!r}")
    row.update(max_tokens=mt, temperature=_number(body, "temperature"))
    row["top_p"] = _number(body, "top_p")
    seed, stop = body.get("seed"), body.get("stop")
    if seed is not None and not _int64(seed):
        raise _Bad(f"body.seed must be an integer, got {seed!r}")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise _Bad(f"body.stop must be a string or a list of strings, got {stop!r}")
    row.update(seed=seed, stop=stop)
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
        "seed": pa.array([r.get("seed") for r in rows], pa.int64()),
        "stop": pa.array([r.get("stop") for r in rows], pa.list_(pa.string())),
        ERROR_COLUMN: pa.array([r[ERROR_COLUMN] for r in rows], pa.string()),
    }
    return pa.table(cols), url


@dataclass(frozen=True)
class RequestsDataset(InputDataset):
    """An OpenAI Batch request file read into memory (Batch API files are at most 200 MB)."""

    table: pa.Table | None = None

    def batches(self) -> Iterator[PromptBatch]:
        assert self.table is not None
        path = self.files[0]
        for start in range(0, self.num_rows, self.batch_rows):
            n = min(self.batch_rows, self.num_rows - start)
            rb = self.table.slice(start, n).combine_chunks().to_batches()[0]
            yield self._to_prompt_batch(rb, path, start, start)


def open_requests(cfg: InputConfig, model: ModelConfig | None) -> RequestsDataset:
    if not os.path.isfile(cfg.path):
        raise InputDataError(f"input.path: {cfg.path!r} is not a file")
    table, url = read_requests(cfg.path)
    chat = url == CHAT_URL
    builder = make_builder(
        cfg,
        model,
        messages_col="messages" if chat else None,
        prompt_column=None if chat else "prompt",
        error_column=ERROR_COLUMN,
    )
    return RequestsDataset(
        files=(cfg.path,),
        file_rows=(table.num_rows,),
        prompt_column="messages" if chat else "prompt",
        prompt_is_text=True,
        max_tokens_column="max_tokens",
        batch_rows=cfg.batch_rows,
        limit=cfg.limit,
        builder=builder,
        table=table,
    )


# ---------------------------------------------------------------------------------------
# responses
