"""What a reader of a results folder sees while overwrites run over it: old or new, never a mix.

Two jobs, A and B, take turns writing one results folder with ``output.overwrite``; each
overwrite is SIGKILLed inside its commit (at a seeded choice of the commit's kill points,
with and without rename-exchange) and then resumed to its end. All the while a second process
calls ``pyarrow.parquet.read_table`` on the folder in a loop: every read that returns must be
A's complete results or B's. A read may fail (the folder between the two renames of the
fallback, a file gone between listing and opening); it never returns a mix.

``BATCHJOB_READER_RUNS`` sets the number of killed-and-resumed overwrites (3 here, to keep the
suite fast; ``BATCHJOB_READER_RUNS=20`` for the full check).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from tests.e2e.jobkit import build_dataset, cli, killed_run, write_job

RUNS = int(os.environ.get("BATCHJOB_READER_RUNS", "3"))
KILL_POINTS = [
    "stage:1",
    "commit:1",
    "swap:1",
    "swap:1+noexchange",
    "swap:2+noexchange",
    "committed:1",
]
B_SETS = ("sampling.temperature=1.0",)  # job B: other rows than job A's

SAMPLER = r"""
import hashlib, json, os, sys, time
import pyarrow.parquet as pq

out, digests, stop, report = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
seen = {"A": 0, "B": 0, "error": 0, "mix": 0}
first_mix = None
while not os.path.exists(stop):
    try:
        t = pq.read_table(out).sort_by("row_id")
    except Exception:
        seen["error"] += 1
        continue
    d = hashlib.sha256(json.dumps(t.to_pylist(), sort_keys=True, default=str).encode()).hexdigest()
    name = next((k for k, v in digests.items() if v == d), "mix")
    seen[name] += 1
    if name == "mix" and first_mix is None:
        first_mix = sorted(os.listdir(out))
json.dump({"seen": seen, "first_mix": first_mix}, open(report, "w"))
"""


def _digest(table) -> str:
    import hashlib

    rows = table.sort_by("row_id").to_pylist()
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def _run(job: Path, sets: tuple[str, ...], fault: str | None = None) -> int:
    """One run of ``job``; with ``fault``: a subprocess killed at that point (-9)."""
    args = [a for s in (*sets, "output.overwrite=true") for a in ("--set", s)]
    if fault is None:
        res = cli("run", job, *args)
        assert res.exit_code == 0, res.output
        return 0
    point, _, option = fault.partition("+")
    env = {"BATCHJOB_RENAME_EXCHANGE": "0"} if option == "noexchange" else None
    return killed_run(job, *args, spec=point, env=env).returncode


def test_readers_never_see_a_mix_of_two_jobs(tmp_path, run_model):
    data = build_dataset(tmp_path / "prompts.parquet", seed=5, scale=0.008)
    out = tmp_path / "out"
    job = write_job(tmp_path, run_model, data, out, rows_per_file="4", flush_rows="4")
    digests = {}
    for name, sets in (("B", B_SETS), ("A", ())):  # each job's results, for the reader
        _run(job, sets)
        digests[name] = _digest(pq.read_table(out))
    assert digests["A"] != digests["B"]
    stop, report = tmp_path / "stop", tmp_path / "seen.json"
    sampler = subprocess.Popen(
        [sys.executable, "-c", SAMPLER, str(out), json.dumps(digests), str(stop), str(report)]
    )
    rng = random.Random(20261127)
    try:
        for i in range(RUNS):
            name, sets = ("B", B_SETS) if i % 2 == 0 else ("A", ())
            fault = rng.choice(KILL_POINTS)
            assert _run(job, sets, fault) == -signal.SIGKILL, fault  # killed in its commit
            _run(job, sets)  # resumed: commits
            assert _digest(pq.read_table(out)) == digests[name], (i, fault)
        time.sleep(0.2)
    finally:
        stop.touch()
        sampler.wait(timeout=60)
    seen = json.loads(report.read_text())
    assert seen["seen"]["mix"] == 0, seen
    assert seen["seen"]["A"] > 0 and seen["seen"]["B"] > 0, seen
    print(f"{RUNS} killed and resumed overwrites: reads {seen['seen']}")
