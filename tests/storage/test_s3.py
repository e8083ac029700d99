"""Object stores for real: a moto S3 server on 127.0.0.1 (started here, a free port), the
``batchjob run`` CLI on the tiny model reading and writing ``s3://`` paths through pyarrow.fs.

Round trip equal to the same job run locally; a SIGKILL mid-run and another mid-commit, then
a rerun: exactly one row per input row and the same results; "already complete" as locally;
the lock object (conditional put) refuses a second writer; bad [storage] settings exit 3.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from batchjob.errors import EXIT_CONFIG, EXIT_LOCKED
from batchjob.storage.stores import ObjectPath, ObjectStore, list_files
from tests.e2e.jobkit import (
    build_dataset,
    build_model,
    cli,
    killed_run,
    read_results,
)

moto_server = pytest.importorskip("moto.server", reason="moto[server] (dev extra) not installed")
boto3 = pytest.importorskip("boto3")

BUCKET = "batchjob-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A real S3-compatible server on the loopback address; env points every client at it."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    fs = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], region="us-east-1")
    try:
        yield fs
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("s3-model") / "tiny")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, s3) -> tuple[Path, str]:
    """The dataset locally and as two objects under s3://BUCKET/in/ (+ a _SUCCESS marker)."""
    local = build_dataset(tmp_path_factory.mktemp("s3-data") / "prompts.parquet")
    table = pq.read_table(local)
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), f"{BUCKET}/in/a.parquet", filesystem=s3)
    pq.write_table(table.slice(half), f"{BUCKET}/in/b.parquet", filesystem=s3)
    with s3.open_output_stream(f"{BUCKET}/in/_SUCCESS") as f:
        f.write(b"")
    return local, f"s3://{BUCKET}/in/"


@pytest.fixture(scope="module")
def local_results(tmp_path_factory: pytest.TempPathFactory, model, data):
    """The reference: the same job, input and output local."""
    out = tmp_path_factory.mktemp("s3-local") / "out"
    res = cli("run", "--no-progress", *_job(model, str(data[0]), str(out)))
    assert res.exit_code == 0, res.output
    return read_results(out)


def _job(model: Path, inp: str, out: str, *sets: str) -> list[str]:
    base = ["model.device=cpu", "sampling.max_tokens=6", "scheduler.chunk_size=64"]
    base += ["engine.kv_cache_bytes=8MiB", "engine.threads=1", *sets]
    return ["--model", str(model), "--input", inp, "--output", out] + [
        a for s in base for a in ("--set", s)
    ]


def _read(fs: pafs.S3FileSystem, uri: str):
    return pq.read_table(ObjectPath(uri).key, filesystem=fs).sort_by("row_id")


def _keys(fs: pafs.S3FileSystem, prefix: str) -> list[str]:
    sel = pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True)
    return sorted(
        i.path[len(BUCKET) + len(prefix) + 2 :] for i in fs.get_file_info(sel) if i.is_file
    )


def test_round_trip_equals_local_and_rerun_is_already_complete(s3, model, data, local_results):
    out = f"s3://{BUCKET}/out/day1"
    res = cli("run", "--no-progress", *_job(model, data[1], out))
    assert res.exit_code == 0, res.output
    assert _read(s3, out).equals(local_results)
    assert _results(_keys(s3, "out/day1")) == 1
    meta = _keys(s3, "out/day1.meta")
    assert {"manifest.json", "plan.parquet", "report.json"} <= set(meta)
    assert not [k for k in meta if k.startswith(("parts/", "lock", "staging"))], meta
    manifest = json.loads(s3.open_input_stream(f"{BUCKET}/out/day1.meta/manifest.json").read())
    files = [f[0] for f in manifest["fingerprint"]["input.files"]]
    assert files == [f"s3://{BUCKET}/in/a.parquet", f"s3://{BUCKET}/in/b.parquet"]

    again = cli("run", "--no-progress", *_job(model, data[1], out))
    assert again.exit_code == 0 and "already complete" in again.output, again.output
    other = cli("run", "--no-progress", *_job(model, data[1], out, "sampling.max_tokens=3"))
    assert other.exit_code == EXIT_CONFIG and "sampling.max_tokens" in other.stderr


def test_kill_mid_run_and_mid_commit_then_resume_exactly_once(s3, model, data, local_results):
    out = f"s3://{BUCKET}/out/killed"
    args = _job(model, data[1], out, "scheduler.chunk_size=8", "output.flush_rows=1")
    args += ["--set", "output.rows_per_file=10"]
    killed = killed_run(*args, spec="part:4")
    assert killed.returncode == -9, killed.stderr
    keys = _keys(s3, "out/killed.meta")
    assert len([k for k in keys if k.startswith("parts/part-")]) == 3 and "lock" in keys, keys
    assert _keys(s3, "out/killed") == []  # nothing committed

    # the rerun takes over the dead run's lock, resumes, and is killed after the first file
    killed = killed_run(*args, spec="commit_file:1")
    assert killed.returncode == -9, killed.stderr
    partial = _keys(s3, "out/killed")
    assert _results(partial) == 1 and "_SUCCESS" not in partial  # readers: incomplete
    assert "commit.json" in _keys(s3, "out/killed.meta")  # what the commit writes, replaces

    # the next rerun commits, then is killed after deleting its first part
    killed = killed_run(*args, spec="cleanup:1")
    assert killed.returncode == -9, killed.stderr
    assert "_SUCCESS" in _keys(s3, "out/killed")
    assert "parts/_CLEANUP" in _keys(s3, "out/killed.meta")

    res = cli("run", "--no-progress", *args)  # complete: the leftover parts are just removed
    assert res.exit_code == 0 and "already complete" in res.output, res.output
    success = json.loads(s3.open_input_stream(f"{BUCKET}/out/killed/_SUCCESS").read())
    assert sorted(_keys(s3, "out/killed")) == sorted(["_SUCCESS", *success["files"]])
    got = _read(s3, out)
    assert got["row_id"].to_pylist() == list(range(local_results.num_rows))
    assert got.equals(local_results)
    assert not [k for k in _keys(s3, "out/killed.meta") if k.startswith(("parts/", "lock"))]


# the kill/fault soak of tests/e2e/test_fault_injection.py on object-store outputs: a folder
# (commit in place: commit, each file, committed) and a single object (one PUT), every named
# point the object-store write path passes, and a seeded random time
_soak = random.Random(20261201)
S3_KILLS = [
    ("folder", ["part:1"]),
    ("folder", [f"part:{_soak.randint(2, 6)}"]),
    ("folder", ["manifest:1"]),
    ("folder", ["commit:1"]),
    ("folder", ["commit_file:2"]),
    ("folder", ["committed:1"]),
    ("folder", ["report:1"]),
    ("folder", ["part:2", "commit_file:1", "cleanup:2"]),
    ("folder", [f"timed:{_soak.uniform(1.0, 6.0):.2f}"]),
    ("object", ["commit:1"]),
    ("object", ["commit_file:1"]),
    ("object", ["committed:1"]),
]


@pytest.mark.parametrize(
    ("kind", "specs"), S3_KILLS, ids=[f"{k}-{'-'.join(s)}" for k, s in S3_KILLS]
)
def test_killed_at_each_point_on_s3_reruns_exactly_once(
    s3, model, data, local_results, kind, specs
):
    """SIGKILLed at the point (each spec one killed run), then rerun: exactly one result row
    per input row, equal to the uninterrupted run, and nothing left in the meta folder but
    the manifest, plan and report."""
    name = f"soak-{kind}-{'-'.join(specs).replace(':', '')}"
    out = f"s3://{BUCKET}/out/{name}" + (".parquet" if kind == "object" else "")
    prefix = out.removeprefix(f"s3://{BUCKET}/")
    args = _job(model, data[1], out, "scheduler.chunk_size=8", "output.flush_rows=2")
    args += ["--set", "output.rows_per_file=10"]
    for spec in specs:
        killed = killed_run(*args, spec=spec)
        assert killed.returncode == -9 or spec.startswith("timed"), killed.stderr
    res = cli("run", "--no-progress", *args)
    assert res.exit_code == 0, res.output
    got = _read(s3, out)
    assert got["row_id"].to_pylist() == list(range(local_results.num_rows))  # once each
    assert got.equals(local_results)
    meta = _keys(s3, f"{prefix}.meta")
    assert {"manifest.json", "plan.parquet", "report.json"} <= set(meta)
    assert not [k for k in meta if k.startswith(("parts/", "lock", "commit"))], meta
    if kind == "folder":
        success = json.loads(s3.open_input_stream(f"{BUCKET}/{prefix}/_SUCCESS").read())
        assert sorted(_keys(s3, prefix)) == sorted(["_SUCCESS", *success["files"]])
    again = cli("run", "--no-progress", *args)
    assert again.exit_code == 0 and "already complete" in again.output, again.output


def test_lock_object_refuses_a_second_writer(s3, model, data):
    out = f"s3://{BUCKET}/out/locked"
    holder = {"host": "elsewhere", "pid": 1, "token": "x", "since": "2026-11-23T00:00:00+00:00"}
    with s3.open_output_stream(f"{BUCKET}/out/locked.meta/lock") as f:
        f.write(json.dumps(holder).encode())
    res = cli("run", "--no-progress", *_job(model, data[1], out))
    assert res.exit_code == EXIT_LOCKED, res.output
    assert "elsewhere" in res.stderr and f"{out}.meta/lock" in res.stderr
    assert _keys(s3, "out/locked") == []


def test_a_dead_local_holder_is_taken_over(s3, model, data, local_results):
    out = f"s3://{BUCKET}/out/stale.parquet"
    dead = {"host": socket.gethostname(), "pid": 2**22 + 7, "token": "y", "since": "?"}
    with s3.open_output_stream(f"{BUCKET}/out/stale.parquet.meta/lock") as f:
        f.write(json.dumps(dead).encode())
    res = cli("run", "--no-progress", *_job(model, data[1], out))
    assert res.exit_code == 0, res.output
    assert _read(s3, out).equals(local_results)  # single-file output: one atomic PUT


def test_two_takers_of_a_dead_holders_lock_one_gets_it(s3, monkeypatch):
    """Issue 49: the takeover deleted the lock unconditionally, so a rerun that found the
    holder dead before another rerun took the lock over deleted that fresh lock and took it
    too (both inside). Taker A is paused right after its dead-holder check while B takes
    over; A must then be refused, B keep the lock."""
    import threading

    from batchjob.errors import LockedError
    from batchjob.storage import lock as locks

    key = f"{BUCKET}/out/race.meta/lock"
    dead = {"host": socket.gethostname(), "pid": 2**22 + 9, "token": "dead", "since": "?"}
    with s3.open_output_stream(key) as f:
        f.write(json.dumps(dead).encode())
    lock = ObjectPath(f"s3://{key}")
    a_checked, b_inside = threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    real_dead_here = locks._dead_here

    def paused_dead_here(holder):
        dead_now = real_dead_here(holder)
        if threading.current_thread().name == "taker-a":
            a_checked.set()
            b_inside.wait(30)  # the window: B takes over while A is past its check
        return dead_now

    monkeypatch.setattr(locks, "_dead_here", paused_dead_here)

    def taker_a():
        try:
            with locks.output_lock(lock, "race", token="A"):
                seen["a"] = "inside"
                seen["a_saw"] = locks.holder_token(lock)
        except LockedError as e:
            seen["a"] = e

    a = threading.Thread(target=taker_a, name="taker-a")
    a.start()
    assert a_checked.wait(30)
    with locks.output_lock(lock, "race", token="B"):
        b_inside.set()
        a.join(30)
        assert not a.is_alive()
        assert isinstance(seen["a"], LockedError), seen
        assert locks.holder_token(lock) == "B"
    assert not s3.get_file_info(key).is_file  # B's lock removed when B is done


@pytest.fixture
def flaky(s3):
    """A proxy in front of the S3 server that can go down for a moment (``outage``)."""
    from tests.storage.flaky_proxy import FlakyProxy

    host, port = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
    proxy = FlakyProxy((host, int(port)))
    yield proxy
    proxy.close()


def _run_through_an_outage(s3, flaky, args: list[str], prefix: str, seconds: float):
    """``batchjob run ARGS`` through the proxy, which goes down for ``seconds`` once the run
    has written two parts -> the finished process."""
    import subprocess
    import sys
    import time

    from tests.e2e.jobkit import ROOT

    cmd = [sys.executable, "-m", "batchjob.cli", "run", "--no-progress", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), AWS_ENDPOINT_URL=flaky.url)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len([k for k in _keys(s3, f"{prefix}.meta") if k.startswith("parts/part-")]) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "no parts written"
        time.sleep(0.02)
    flaky.outage(seconds)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


OUTAGE_S = 2.0  # longer than the AWS SDK's default two retries wait (about 0.1 to 2 s)


def test_an_object_store_outage_is_retried_through(s3, model, data, local_results, flaky):
    """A 2 s outage mid-run (connections cut, new ones refused): each request is retried
    (``storage.retries``, 10 by default) and the run finishes as if nothing happened. Before
    retries were configured it ended the run with exit 1 (pyarrow's default: two retries)."""
    out = f"s3://{BUCKET}/out/blip"
    args = _job(model, data[1], out, "scheduler.chunk_size=8", "output.flush_rows=1")
    code, err = _run_through_an_outage(s3, flaky, args, "out/blip", OUTAGE_S)
    assert flaky.outages == 1
    assert code == 0, err
    got = _read(s3, out)
    assert got["row_id"].to_pylist() == list(range(local_results.num_rows))
    assert got.equals(local_results)


def test_without_retries_an_outage_is_exit_1_and_the_rerun_resumes(
    s3, model, data, local_results, flaky
):
    out = f"s3://{BUCKET}/out/blip0"
    args = _job(model, data[1], out, "scheduler.chunk_size=8", "output.flush_rows=1")
    code, err = _run_through_an_outage(
        s3, flaky, [*args, "--set", "storage.retries=0"], "out/blip0", OUTAGE_S
    )
    assert code == 1, err
    lines = [x for x in err.strip().splitlines() if not x.startswith("batchjob: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "rerun" in lines[0], err
    parts = [k for k in _keys(s3, "out/blip0.meta") if k.startswith("parts/part-")]
    assert parts and _keys(s3, "out/blip0") == []  # rows written so far are kept
    res = cli("run", "--no-progress", *args)
    assert res.exit_code == 0, res.output
    assert _read(s3, out).equals(local_results)


def test_storage_retries_bounds(s3, model, data):
    for bad in ("-1", "21", "true"):
        res = cli(
            "run", "--no-progress", *_job(model, data[1], "s3://x/o", f"storage.retries={bad}")
        )
        assert res.exit_code == EXIT_CONFIG and res.stderr.startswith("error: storage.retries:")


def _results(names: list[str]) -> int:
    """How many result files: ``results-NNNNN-<commit>.parquet``, and nothing but _SUCCESS."""
    found = [n for n in names if n.startswith("results-") and n.endswith(".parquet")]
    assert set(names) - set(found) <= {"_SUCCESS"}, names
    return len(found)


def test_overwrite_killed_mid_commit_keeps_every_old_object(s3, model, data, local_results):
    """An object store has no rename: an overwrite deletes ``_SUCCESS`` first (readers: not
    complete), writes its files under new names and deletes the old ones only once every new
    one is written. Killed in between, the old commit's objects are all there, unchanged."""
    out = f"s3://{BUCKET}/out/over"
    args = _job(model, data[1], out, "output.rows_per_file=10")
    assert cli("run", "--no-progress", *args).exit_code == 0
    old = json.loads(s3.open_input_stream(f"{BUCKET}/out/over/_SUCCESS").read())["files"]
    args2 = [*args, "--set", "sampling.temperature=1.0", "--set", "output.overwrite=true"]
    killed = killed_run(*args2, spec="commit_file:2")
    assert killed.returncode == -9, killed.stderr
    keys = _keys(s3, "out/over")
    assert "_SUCCESS" not in keys and set(old) <= set(keys) and _results(keys) == len(old) + 2
    tables = [pq.read_table(f"{BUCKET}/out/over/{n}", filesystem=s3) for n in old]
    assert pa.concat_tables(tables).sort_by("row_id").equals(local_results)  # whole, as before
    res = cli("run", "--no-progress", *args2)
    assert res.exit_code == 0, res.output
    new = json.loads(s3.open_input_stream(f"{BUCKET}/out/over/_SUCCESS").read())["files"]
    assert sorted(_keys(s3, "out/over")) == sorted(["_SUCCESS", *new]) and not set(new) & set(old)


def test_uri_listing_and_globs(s3, data):
    assert list_files(f"s3://{BUCKET}/in") == [
        f"s3://{BUCKET}/in/_SUCCESS",
        f"s3://{BUCKET}/in/a.parquet",
        f"s3://{BUCKET}/in/b.parquet",
    ]
    assert list_files(f"s3://{BUCKET}/in/b*.parquet") == [f"s3://{BUCKET}/in/b.parquet"]
    assert list_files(f"s3://{BUCKET}/nothing/*.parquet") == []


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["storage.options={no_such_option = 1}"], "storage.options"),
        (["storage.endpoint_url=ftp://127.0.0.1"], "storage.endpoint_url"),
        (["storage.anonymous=maybe"], "storage.anonymous"),
        (["model.chat_template=s3://bucket/template.jinja"], "model.chat_template"),
        (["output.format=openai-jsonl"], "output.format"),
    ],
)
def test_bad_storage_settings_exit_3_naming_the_key(s3, model, data, sets, key):
    args = _job(model, data[1], f"s3://{BUCKET}/out/bad", *sets)
    res = cli("run", "--no-progress", *args)
    assert res.exit_code == EXIT_CONFIG, res.output
    assert res.stderr.startswith(f"error: {key}:") and "Traceback" not in res.output


def test_model_path_must_be_local(s3, model, data):
    args = _job(model, data[1], f"s3://{BUCKET}/out/bad")
    args[args.index("--model") + 1] = f"s3://{BUCKET}/model"
    res = cli("run", "--no-progress", *args)
    assert res.exit_code == EXIT_CONFIG and res.stderr.startswith("error: model.path:"), res.output


def test_missing_bucket_is_exit_3(s3, model, data):
    res = cli("run", "--no-progress", *_job(model, data[1], "s3://no-such-bucket-x/out"))
    assert res.exit_code == EXIT_CONFIG and "no-such-bucket-x" in res.stderr, res.output


def test_any_fsspec_filesystem_round_trip(s3, model, data, local_results, caplog):
    """memory:// is fsspec's (pyarrow has none): the same write path through PyFileSystem;
    no conditional put there, so the run says it assumes a single writer."""
    pytest.importorskip("fsspec")
    out = "memory://bkt/out/day1"
    res = cli("run", "--no-progress", *_job(model, str(data[0]), out))
    assert res.exit_code == 0, res.output
    store = ObjectStore("memory")
    files = store.glob(ObjectPath(out), "*")
    assert files[0].name == "_SUCCESS" and _results([f.name for f in files]) == 1
    assert store.read_parquet(files[1]).sort_by("row_id").equals(local_results)
    assert "assumes it is the only one writing" in caplog.text
    assert not store.exists(ObjectPath(out + ".meta/lock"))


def test_plan_with_the_endpoint_from_the_storage_section(s3, model, data, monkeypatch):
    """No AWS_ENDPOINT_URL: [storage] endpoint_url alone reaches the server (input and plan)."""
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    out = f"s3://{BUCKET}/out/planned"
    args = _job(model, data[1], out, f"storage.endpoint_url={endpoint}")
    res = cli("plan", *args)
    assert res.exit_code == 0, res.output
    assert _keys(s3, "out/planned.meta") == ["plan.parquet"]
