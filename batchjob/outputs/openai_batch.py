"""OpenAI Batch API output lines (``output.format = "openai-jsonl"``): written from the
committed results, keyed by ``custom_id``, in the Batch output-line format. The results stay
the source of truth for resume; a kill before this file is written redoes it on rerun.

``choices[k]`` holds sample k (the request's ``n``); its ``logprobs`` is filled from the
results' ``output_logprobs`` (``sampling.logprobs``) for the rows whose request asks for
log-probs (``logprobs``, ``top_logprobs``; a request that says nothing gets none, as from
OpenAI; a Parquet input's rows whenever the job computes them), in OpenAI's format: chat
``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``, completions
``{tokens, token_logprobs, top_logprobs, text_offset}``. Token strings are each id decoded
alone with the model's tokenizer. ``model`` is the request's (the model folder's name where
it has none); a failed request's ``error`` is ``{code, message, param, line}``: its status,
the message with the request's line, the body field at fault."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import InputConfig, ModelConfig
from batchjob.inputs.openai_batch import CHAT_URL, COMPLETIONS_URL
from batchjob.model.hub import display_name
from batchjob.storage.atomic import atomic_open
from batchjob.storage.stores import ObjectPath

Decode = Callable[[int], str]


def _chat_job(inp: InputConfig, model: ModelConfig) -> bool:
    if inp.path.endswith(".jsonl"):
        return False  # the url column says
    return bool(inp.messages_column or inp.system_prompt is not None) or (
        model.chat_template not in (None, "none")
    )


def _token(decode: Decode, token_id: int, logprob: float) -> dict[str, Any]:
    text = decode(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _logprobs(r: dict[str, Any], chat: bool, decode: Decode | None) -> dict[str, Any] | None:
    """The row's ``choices[0].logprobs`` in OpenAI's format, or None when not asked for."""
    steps = r.get("output_logprobs")
    asked = r.get("logprobs")  # the request's: True / False, None when it said nothing
    if steps is None or decode is None or asked is False:
        return None
    if "logprobs" in r and not asked:  # a request's row: only those that asked, as OpenAI
        return None
    top_n = r.get("top_logprobs")
    if top_n is None:  # chat logprobs=true alone: no alternatives; silent: the job's top N
        top_n = 0 if asked else len(steps[0]["top"]) if steps else 0
    if chat:
        content = [
            {
                **_token(decode, s["token_id"], s["logprob"]),
                "top_logprobs": [
                    _token(decode, t["token_id"], t["logprob"]) for t in s["top"][:top_n]
                ],
            }
            for s in steps
        ]
        return {"content": content, "refusal": None}
    tokens = [decode(s["token_id"]) for s in steps]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [s["logprob"] for s in steps],
        "top_logprobs": [
            {decode(t["token_id"]): t["logprob"] for t in s["top"][:top_n]} for s in steps
        ],
        "text_offset": offsets,
    }


def _line(
    rows: list[dict[str, Any]],
    url: str,
    model: str,
    created: int,
    decode: Decode | None = None,
) -> dict[str, Any]:
    """One request's output line from its result rows (one per sample, ``choices[k]``); any
    sample not ``ok`` makes the line that sample's error."""
    r = rows[0]
    rid = f"batch_req_{r['row_id']:012d}"
    cid = r.get("custom_id") or f"row-{r['row_id']}"
    bad = next((x for x in rows if x["status"] != "ok"), None)
    if bad is not None:
        return {"id": rid, "custom_id": cid, "response": None, "error": _error(bad)}
    chat = url == CHAT_URL
    choices = []
    for k, x in enumerate(rows):
        text = x["output_text"] or ""
        choice: dict[str, Any] = {
            "index": k,
            "logprobs": _logprobs(x, chat, decode),
            "finish_reason": x["finish_reason"],
        }
        if chat:  # content null where the reasoning parser found no answer, as vLLM's server
            content = x["output_text"] if "reasoning_text" in x else text
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = text
        if "reasoning_text" in x:  # output.reasoning_parser: vLLM's field for the <think> part
            (choice["message"] if chat else choice)["reasoning_content"] = x["reasoning_text"]
        choices.append(choice)
    completion = sum(x["num_output_tokens"] for x in rows)
    usage = {
        "prompt_tokens": r["num_prompt_tokens"],
        "completion_tokens": completion,
        "total_tokens": r["num_prompt_tokens"] + completion,
    }
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{r['row_id']}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": r.get("model") or model,  # the request's, as vLLM's server answers
        "choices": choices,
        "usage": usage,
    }
    return {
        "id": rid,
        "custom_id": cid,
        "response": {"status_code": 200, "request_id": f"req_{r['row_id']:012d}", "body": body},
        "error": None,
    }


# the body field a message names: "body.top_logprobs ...", or a request's per-row setting,
# whose column is named after its body field ("column 'temperature' (input....)")
_PARAM = re.compile(r"\bbody\.([A-Za-z_][A-Za-z_0-9.]*)|column '([A-Za-z_0-9]+)'")


def _error(r: dict[str, Any]) -> dict[str, Any]:
    """A failed request's error object, with its context as the Batch API's errors carry it:
    the request ``line`` of the input file and the body field at fault (``param``)."""
    message = r["message"] or r["status"]
    line = r.get("line")
    if line is not None and f"line {line}" not in message:
        message = f"line {line}: {message}"
    param = _PARAM.search(message)
    return {
        "code": r["status"],
        "message": message,
        "param": (param.group(1) or param.group(2)).rstrip(".") if param else None,
        "line": line,
    }


def _requests(batch_rows: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Result rows (sorted by row_id, then sample) grouped per request."""
    group: list[dict[str, Any]] = []
    for r in batch_rows:
        if group and r["row_id"] != group[0]["row_id"]:
            yield group
            group = []
        group.append(r)
    if group:
        yield group


def write_responses(
    inp: InputConfig, model_cfg: ModelConfig, out: Path | ObjectPath, results_path: Path
) -> Path:
    """The committed results -> ``out`` (the layout's ``jsonl_file``) in the Batch API's
    output format."""
    assert isinstance(out, Path)  # an object-store output.path is refused at load for this
    from batchjob.outputs.ownership import committed_files  # the commit's files, no other

    table = pa.concat_tables([pq.read_table(f) for f in committed_files(results_path)])
    order = [("row_id", "ascending")]
    if "sample_index" in table.column_names:
        order.append(("sample_index", "ascending"))
    table = table.sort_by(order)
    names = set(table.column_names)
    if "custom_id" not in names and inp.id_column in names:
        table = table.append_column("custom_id", table.column(inp.id_column).cast(pa.string()))
    default_url = CHAT_URL if _chat_job(inp, model_cfg) else COMPLETIONS_URL
    model = display_name(model_cfg.path) if model_cfg.path else "batchjob"
    created = int(os.stat(results_path).st_mtime)
    keep = [
        c
        for c in (
            "row_id",
            "custom_id",
            "url",
            "model",
            "output_text",
            "reasoning_text",
            "finish_reason",
            "num_prompt_tokens",
            "num_output_tokens",
            "status",
            "message",
            "line",
            "output_logprobs",
            "logprobs",
            "top_logprobs",
        )
        if c in table.column_names
    ]
    decode = _decoder(model_cfg) if "output_logprobs" in table.column_names else None
    rows = (r for b in table.select(keep).to_batches(max_chunksize=8192) for r in b.to_pylist())
    with atomic_open(out, "w") as f:
        for request in _requests(rows):
            url = request[0].get("url") or default_url
            line = _line(request, url, model, created, decode)
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return out


def _decoder(model_cfg: ModelConfig) -> Decode | None:
    """One token id -> its text (memoised), with the model's tokenizer; None without one."""
    folder = model_cfg.tokenizer_path
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return None
    from batchjob.tokenize.tokenizer import load_tokenizer

    tok = load_tokenizer(folder).tokenizer

    @functools.cache
    def decode(token_id: int) -> str:
        return str(tok.decode([token_id], skip_special_tokens=False))

    return decode
