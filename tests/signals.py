"""Run ``batchjob run`` in a subprocess and signal it once enough part files exist."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def signal_after_parts(
    job: Path,
    parts: Path,
    count: int,
    sig: int = signal.SIGINT,
    extra: tuple[str, ...] = (),
    timeout: float = 300,
) -> tuple[int, str]:
    """Start the job, send ``sig`` once ``parts`` holds ``count`` part files; (exit code, stderr).

    The job runs to its end if it finishes first, so callers assert the exit code they expect.
    """
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(job), "--no-progress", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if parts.is_dir() and len(list(parts.glob("part-*.parquet"))) >= count:
            proc.send_signal(sig)
            break
        time.sleep(0.01)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err
