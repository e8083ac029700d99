"""OpenAI Batch output lines (batchjob.outputs.openai_batch): a reasoning row's message as
vLLM's OpenAI server writes it."""

from __future__ import annotations

from typing import Any

from batchjob.inputs.openai_batch import CHAT_URL, COMPLETIONS_URL
from batchjob.outputs.openai_batch import _line


def _row(**kw: Any) -> dict[str, Any]:
    base = {"row_id": 0, "finish_reason": "stop", "status": "ok", "message": None}
    return base | {"num_prompt_tokens": 3, "num_output_tokens": 4} | kw


def _choice(row: dict[str, Any], url: str = CHAT_URL) -> dict[str, Any]:
    return _line([row], url, "m", 0)["response"]["body"]["choices"][0]


def test_reasoning_row_without_an_answer_has_null_content() -> None:
    """vLLM's chat server: content null when the parser found no answer (the reasoning did
    not end, or nothing followed it), the reasoning in reasoning_content."""
    msg = _choice(_row(output_text=None, reasoning_text="hm"))["message"]
    assert msg == {"role": "assistant", "content": None, "reasoning_content": "hm"}
    msg = _choice(_row(output_text=" yes", reasoning_text="hm"))["message"]
    assert msg["content"] == " yes" and msg["reasoning_content"] == "hm"
    # no reasoning parser: an empty output is an empty string, as without one in vLLM
    assert _choice(_row(output_text=""))["message"]["content"] == ""
    # completions carry text (a string in the Batch format) and the reasoning beside it
    choice = _choice(_row(output_text=None, reasoning_text="hm"), COMPLETIONS_URL)
    assert choice["text"] == "" and choice["reasoning_content"] == "hm"
