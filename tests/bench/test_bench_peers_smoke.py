"""benchmarks/bench_peers.py --smoke: both batchjob policies run and land in one table."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

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


def _interleaved(out: Path, repeats: int) -> list[str]:
    """bench_peers --smoke with vLLM sorted, --interleave."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--smoke", "--with-vllm"]
    cmd += ["--systems", "batchjob,vllm-sorted", "--interleave", "--repeats", str(repeats)]
    return [*cmd, "--out", str(out)]


@pytest.mark.slow
def test_bench_peers_interleaved_with_vllm(tmp_path: Path) -> None:
    """--interleave: vLLM starts after batchjob's first run (which builds and calibrates the
    kernel on a quiet machine), then each of its runs follows batchjob's run of the same
    repeat (released through vllm_peer.py's go files), and both land in one table."""
    pytest.importorskip("vllm")
    proc = subprocess.run(
        _interleaved(tmp_path, repeats=2), cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    runs = pq.read_table(tmp_path / "peers_runs.parquet").to_pylist()
    assert sorted((r["system"], r["repeat"]) for r in runs) == [
        ("batchjob", 0), ("batchjob", 1), ("vllm-sorted", 0), ("vllm-sorted", 1)
    ]  # fmt: skip
    assert all(r["match_frac"] == 1.0 for r in runs if r["system"] == "vllm-sorted")
    # in time: batchjob 0, vLLM ready, vLLM 0, batchjob 1, vLLM 1
    d = tmp_path / "runs" / "d32"
    name = "micro-2000-200-s4"
    done = [
        d / f"{name}-batchllm-0" / "results.parquet",
        d / "vllm-plan" / "plan.json.ready",
        d / f"{name}-vllm-sorted-0" / "peer.json",
        d / f"{name}-batchllm-1" / "results.parquet",
        d / f"{name}-vllm-sorted-1" / "peer.json",
    ]
    times = [p.stat().st_mtime for p in done]
    assert times == sorted(times)


@pytest.mark.slow
def test_bench_peers_interleaved_ctrl_c_leaves_no_vllm_process(tmp_path: Path) -> None:
    """Ctrl-C while vLLM waits for its next go file: its whole process group goes too (it
    would otherwise wait forever, holding its memory)."""
    pytest.importorskip("vllm")
    psutil = pytest.importorskip("psutil")
    cmd = _interleaved(tmp_path, repeats=3)
    restore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    with (tmp_path / "log.txt").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=restore_sigint)  # fmt: skip
        ready = tmp_path / "runs" / "d32" / "vllm-plan" / "plan.json.ready"
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "vLLM never got ready"
            time.sleep(0.2)
        peer = [c for c in psutil.Process(proc.pid).children() if "vllm_peer.py" in c.cmdline()[1]]
        assert len(peer) == 1
        tree = [peer[0], *peer[0].children(recursive=True)]  # with vLLM's engine and worker
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) != 0
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert alive == []
