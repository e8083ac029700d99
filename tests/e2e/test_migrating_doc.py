"""docs/migrating.md as a tested document: its native-engine snippets and its
``batchjob run`` line run as written in a folder laid out as after ``make demo`` (the vLLM
and Ray Data snippets: tests/readme/test_migrating_vllm_ray.py, integration)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.doc_snippets import KINDS, scratch, snippets

USER = [{"role": "user", "content": "babu bado bafe bake"}]


def test_every_kind_of_snippet_is_there():
    assert {k: len(snippets(k)) for k in KINDS} == {"native": 1, "vllm": 1, "ray": 1, "shell": 1}


def test_native_snippet_runs_as_written(tmp_path: Path, run_model: Path, monkeypatch) -> None:
    scratch(tmp_path, run_model)
    monkeypatch.chdir(tmp_path)
    (code,) = snippets("native")
    scope: dict = {}
    exec(compile(code, "docs/migrating.md", "exec"), scope)
    texts = scope["texts"]
    assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts), texts


def test_run_batch_line_runs_as_written(tmp_path: Path, run_model: Path) -> None:
    scratch(tmp_path, run_model)
    asks = [{}, {"logprobs": True, "top_logprobs": 2}, {"temperature": 5}]
    lines = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "gpt-4o-mini", "messages": USER, "max_tokens": 4, **extra},
            }
        )
        for i, extra in enumerate(asks)
    ]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    (code,) = snippets("shell")
    bin_dir = str(Path(sys.executable).parent)  # the venv's batchjob
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    res = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["r0", "r1", "r2"]
    ok, asked, bad = out
    assert ok["response"]["body"]["model"] == "gpt-4o-mini"
    assert ok["response"]["body"]["choices"][0]["logprobs"] is None
    assert asked["response"]["body"]["choices"][0]["logprobs"]["content"]  # no flag needed
    assert bad["error"]["param"] == "temperature" and bad["error"]["line"] == 3
