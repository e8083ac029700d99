"""OpenAI Batch fidelity, field by field, end to end through jobs/openai_migration.toml on a tiny
model: one chat batch file of twenty requests (each line one field or case) and one
completions file. A field is honoured (its output line shows it) or its row is
``invalid_request`` naming the field; nothing is silently ignored. A /v1/completions prompt
reaches the model as raw text even though the job sets a chat template."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from batchjob.tokenize.tokenizer import load_tokenizer
from tests.e2e.jobkit import ROOT, cli, read_results

OPENAI = ROOT / "jobs" / "openai_migration.toml"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
USER = [{"role": "user", "content": "babu bado bafe bake"}]

# (custom_id, body fields besides messages, the row's status, a word its message names)
CHAT_CASES: list[tuple[str, dict, str, str]] = [
    ("plain", {"temperature": 0}, "ok", ""),
    ("lp-top2", {"logprobs": True, "top_logprobs": 2}, "ok", ""),
    ("lp-alone", {"logprobs": True}, "ok", ""),
    ("lp-off", {"logprobs": False}, "ok", ""),
    ("lp-too-many", {"logprobs": True, "top_logprobs": 5}, "invalid_request", "top_logprobs"),
    ("lp-top-alone", {"top_logprobs": 1}, "invalid_request", "top_logprobs"),
    ("lp-not-bool", {"logprobs": "yes"}, "invalid_request", "body.logprobs"),
    ("freq-penalty", {"frequency_penalty": 0.5, "presence_penalty": 0.3}, "ok", ""),
    ("bad-penalty", {"presence_penalty": 3}, "invalid_presence_penalty", "presence_penalty"),
    ("vllm-extras", {"repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 2}, "ok", ""),
    ("bias-key", {"logit_bias": {"x": 1}}, "invalid_request", "logit_bias"),
    ("pres-penalty-0", {"presence_penalty": 0}, "ok", ""),
    ("n2", {"n": 2, "temperature": 1.0, "seed": 4}, "ok", ""),
    ("n0", {"n": 0}, "invalid_n", "input.n_column"),
    ("n-text", {"n": "2"}, "invalid_request", "body.n"),
    ("logit-bias", {"logit_bias": {"5": 100}}, "ok", ""),
    ("tools", {"tools": [{"type": "function"}]}, "invalid_request", "body.tools"),
    ("stream-false", {"stream": False, "user": "u1", "metadata": {"k": "v"}}, "ok", ""),
    ("json-object", {"response_format": {"type": "json_object"}}, "json", ""),
    (
        "json-schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
            }
        },
        "json",
        "",
    ),
    ("format-xml", {"response_format": {"type": "xml"}}, "invalid_request", "response_format"),
    ("sampled", {"temperature": 0.8, "top_p": 0.9, "top_k": 5, "seed": 3}, "ok", ""),
    ("bad-temp", {"temperature": 200}, "invalid_temperature", "temperature"),
    ("stop", {"stop": ["zzz"]}, "ok", ""),
    ("max-completion", {"max_completion_tokens": 2}, "ok", ""),
]
COMPLETION_CASES: list[tuple[str, dict, str, str]] = [
    ("c-plain", {}, "ok", ""),
    ("c-lp2", {"logprobs": 2}, "ok", ""),
    ("c-echo", {"echo": True}, "invalid_request", "body.echo"),
    ("c-best-of", {"best_of": 2}, "invalid_request", "best_of"),
    ("c-suffix", {"suffix": "x"}, "invalid_request", "suffix"),
]
PROMPT = "babu bado bafe bake bado"


def _write(path: Path, url: str, cases: list[tuple[str, dict, str, str]]) -> Path:
    lines = []
    for cid, fields, _, _ in cases:
        body = {"model": "gpt-4o-mini", "max_tokens": 6, **fields}
        body.update({"messages": USER} if url == CHAT else {"prompt": PROMPT})
        lines.append(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(tmp: Path, requests: Path, model: Path, *sets: str) -> tuple[list[dict], list[dict]]:
    out = tmp / "out" / f"{requests.stem}.parquet"
    args = [OPENAI, "--input", requests, "--model", model, "--output", out]
    args += ["--set", "model.device=cpu", "--set", "engine.threads=1", "--no-progress"]
    for s in sets:
        args += ["--set", s]
    r = cli("run", *args)
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    return read_results(out).to_pylist(), lines


def _check_statuses(cases, rows, lines) -> dict[str, tuple[dict, dict]]:
    by_id = {}
    firsts = [r for r in rows if not r.get("sample_index")]  # a request's first sample
    for (cid, _, status, word), row, line in zip(cases, firsts, lines, strict=True):
        assert row["custom_id"] == line["custom_id"] == cid
        if status == "json":  # constrained: complete JSON, or cut by max_tokens
            assert row["status"] in ("ok", "json_incomplete"), row
            assert (row["output_text"] or "").startswith("{"), row
        else:
            assert row["status"] == status, (cid, row["status"], row["message"])
        if status not in ("ok", "json"):
            assert line["response"] is None and line["error"]["code"] == status
            assert word in line["error"]["message"], (cid, line["error"]["message"])
        by_id[cid] = (row, line)
    return by_id


def _logprob_steps(row: dict) -> list[dict]:
    return row["output_logprobs"]


def test_chat_fields(tmp_path: Path, run_model: Path) -> None:
    pytest.importorskip("xgrammar")
    requests = _write(tmp_path / "chat.jsonl", CHAT, CHAT_CASES)
    rows, lines = _run(
        tmp_path,
        requests,
        run_model,
        "sampling.logprobs=3",
        "input.json_schema_column=json_schema",
    )
    by_id = _check_statuses(CHAT_CASES, rows, lines)
    decode = load_tokenizer(run_model).tokenizer

    # logprobs: OpenAI's chat format, from output_logprobs, top list cut to the request's
    row, line = by_id["lp-top2"]
    lp = line["response"]["body"]["choices"][0]["logprobs"]
    steps = _logprob_steps(row)
    assert lp["refusal"] is None and len(lp["content"]) == len(steps) == row["num_output_tokens"]
    for item, step in zip(lp["content"], steps, strict=True):
        assert item["token"] == decode.decode([step["token_id"]], skip_special_tokens=False)
        assert math.isclose(item["logprob"], step["logprob"], rel_tol=1e-6)
        assert item["bytes"] == list(item["token"].encode())
        assert len(item["top_logprobs"]) == 2
        assert [t["logprob"] for t in item["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in step["top"][:2]]
        )
    alone = by_id["lp-alone"][1]["response"]["body"]["choices"][0]["logprobs"]
    assert alone["content"] and all(c["top_logprobs"] == [] for c in alone["content"])
    assert by_id["lp-off"][1]["response"]["body"]["choices"][0]["logprobs"] is None
    # a request that says nothing gets none, as from OpenAI, though the job computes them
    assert by_id["plain"][1]["response"]["body"]["choices"][0]["logprobs"] is None
    assert by_id["plain"][0]["output_logprobs"] is not None
    # each output line's model is its request's, not the model folder's name
    assert {x["response"]["body"]["model"] for x in lines if x["response"]} == {"gpt-4o-mini"}
    # penalties and logit_bias: the row's own settings (a +100 bias: that token every step)
    biased = by_id["logit-bias"][0]
    assert biased["output_token_ids"] == [5] * biased["num_output_tokens"]
    # n: one result row per sample, the samples as choices[0..n-1] of one line
    n2 = [r for r in rows if r["custom_id"] == "n2"]
    assert [r["sample_index"] for r in n2] == [0, 1]
    body = by_id["n2"][1]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == [r["output_text"] for r in n2]
    assert body["usage"]["completion_tokens"] == sum(r["num_output_tokens"] for r in n2)
    msg = by_id["lp-too-many"][1]["error"]["message"]
    assert "body.top_logprobs = 5 is more than this job's sampling.logprobs = 3" in msg
    assert "line 5" in msg
    error = by_id["lp-too-many"][1]["error"]  # the line's context, as the Batch API's errors
    assert (error["code"], error["line"], error["param"]) == ("invalid_request", 5, "top_logprobs")
    bad_temp = by_id["bad-temp"][1]["error"]  # a per-row status: the line added to the message
    assert bad_temp["line"] == 23 and bad_temp["message"].startswith("line 23: ")
    assert bad_temp["param"] == "temperature"

    # per-row settings from the body, without the job naming their columns
    row = by_id["sampled"][0]
    assert (row["temperature"], row["top_p"], row["top_k"], row["seed"]) == (0.8, 0.9, 5, 3)
    assert by_id["max-completion"][0]["num_output_tokens"] <= 2
    assert "stop" in by_id["stop"][0] and by_id["stop"][0]["stop"] == ["zzz"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert all(r["num_output_tokens"] <= 6 for r in ok)


def test_chat_fields_need_no_flags(tmp_path: Path, run_model: Path) -> None:
    """Log-probs and response_format are honoured for the requests that ask, as the Batch API
    does, with no --set: the job computes the most top log-probs any request asks for."""
    pytest.importorskip("xgrammar")
    names = ("plain", "lp-top2", "lp-alone", "json-object")
    cases = [c for c in CHAT_CASES if c[0] in names]
    requests = _write(tmp_path / "chat2.jsonl", CHAT, cases)
    rows, lines = _run(tmp_path, requests, run_model)
    by_id = _check_statuses(cases, rows, lines)  # json-object: constrained output ("{...")
    choice = {cid: by_id[cid][1]["response"]["body"]["choices"][0] for cid in names[:3]}
    assert choice["plain"]["logprobs"] is None
    assert all(len(c["top_logprobs"]) == 2 for c in choice["lp-top2"]["logprobs"]["content"])
    assert all(c["top_logprobs"] == [] for c in choice["lp-alone"]["logprobs"]["content"])


def test_completions_are_raw_text_and_get_logprobs(tmp_path: Path, run_model: Path) -> None:
    requests = _write(tmp_path / "comp.jsonl", COMPLETIONS, COMPLETION_CASES)
    rows, lines = _run(tmp_path, requests, run_model, "sampling.logprobs=3")
    by_id = _check_statuses(COMPLETION_CASES, rows, lines)
    # the job sets model.chat_template, yet the prompt is tokenized as it is (BOS added)
    want, _ = load_tokenizer(run_model).encode([PROMPT])
    assert by_id["c-plain"][0]["num_prompt_tokens"] == len(want)
    row, line = by_id["c-lp2"]
    lp = line["response"]["body"]["choices"][0]["logprobs"]
    steps = _logprob_steps(row)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(steps)
    assert lp["token_logprobs"] == pytest.approx([s["logprob"] for s in steps])
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(steps))]
    assert line["response"]["body"]["object"] == "text_completion"
