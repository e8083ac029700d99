"""Shared pieces of the end-to-end tests: a tiny real model, a small dataset, job files.

Everything is built locally (random weights, a tokenizer trained on the workload's words).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner, Result

from batchjob.cli import main
from batchjob.testing.tiny_model import make_tiny_model
from batchjob.testing.workloads import WORDS, make_workload

ROOT = Path(__file__).resolve().parents[2]


def build_model(folder: Path) -> Path:
    corpus = [" ".join(WORDS[i : i + 16]) for i in range(0, len(WORDS), 16)]
    return make_tiny_model(folder, vocab_size=2500, corpus=corpus)


def build_dataset(path: Path, seed: int = 3, scale: float = 0.01) -> Path:
    """A small case1 text dataset (about 24 rows) with a request_id pass-through column."""
    table = make_workload(
        "case1", scale=scale, len_scale=0.05, seed=seed, form="text", max_tokens=6
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def write_job(tmp: Path, model: Path | None, data: Path, out: Path | str, **extra: str) -> Path:
    """A job file; ``extra`` adds ``[output]`` keys (TOML literals)."""
    out = tmp / out if not Path(out).is_absolute() else Path(out)
    lines = ["[input]", f'path = "{data}"']
    if model is not None:
        lines += ["[model]", f'path = "{model}"', 'device = "cpu"']
    lines += ["[sampling]", "max_tokens = 6", "[scheduler]", "chunk_size = 64"]
    lines += ["[engine]", 'kv_cache_bytes = "8MiB"', "threads = 1"]
    lines += ["[output]", f'path = "{out}"']
    lines += [f"{k} = {v}" for k, v in extra.items()]
    job = tmp / f"{out.name}.{len(list(tmp.glob('*.toml')))}.toml"
    job.write_text("\n".join(lines) + "\n")
    return job


def cli(*args: str | Path) -> Result:
    """``batchjob ARGS`` in this process (click's runner; stderr kept apart)."""
    return CliRunner().invoke(main, [str(a) for a in args])


def cli_subprocess(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 300):
    """``python -m batchjob.cli ARGS`` in a fresh process -> CompletedProcess (text)."""
    cmd = [sys.executable, "-m", "batchjob.cli", *map(str, args)]
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(
        cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def killed_run(
    *args: str | Path,
    spec: str,
    env: dict[str, str] | None = None,
    group: bool = False,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``batchjob run ARGS`` in a fresh process, SIGKILLed at ``spec``: a named point of
    ``storage.faults`` (``part:2``: the second time the run passes it) or ``timed:SECONDS``
    -> the finished process (returncode -9 killed, 0 done first; anything else fails).
    ``group``: its own process group, killed whole after (a Ray driver's workers)."""
    name, _, at = spec.partition(":")
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    if name != "timed":
        full_env["BATCHJOB_FAULT_POINT"] = spec
    cmd = [sys.executable, "-m", "batchjob.cli", "run", "--no-progress", *map(str, args)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stderr=subprocess.PIPE, text=True, start_new_session=group
    )
    try:
        try:
            _, err = proc.communicate(timeout=float(at) if name == "timed" else timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            if name != "timed":
                raise  # the point was never reached
            _, err = proc.communicate(timeout=timeout)
    finally:
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode in (0, -signal.SIGKILL), err
    return subprocess.CompletedProcess(cmd, proc.returncode, stderr=err)


def read_results(path: Path) -> pa.Table:
    """Results of a finished job (a file or a results folder), sorted by row_id."""
    return pq.read_table(path).sort_by("row_id")
