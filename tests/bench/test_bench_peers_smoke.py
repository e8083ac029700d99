"""benchmarks/bench_peers.py --smoke: both batchjob policies run and land in one table.
(``--interleave`` with vLLM: tests/bench/test_peer_harness.py.)"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]


def test_bench_peers_smoke(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_peers.py"),
        "--smoke",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("peers.md", "peers.parquet", "peers_runs.parquet", "peers.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = pq.read_table(tmp_path / "peers.parquet").to_pylist()
    by_system = {r["system"]: r for r in rows}
    assert set(by_system) == {"batchjob", "baseline"}  # no vLLM without --with-vllm
    from batchjob.model.host_cpu import host_cpu

    for r in rows:
        assert r["head_dim"] == 32  # the tiny model's; --head-dims picks others
        assert r["cpu_model"] == host_cpu().model  # every row names the machine and its ISA
        assert r["cpu_flags"] == " ".join(host_cpu().key_flags)
        assert r["requests"] == 20
        assert r["prompt_tokens"] > 20 * 50
        assert 0 < r["run_s"] < r["end_to_end_s"]
        assert math.isclose(r["req_per_s"], r["requests"] / r["run_s"], rel_tol=1e-9)
        assert 0.3 < r["saving_achieved"] <= r["saving_planned"] + 1e-9 < 1  # s4 groups share
        assert 50 < r["peak_mem_mib"] < 8000
    assert math.isclose(by_system["batchjob"]["batchjob_x"], 1.0)
    # same model, greedy fp32, same fixed lengths: the two policies give the same tokens
    assert by_system["baseline"]["match_vs_batchjob"] == 1.0
    md = (tmp_path / "peers.md").read_text()
    assert "| batchjob |" in md and md.count(host_cpu().model) == len(rows)
