"""Fault injection: SIGKILL a small job at named points (and at seeded random times), rerun,
and check exactly-once results equal to an uninterrupted run, with no temp files left.

Named points (``storage.faults``): before a part file is written (``part``), after the job's
manifest (``manifest``), after each final file is staged (``stage``), at the start of the
commit (``commit``), after each rename of the folder commit (``swap``: the one exchange, or
each of the two renames without rename-exchange, ``BATCHJOB_RENAME_EXCHANGE=0``), after each
file of an in-place commit (``commit_file``), after the commit's manifest (``committed``),
before the report (``report``) and between renaming the parts away and deleting them
(``cleanup``). Killed runs are subprocesses; reruns run in this process (no start-up cost).

Overwrites: a folder holding job A's results, job B run over it with ``output.overwrite`` and
killed at every rename of its commit: right after the kill a reader of the folder finds A's
complete results or B's (or, between the two renames of the fallback, no folder), never a mix;
the rerun commits B.
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.e2e.jobkit import build_dataset, cli, killed_run, write_job

SEED = 20261123
COLS = ["row_id", "output_token_ids", "num_output_tokens", "finish_reason", "status", "request_id"]
_rng = random.Random(SEED)
# (label, [fault specs applied one after another, each a killed run]) - the same on every run
KILLS: list[tuple[str, list[str]]] = [
    ("first part", ["part:1"]),
    ("mid run", [f"part:{_rng.randint(2, 5)}"]),
    ("last parts", [f"part:{_rng.randint(6, 8)}"]),
    ("after manifest", ["manifest:1"]),
    ("staging 1st file", ["stage:1"]),
    ("staging later file", [f"stage:{_rng.randint(2, 3)}"]),
    ("commit start", ["commit:1"]),
    ("after the rename into place", ["swap:1"]),
    ("after commit", ["committed:1"]),
    ("before report", ["report:1"]),
    ("during cleanup", ["cleanup:1"]),
    ("three in a row", ["part:2", "stage:2", "cleanup:1"]),
    ("timed", [f"timed:{_rng.uniform(0.5, 4.0):.2f}"]),
    ("timed twice", [f"timed:{_rng.uniform(0.5, 3.0):.2f}", f"timed:{_rng.uniform(2.0, 5.0):.2f}"]),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, run_model):
    d = tmp_path_factory.mktemp("fi")
    data = build_dataset(d / "prompts.parquet", seed=5, scale=0.008)
    ref_job = write_job(d, run_model, data, d / "ref", rows_per_file="5")
    res = cli("run", ref_job)
    assert res.exit_code == 0, res.output
    return run_model, data, pq.read_table(d / "ref").sort_by("row_id").select(COLS)


def _killed_run(job: Path, spec: str, *sets: str) -> int:
    spec, _, option = spec.partition("+")
    env = {"BATCHJOB_RENAME_EXCHANGE": "0"} if option == "noexchange" else None
    args = ["--set", "scheduler.chunk_size=16"]  # many iterations: parts land one by one
    args += [a for s in sets for a in ("--set", s)]
    return killed_run(job, *args, spec=spec, env=env).returncode


@pytest.mark.parametrize("label,specs", KILLS, ids=[k[0] for k in KILLS])
def test_killed_job_reruns_to_the_same_results(tmp_path, setup, label, specs):
    model, data, expected = setup
    out = tmp_path / "out"
    job = write_job(tmp_path, model, data, out, rows_per_file="5", flush_rows="2")
    codes = [_killed_run(job, spec) for spec in specs]
    assert -signal.SIGKILL in codes or label.startswith("timed")  # the point was reached
    res = cli("run", job)
    assert res.exit_code == 0, res.output
    got = pq.read_table(out).sort_by("row_id").select(COLS)
    assert got["row_id"].to_pylist() == list(range(expected.num_rows))  # once each
    assert got.equals(expected), label
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "_SUCCESS" and all(n.startswith("results-") for n in names[1:])
    meta = tmp_path / "out.meta"
    assert sorted(p.name for p in meta.iterdir() if not p.name.startswith("report")) == [
        "lock",
        "manifest.json",
        "plan.parquet",
    ]
    assert (meta / "report.json").is_file()
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp") or ".trash" in p.name]
    assert not leftovers, leftovers
    again = cli("run", job)
    assert again.exit_code == 0 and "already complete" in again.output
    assert pa.concat_tables([got]).num_rows == expected.num_rows


# ---------------------------------------------------------------------------------------
# an overwrite killed at every rename: readers see the old results or the new, never a mix

OVERWRITE_KILLS = [
    "stage:2",
    "commit:1",
    "swap:1",
    "swap:1+noexchange",
    "swap:2+noexchange",
    "committed:1",
    "cleanup:1",
]
B_SETS = ("sampling.temperature=1.0", "output.overwrite=true")  # job B: another job's results


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory, setup):
    """Reference results of job A and of job B (the same folder layout)."""
    model, data, _ = setup
    d = tmp_path_factory.mktemp("ab")
    refs = []
    for name, sets in (("a", ()), ("b", B_SETS)):
        job = write_job(d, model, data, d / name, rows_per_file="5")
        args = [a for s in sets for a in ("--set", s)]
        assert cli("run", job, *args).exit_code == 0
        refs.append(pq.read_table(d / name).sort_by("row_id"))
    assert not refs[0].equals(refs[1])
    return refs


def _state(out: Path, a: pa.Table, b: pa.Table) -> str:
    """What a reader of the results folder finds: "A", "B", "none" (no folder) or "mix"."""
    try:
        got = pq.read_table(out).sort_by("row_id")
    except FileNotFoundError:
        return "none"
    return "A" if got.equals(a) else "B" if got.equals(b) else "mix"


@pytest.mark.parametrize("spec", OVERWRITE_KILLS)
def test_overwrite_killed_at_each_rename_leaves_old_or_new(tmp_path, setup, two_jobs, spec):
    model, data, _ = setup
    a, b = two_jobs
    out = tmp_path / "out"
    job = write_job(tmp_path, model, data, out, rows_per_file="5", flush_rows="2")
    assert cli("run", job).exit_code == 0
    assert _state(out, a, b) == "A"
    assert _killed_run(job, spec, *B_SETS) == -signal.SIGKILL
    state = _state(out, a, b)
    allowed = {"A", "B", "none"} if spec == "swap:1+noexchange" else {"A", "B"}
    assert state in allowed, (spec, state)
    assert (out / "_SUCCESS").exists() or state == "none"
    res = cli("run", job, *[x for s in B_SETS for x in ("--set", s)])
    assert res.exit_code == 0, res.output
    assert _state(out, a, b) == "B"
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "_SUCCESS" and all(n.startswith("results-") for n in names[1:])
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp") or ".trash" in p.name]
    assert not leftovers and not (tmp_path / "out.meta" / "previous").exists(), leftovers


@pytest.mark.parametrize("spec", ["commit_file:1", "commit_file:2", "committed:1"])
def test_in_place_overwrite_of_a_shared_folder(tmp_path, setup, two_jobs, spec):
    """A folder shared with other files (``output.allow_other_files``) commits in place: after
    a kill, ``_SUCCESS`` is there only with one whole commit's files, the other files are
    untouched, and the rerun commits B."""
    model, data, _ = setup
    a, b = two_jobs
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    job = write_job(tmp_path, model, data, out, rows_per_file="5", allow_other_files="true")
    assert cli("run", job).exit_code == 0
    assert _committed(out).equals(a)
    assert _killed_run(job, spec, *B_SETS) == -signal.SIGKILL
    if (out / "_SUCCESS").exists():
        assert _committed(out).equals(b)  # written last: the new commit is whole
    res = cli("run", job, *[x for s in B_SETS for x in ("--set", s)])
    assert res.exit_code == 0, res.output
    assert _committed(out).equals(b) and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("results-")) == [
        "_SUCCESS",
        "notes.txt",
    ]
    assert len(list(out.glob("results-*.parquet"))) == len(_success(out)["files"])


def _success(out: Path) -> dict:
    return json.loads((out / "_SUCCESS").read_text())


def _committed(out: Path) -> pa.Table:
    """The rows of the commit ``_SUCCESS`` names (the reader's protocol for a shared folder)."""
    files = [out / n for n in _success(out)["files"]]
    return pa.concat_tables([pq.read_table(f) for f in files]).sort_by("row_id")
