"""The runnable snippets of docs/migrating.md (a fenced block after ``<!-- run: KIND -->``),
and the scratch folder they run in: the layout ``make demo`` leaves (``models/tiny-llama``,
``data/demo/prompts.parquet``) plus a copy of ``jobs/``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq

from batchjob.testing.workloads import make_workload

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "migrating.md"
KINDS = {"native": "python", "vllm": "python", "ray": "python", "shell": "bash"}
_BLOCK = re.compile(r"<!-- run: (\w+) -->\s*```(\w+)\n(.*?)```", re.S)


def snippets(kind: str | None = None) -> list[str]:
    """The code of every block marked ``kind`` (every marked block: None)."""
    found = []
    for k, lang, code in _BLOCK.findall(DOC.read_text()):
        assert KINDS.get(k) == lang, f"docs/migrating.md: a {lang} block marked run: {k}"
        if kind is None or k == kind:
            found.append(code)
    return found


def scratch(folder: Path, model: Path, rows: int = 60) -> Path:
    """``folder`` laid out as after ``make demo``: the model, ``rows`` demo prompts (the
    case1 workload, a ``request_id`` column), ``jobs/``."""
    shutil.copytree(model, folder / "models" / "tiny-llama")
    table = make_workload("case1", scale=0.05, len_scale=0.1, seed=0, form="text", max_tokens=16)
    assert table.num_rows >= rows
    (folder / "data" / "demo").mkdir(parents=True)
    pq.write_table(table.slice(0, rows), folder / "data" / "demo" / "prompts.parquet")
    shutil.copytree(ROOT / "jobs", folder / "jobs")
    return folder
