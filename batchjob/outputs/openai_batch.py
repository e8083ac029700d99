"""OpenAI Batch API output lines (``output.format = "openai-jsonl"``): written from the
committed results, keyed by ``custom_id``, in the Batch output-line format. The results stay
the source of truth for resume; a kill before this file is written redoes it on rerun."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import InputConfig, ModelConfig
from batchjob.inputs.openai_batch import CHAT_URL, COMPLETIONS_URL
from batchjob.storage.atomic import atomic_open
from batchjob.storage.stores import ObjectPath


def _chat_job(inp: InputConfig, model: ModelConfig) -> bool:
    if inp.path.endswith(".jsonl"):
        return False  # the url column says
    return bool(inp.messages_column or inp.system_prompt is not None) or (
        model.chat_template not in (None, "none")
    )


def _line(r: dict[str, Any], url: str, model: str, created: int) -> dict[str, Any]:
    rid = f"batch_req_{r['row_id']:012d}"
    cid = r.get("custom_id") or f"row-{r['row_id']}"
    if r["status"] != "ok":
        return {
            "id": rid,
            "custom_id": cid,
            "response": None,
            "error": {"code": r["status"], "message": r["message"]},
        }
    chat = url == CHAT_URL
    text = r["output_text"] or ""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": r["finish_reason"]}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    usage = {
        "prompt_tokens": r["num_prompt_tokens"],
        "completion_tokens": r["num_output_tokens"],
        "total_tokens": r["num_prompt_tokens"] + r["num_output_tokens"],
    }
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{r['row_id']}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,  # the model that answered (the request's is in the results)
        "choices": [choice],
        "usage": usage,
    }
    return {
        "id": rid,
        "custom_id": cid,
        "response": {"status_code": 200, "request_id": f"req_{r['row_id']:012d}", "body": body},
        "error": None,
    }


def write_responses(
    inp: InputConfig, model_cfg: ModelConfig, out: Path | ObjectPath, results_path: Path
) -> Path:
    """The committed results -> ``out`` (the layout's ``jsonl_file``) in the Batch API's
    output format."""
    assert isinstance(out, Path)  # an object-store output.path is refused at load for this
    table = pq.read_table(results_path).sort_by("row_id")
    names = set(table.column_names)
    if "custom_id" not in names and inp.id_column in names:
        table = table.append_column("custom_id", table.column(inp.id_column).cast(pa.string()))
    default_url = CHAT_URL if _chat_job(inp, model_cfg) else COMPLETIONS_URL
    model = Path(model_cfg.path).name if model_cfg.path else "batchjob"
    created = int(os.stat(results_path).st_mtime)
    keep = [
        c
        for c in (
            "row_id",
            "custom_id",
            "url",
            "model",
            "output_text",
            "finish_reason",
            "num_prompt_tokens",
            "num_output_tokens",
            "status",
            "message",
        )
        if c in table.column_names
    ]
    with atomic_open(out, "w") as f:
        for batch in table.select(keep).to_batches(max_chunksize=8192):
            for r in batch.to_pylist():
                url = r.get("url") or default_url
                f.write(json.dumps(_line(r, url, model, created), ensure_ascii=False) + "\n")
    return out
