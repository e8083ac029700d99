"""The vLLM backend from a Python script as users write one: no ``if __name__ ==
"__main__":`` guard (vLLM spawns its worker, which imported the script again and failed),
one vLLM start for every ``generate()`` of a warm ``Generator`` (a later, longer table
included), and no vLLM log left in $TMPDIR after a clean run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.backends.vllm.vllm_kit import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """\
import json, os, sys
import batchjob
from batchjob.testing.workloads import WORDS

print("script body ran", file=sys.stderr)  # once: a spawned worker must not run it again
g = batchjob.Generator(
    model=sys.argv[1],
    sampling={"max_tokens": 4},
    scheduler={"chunk_size": 256},
    engine={"backend": "vllm", "block_size": 32, "kv_cache_bytes": "2MiB", "threads": 1,
            "vllm": {"enforce_eager": True}},
)
short = g.generate([" ".join(WORDS[:5]), " ".join(WORDS[5:10])])
longer = g.generate([" ".join(WORDS[100:400])])  # 300 words: past the first table's longest
starts = g._backend.starts
g.close()
print(json.dumps({
    "starts": starts,
    "status": short["status"].to_pylist() + longer["status"].to_pylist(),
    "prompt_tokens": [*short["num_prompt_tokens"].to_pylist(),
                      *longer["num_prompt_tokens"].to_pylist()],
    "tmp": sorted(os.listdir(os.environ["TMPDIR"])),
}))
"""


def test_script_without_main_guard_one_start_no_log_left(tmp_path, model_dir):
    script = tmp_path / "migrated.py"
    script.write_text(SCRIPT)
    # vLLM binds IPC sockets under $TMPDIR, whose path must stay under 107 bytes (AF_UNIX):
    # pytest's own folders under xdist are longer
    tmpdir = Path(tempfile.mkdtemp(prefix="bj-", dir="/tmp"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmpdir))
    try:
        res = subprocess.run(
            [sys.executable, str(script), str(model_dir)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        leftover = sorted(os.listdir(tmpdir))
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("script body ran") == 1, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["status"] == ["ok", "ok", "ok"], out
    assert out["prompt_tokens"][2] > 2 * max(out["prompt_tokens"][:2]), out
    assert out["starts"] == 1, out
    assert not [f for f in out["tmp"] if f.startswith("batchjob-vllm-")], out["tmp"]
    assert not [f for f in leftover if f.startswith("batchjob-vllm-")], leftover
