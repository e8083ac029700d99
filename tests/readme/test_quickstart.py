"""README's quick start, run as written: every command of the block between
``<!-- quickstart -->`` and ``<!-- /quickstart -->``, one bash script, on the demo's tiny model.

It runs in a scratch copy of ``jobs/`` and ``examples/`` (the demo writes ``models/``,
``data/`` and ``out/`` beside them) with this checkout's ``.venv`` linked in, after
``examples/demo.py`` (what ``make demo`` runs). A command that fails, or a file the block
promises that is not there, fails the test. It starts vLLM (the backend line), so it runs in
``make test-integration``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- quickstart -->\s*```bash\n(.*?)```\s*<!-- /quickstart -->", re.S)


def quickstart_commands(readme: str) -> list[str]:
    """The block's command lines (comment lines and blank lines left out)."""
    m = BLOCK.search(readme)
    assert m, "README.md has no ```bash block between <!-- quickstart --> markers"
    lines = [line.strip() for line in m.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_block_is_found_and_starts_with_the_venv():
    cmds = quickstart_commands((ROOT / "README.md").read_text())
    assert cmds[0] == "source .venv/bin/activate"
    assert any(c.startswith("batchjob plan ") for c in cmds)
    assert any(c.startswith("batchjob run ") for c in cmds)
    assert any("engine.backend=vllm" in c for c in cmds)


def test_a_broken_command_fails_the_script(tmp_path):
    """The harness itself can fail: a command that exits non-zero stops the script."""
    script = "set -euo pipefail\ntrue\nfalse\ntouch reached\n"
    rc = subprocess.run(["bash", "-c", script], cwd=tmp_path).returncode
    assert rc != 0 and not (tmp_path / "reached").exists()


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "batchjob").exists(), reason="needs .venv")
def test_quickstart_runs_as_written(tmp_path):
    pytest.importorskip("vllm")
    cmds = quickstart_commands((ROOT / "README.md").read_text())
    for name in ("jobs", "examples"):
        shutil.copytree(ROOT / name, tmp_path / name)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["VLLM_CPU_OMP_THREADS_BIND"] = env.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    demo = subprocess.run(
        [sys.executable, "examples/demo.py"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-4000:]
    script = "set -euo pipefail\n" + "\n".join(cmds) + "\n"
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    # what the block promises: results of every run, one row per prompt, all ok
    prompts = pq.read_table(tmp_path / "data/demo/prompts.parquet").num_rows
    outputs = [tmp_path / p for c in cmds for p in re.findall(r"out/[\w/.-]+\.parquet", c)] + [
        tmp_path / "out/demo/results.parquet"
    ]
    for out in outputs:
        table = pq.read_table(out)
        assert table.num_rows == prompts, out
        assert set(table.column("status").to_pylist()) == {"ok"}, out
    assert "row_id" in done.stdout  # the polars preview printed the results
