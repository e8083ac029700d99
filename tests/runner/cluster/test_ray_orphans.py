"""A cluster run's workers never outlive their driver's hold on the output.

The driver (``batchjob run`` with ``cluster.address = "local"``: its own Ray) is SIGKILLed while
both engine workers are mid-shard: the workers stop writing part files at once and their
processes end within seconds (they checked the driver before each part and every second), the
dead run's part names carry its run token, and the rerun resumes the parts, exactly once.
No Ray process outlives it either (the raylet's DashboardAgent and RuntimeEnvAgent did).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchjob.config import load_job
from batchjob.outputs.naming import OutputLayout
from batchjob.runner.pipeline import run
from tests.e2e.jobkit import ROOT, read_results, write_job

pytest.importorskip("ray")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"  # a zombie is dead
    return True


def _group(pgid: int) -> dict[int, str]:
    """{pid: command line} of the live (not zombie) processes of process group ``pgid``."""
    out = {}
    for p in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    out[int(p)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:80]
    return out


def _parts(meta: Path) -> set[str]:
    return {p.name for p in (meta / "parts").glob("part-*.parquet")}


def test_workers_stop_when_their_driver_is_killed(
    tmp_path: Path, cluster_model: Path, cluster_data: Path
) -> None:
    job = write_job(tmp_path, cluster_model, cluster_data, "out", flush_rows="1")
    sets = {"sampling.ignore_eos": "true", "scheduler.max_num_seqs": "2"}  # rows one by one
    cluster = {"cluster.address": "local", "cluster.workers": "2", "cluster.max_restarts": "0"}
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(job), "--no-progress"]
    cmd += [a for k, v in {**sets, **cluster}.items() for a in ("--set", f"{k}={v}")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    meta = OutputLayout.of(load_job(job).output).meta
    driver = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        workers: dict[str, int] = {}
        while len(workers) < 2 or not all(
            any(n.endswith(f"-{w}.parquet") for n in _parts(meta)) for w in workers
        ):
            assert driver.poll() is None and time.monotonic() < deadline, "no parts in time"
            for f in (meta / "workers").glob("w*.json"):
                with contextlib.suppress(ValueError, OSError):
                    workers[f.stem] = json.loads(f.read_text())["pid"]
            time.sleep(0.01)
        at_kill = _parts(meta)
        ray_procs = _group(driver.pid)  # Ray's processes: the driver's session
        assert any(n.startswith("ray::DashboardAgent") for n in ray_procs.values()), ray_procs
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        killed = time.monotonic()
        time.sleep(0.3)  # a part being written at the kill lands; nothing after that
        written = _parts(meta)
        while any(_alive(p) for p in workers.values()) and time.monotonic() < killed + 6:
            time.sleep(0.05)
        gone_after = time.monotonic() - killed
        time.sleep(1.0)
        late = sorted(_parts(meta) - written)
        assert not late, f"{len(late)} parts written after the driver died ({len(at_kill)} before)"
        assert gone_after < 2.5, f"workers still alive {gone_after:.1f} s after the driver died"
        while _group(driver.pid) and time.monotonic() < killed + 8:
            time.sleep(0.1)
        left = _group(driver.pid)  # the raylet's agents outlived it (they watch the raylet)
        assert not left, f"Ray processes alive 8 s after the driver died: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)  # the driver's Ray (its own session)
        driver.wait()

    tokens = {n.split("-")[2] for n in written}
    assert len(tokens) == 1, written  # every part names the dead run
    done = sum(pq.read_metadata(meta / "parts" / n).num_rows for n in written)
    n = pq.read_metadata(cluster_data).num_rows
    assert 0 < done < n
    again = run(load_job(job, sets), progress=False)  # one process: [cluster] is not the job
    assert again.summary is not None and again.summary.rows_skipped_done == done
    ids = read_results(again.results_path)["row_id"].to_pylist()
    assert ids == list(range(n))


def test_a_worker_stops_once_another_run_holds_the_lock(tmp_path: Path) -> None:
    """The check before each part: the driver alive and the lock still this run's."""
    from batchjob.runner.cluster.worker import DriverInfo, RunGuard, RunOverError
    from batchjob.storage.lock import output_lock

    job = write_job(tmp_path, None, tmp_path / "in.parquet", "out")
    layout = OutputLayout.of(load_job(job).output)
    layout.prepare()
    with output_lock(layout.lock_file, layout.output, "aaaaaaaa"):
        RunGuard(layout, "aaaaaaaa", DriverInfo.here()).check()  # this run: goes on
        with pytest.raises(RunOverError, match="no longer its run"):
            RunGuard(layout, "bbbbbbbb", DriverInfo.here()).check()
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        gone = DriverInfo(DriverInfo.here().host, dead.pid, DriverInfo.here().pid_namespace)
        with pytest.raises(RunOverError, match="driver"):
            RunGuard(layout, "aaaaaaaa", gone).check()
