"""Single-machine scale: millions of short token-id prompts through `batchjob plan` / `run`.

Generates share-heavy token-id datasets with numpy and streams them to Parquet row group by
row group (never a Python object per row): groups of 8-16 rows share a 16-64-token prefix,
each row adds a 4-16-token suffix, rows shuffled within each 256k-row chunk. Then runs the
real CLI as a subprocess (``python -m batchjob.cli -v plan|run ... --json``) and samples its
resident set from /proc/<pid>/status every 50 ms:

- wall time per stage: from the command's own JSON (plan: the summary's stages; run: the
  report's ``stage_s``);
- peak RSS per stage: the largest sampled VmRSS between the stage's log lines (``-v`` logs
  one line as each stage ends, timestamped); the whole process's peak is its VmHWM (kernel
  high-water mark, exact), which the sampler reads last.

    .venv/bin/python benchmarks/bench_scale.py plan --rows 100000,300000,1000000,10000000
    .venv/bin/python benchmarks/bench_scale.py plan --rows 10000000 --plan-memory 1GiB  # partitions
    .venv/bin/python benchmarks/bench_scale.py run --rows 500000,1000000
    .venv/bin/python benchmarks/bench_scale.py run --rows 1000000 --plan-memory 128MiB  # partitions
    .venv/bin/python benchmarks/bench_scale.py run --rows 10000000 --plan-memory 16MiB \
        --kill-at 0.3,0.7   # SIGKILLed at 30% and 70% of the rows, resumed, checked exactly once
    .venv/bin/python benchmarks/bench_scale.py all   # both (what `make bench-scale` runs)

Data, models and outputs go under data/scale/ and out/scale/ (both gitignored); datasets
are reused when they exist. Results: one JSON line per run appended to data/scale/results.jsonl
and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "scale"
OUT = ROOT / "out" / "scale"
MODEL = DATA / "tiny-model"
PLAN_VOCAB = 32_000  # plan needs no model: ids from a realistic vocab
CHUNK_ROWS = 1 << 18


def _ragged(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenated ranges starts[i] : starts[i] + sizes[i] (int64)."""
    seg = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(starts, sizes) + (np.arange(int(sizes.sum()), dtype=np.int64) - seg)


def shared_chunk(rng: np.random.Generator, rows: int, vocab: int) -> pa.ListArray:
    """``rows`` token-id prompts: groups of 8-16 rows share a 16-64-token prefix, each row
    adds a distinct 4-16-token suffix; rows shuffled. list<int32>, built from numpy arrays."""
    sizes = rng.integers(8, 17, size=rows // 8 + 1)
    sizes = sizes[: int(np.searchsorted(np.cumsum(sizes), rows)) + 1]
    sizes[-1] -= int(sizes.sum()) - rows  # the last group takes what is left
    group = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    p_len = rng.integers(16, 65, size=len(sizes))
    p_off = np.concatenate([[0], np.cumsum(p_len)])
    prefixes = rng.integers(0, vocab, size=int(p_off[-1]), dtype=np.int32)
    s_len = rng.integers(4, 17, size=rows)
    lengths = p_len[group] + s_len
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.empty(int(offsets[-1]), dtype=np.int32)
    tokens[_ragged(offsets[:-1], p_len[group])] = prefixes[_ragged(p_off[group], p_len[group])]
    dst = _ragged(offsets[:-1] + p_len[group], s_len)
    tokens[dst] = rng.integers(0, vocab, size=len(dst), dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))


def write_dataset(path: Path, rows: int, vocab: int, seed: int = 0) -> Path:
    """Stream ``rows`` rows (columns id, prompt) to ``path``, one row group per chunk."""
    if path.exists() and pq.read_metadata(path).num_rows == rows:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.list_(pa.int32()))])
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, schema) as w:
        for start in range(0, rows, CHUNK_ROWS):
            n = min(CHUNK_ROWS, rows - start)
            ids = pa.array(np.arange(start, start + n, dtype=np.int64))
            w.write_table(pa.table([ids, shared_chunk(rng, n, vocab)], schema=schema))
    tmp.rename(path)
    return path


def tiny_model() -> tuple[Path, int]:
    """2 layers, hidden 64, ~1000-token vocab (built once); returns (folder, vocab size)."""
    if not (MODEL / "config.json").exists():
        from batchjob.testing.tiny_model import make_tiny_model

        make_tiny_model(MODEL, vocab_size=1024, hidden=64, layers=2, heads=4, kv_heads=2)
    return MODEL, int(json.loads((MODEL / "config.json").read_text())["vocab_size"])


# ---------------------------------------------------------------------------------------
# measuring a subprocess


def _status_kb(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0])
    except (OSError, ValueError):
        pass
    return out


_LOG = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) batchjob\S*: stage (\w+) done")


def measure(
    cmd: list[str], env: dict[str, str], log: Path, kill_when: Callable[[], bool] | None = None
) -> dict:
    """Run ``cmd``; sample its RSS every 50 ms; split samples at the stage log lines.
    The command's stderr is copied to ``log`` as it comes (heartbeat lines: progress).
    ``kill_when``: checked every 2 s; once true the command is SIGKILLed (``killed`` in the
    result, no ``json``)."""
    t_start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    samples: list[tuple[float, int]] = []
    hwm = [0]
    err_lines: list[str] = []
    killed = [False]

    def sample() -> None:
        next_check = time.time() + 2.0
        while proc.poll() is None:
            s = _status_kb(proc.pid)
            if s:
                samples.append((time.time(), s.get("VmRSS", 0)))
                hwm[0] = max(hwm[0], s.get("VmHWM", 0))
            if kill_when is not None and time.time() >= next_check:
                next_check = time.time() + 2.0
                if kill_when():
                    proc.send_signal(signal.SIGKILL)
                    killed[0] = True
                    return
            time.sleep(0.05)

    def read_err() -> None:
        assert proc.stderr is not None
        with open(log, "w") as f:
            for line in proc.stderr:
                err_lines.append(line)
                f.write(line)
                f.flush()

    threads = [threading.Thread(target=sample), threading.Thread(target=read_err)]
    for t in threads:
        t.start()
    stdout = proc.stdout.read() if proc.stdout else ""
    rc = proc.wait()
    for t in threads:
        t.join()
    wall = time.time() - t_start
    if killed[0]:
        peak = max((kb for _, kb in samples), default=0)
        return {"wall_s": wall, "peak_rss_kb": max(hwm[0], peak), "killed": True, "rc": rc}
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{''.join(err_lines[-20:])}")
    ends: list[tuple[str, float]] = []
    for line in err_lines:
        m = _LOG.match(line)
        if m and m.group(2) not in dict(ends):
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            ends.append((m.group(2), t))
    peaks: dict[str, int] = {}
    last = t_start
    for name, t in ends:  # a sample belongs to the stage whose end log line follows it
        peaks[name] = max((kb for ts, kb in samples if last <= ts <= t + 0.05), default=0)
        last = t
    return {
        "wall_s": wall,
        "peak_rss_kb": max(hwm[0], max((kb for _, kb in samples), default=0)),
        "stage_peak_kb": peaks,
        "json": json.loads(stdout[stdout.index("{") :]),
    }


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


SRC: str | None = None  # --src: another checkout's batchjob (e.g. before a fix)


def _cli() -> list[str]:
    if SRC is None:
        return [sys.executable, "-m", "batchjob.cli"]
    # the editable install's import hook would win over sys.path: drop it in the child; the
    # checkout's top-level kernels/ is the package batchjob.kernels (pyproject's package-dir)
    code = (
        "import sys, importlib.util as u; sys.meta_path[:] = [f for f in sys.meta_path"
        f" if 'editable' not in repr(f)]; sys.path.insert(0, {SRC!r}); k = {SRC!r} + '/kernels';"
        " s = u.spec_from_file_location('batchjob.kernels', k + '/__init__.py',"
        " submodule_search_locations=[k]); m = u.module_from_spec(s);"
        " sys.modules['batchjob.kernels'] = m; s.loader.exec_module(m);"
        " from batchjob.cli import main; main()"
    )
    return [sys.executable, "-c", code]


def bench_plan(rows: int, plan_memory: str | None = None) -> dict:
    """``plan_memory``: scheduler.plan_memory (a budget below the dataset's plans it in
    partitions); None: the default (half of RAM)."""
    data = write_dataset(DATA / f"plan-{rows}.parquet", rows, PLAN_VOCAB)
    out = OUT / f"plan-{rows}"
    cmd = [*_cli(), "-v", "plan", "--input", str(data)]
    cmd += ["--output", str(out), "--set", "input.batch_rows=65536", "--json"]
    if plan_memory:
        cmd += ["--set", f"scheduler.plan_memory={plan_memory}"]
    r = measure(cmd, _env(), OUT / f"plan-{rows}.log")
    stages = {s["name"]: s["seconds"] for s in r["json"].get("stages", [])}
    parts = r["json"].get("partitions")
    what = f"plan ({parts['count']} partitions)" if parts else "plan"
    saving = {k: r["json"][k] for k in ("saving_ratio_single_level", "saving_ratio_multi_level")}
    return {
        "command": what,
        "rows": rows,
        **r,
        "stage_s": stages,
        "plan_memory": plan_memory,
        **saving,
    }


def _run_cmd(data: Path, out: Path, model: Path, max_tokens: int, plan_memory: str | None):
    cmd = [*_cli(), "-v", "run", "--input", str(data)]
    cmd += ["--output", str(out), "--model", str(model), "--no-progress", "--json"]
    cmd += ["--set", f"sampling.max_tokens={max_tokens}", "--set", "sampling.ignore_eos=true"]
    cmd += ["--set", "output.overwrite=true", "--set", "model.device=cpu"]
    # one torch thread: on a shared 2-core machine OpenMP threads spin against other
    # processes (2,000 rows: 28 req/s with 2 threads, 413 with 1); a 256 MiB KV cache (the
    # tiny model's peak use is ~5 MB) so that the RSS shows what the rows cost
    cmd += ["--set", "engine.threads=1", "--set", f"engine.kv_cache_bytes={256 << 20}"]
    if plan_memory:  # a budget below the dataset's planning runs it partition by partition
        cmd += ["--set", f"scheduler.plan_memory={plan_memory}"]
    return cmd


def bench_run(rows: int, max_tokens: int, plan_memory: str | None = None) -> dict:
    model, vocab = tiny_model()
    data = write_dataset(DATA / f"run-{rows}-v{vocab}.parquet", rows, vocab)
    out = OUT / f"run-{rows}"
    cmd = _run_cmd(data, out, model, max_tokens, plan_memory)
    r = measure(cmd, _env(), OUT / f"run-{rows}.log")
    what = f"run (plan_memory {plan_memory})" if plan_memory else "run"
    stages = r["json"].get("stage_s", {})
    return {"command": what, "rows": rows, **r, "stage_s": stages, "plan_memory": plan_memory}


def _rows_written(parts: Path, seen: dict[str, int]) -> int:
    """Rows in the run's published part files (each read once: parts are immutable)."""
    for f in parts.glob("part-*.parquet"):
        if f.name not in seen:
            try:
                seen[f.name] = pq.read_metadata(f).num_rows
            except (OSError, pa.ArrowException):
                continue
    return sum(seen.values())


def _results(out: Path, columns: list[str]) -> pa.Table:
    files = sorted(out.glob("results-*.parquet")) if out.is_dir() else [out]
    return pa.concat_tables(pq.read_table(f, columns=columns) for f in files)


def _sample_check(data: Path, out: Path, model: Path, max_tokens: int, first: int) -> dict:
    """The rows whose prompt starts with one of the ``first`` most common first tokens (whole
    prefix groups: a group's rows share their first token), rerun uninterrupted in memory;
    their output tokens against the killed-and-resumed run's (matched by the input's id)."""
    f = pq.ParquetFile(data)
    lead = np.concatenate(
        [
            pc.list_element(f.read_row_group(g, columns=["prompt"])["prompt"], 0).to_numpy()
            for g in range(f.num_row_groups)
        ]
    )
    keep = np.isin(lead, np.argsort(-np.bincount(lead))[:first])
    ids = np.flatnonzero(keep)  # the input's id is its row's position
    sample = pq.read_table(data, filters=pc.field("id").isin(ids))
    path = DATA / f"sample-{sample.num_rows}.parquet"
    pq.write_table(sample, path)
    ref_out = OUT / f"sample-{sample.num_rows}"
    cmd = _run_cmd(path, ref_out, model, max_tokens, None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    cols = ["id", "output_token_ids", "status"]
    ref = _results(ref_out, cols).sort_by("id")
    got = _results(out, cols)
    got = got.take(pa.array(np.searchsorted(got["id"].to_numpy(), ids)))
    assert np.array_equal(got["id"].to_numpy(), ref["id"].to_numpy())
    a, b = ref["output_token_ids"].to_pylist(), got["output_token_ids"].to_pylist()
    return {"sample_rows": len(a), "sample_equal": sum(x == y for x, y in zip(a, b, strict=True))}


def bench_run_killed(
    rows: int, max_tokens: int, plan_memory: str | None, kill_at: list[float], sample_first: int
) -> dict:
    """``batchjob run`` SIGKILLed once its parts hold each fraction ``kill_at`` of the rows,
    rerun with the same command each time (it resumes), then checked: every row id once,
    every status ok, and the outputs of a sample equal to an uninterrupted in-memory run."""
    model, vocab = tiny_model()
    data = write_dataset(DATA / f"run-{rows}-v{vocab}.parquet", rows, vocab)
    out = OUT / f"run-{rows}-killed"
    meta = out.with_name(out.name + ".meta")
    cmd = _run_cmd(data, out, model, max_tokens, plan_memory)
    attempts = []
    for k, frac in enumerate([*kill_at, None]):
        seen: dict[str, int] = {}

        def due(frac: float | None = frac, seen: dict[str, int] = seen) -> bool:
            return frac is not None and _rows_written(meta / "parts", seen) >= frac * rows

        r = measure(cmd, _env(), OUT / f"run-{rows}-killed-{k}.log", kill_when=due)
        if r.get("killed"):
            r["rows_written_at_kill"] = _rows_written(meta / "parts", {})
        attempts.append({k: v for k, v in r.items() if k != "json"})
        print(f"attempt {k}: {attempts[-1]}", file=sys.stderr, flush=True)
        if not r.get("killed"):
            break  # done (a kill point past the end: the run finished first)
    final = r["json"]
    ids = _results(out, ["row_id"])["row_id"].to_numpy()
    status = _results(out, ["status"])["status"]
    once = bool(len(ids) == rows and np.array_equal(np.sort(ids), np.arange(rows)))
    ok = int(pc.sum(pc.equal(status, "ok")).as_py() or 0)
    check = _sample_check(data, out, model, max_tokens, sample_first)
    last = attempts[-1]
    return {
        "command": f"run killed at {','.join(map(str, kill_at))} (plan_memory {plan_memory})",
        "rows": rows,
        "wall_s": sum(a["wall_s"] for a in attempts),
        "peak_rss_kb": max(a["peak_rss_kb"] for a in attempts),
        "stage_peak_kb": last["stage_peak_kb"],
        "stage_s": final.get("stage_s", {}),
        "json": final,
        "attempts": attempts,
        "rows_skipped_done": final.get("rows_skipped_done"),
        "exactly_once": once,
        "rows_ok": ok,
        **check,
        "plan_memory": plan_memory,
    }


# stage names in the JSON -> the stage whose log line ends it (read and tokenize interleave)
_LOGGED = {"read": "tokenize", "read_s": "tokenize", "tokenize_s": "tokenize", "plan_s": "plan"}
_LOGGED |= {"load_s": "load", "run_s": "run", "write_s": "write"}


def _row(r: dict) -> str:
    gib = 1024 * 1024
    stages = ", ".join(
        f"{k} {v:.1f} s / {r['stage_peak_kb'].get(_LOGGED.get(k, k), 0) / gib:.2f} GiB"
        for k, v in r["stage_s"].items()
        if isinstance(v, float)
    )
    saving = r["json"].get("saving_ratio_single_level")
    saving_s = f"{saving:.2%}" if isinstance(saving, float) else "-"
    return (
        f"| {r['command']} | {r['rows']:,} | {r['wall_s']:.1f} | "
        f"{r['peak_rss_kb'] / gib:.2f} | {r['peak_rss_kb'] * 1024 / r['rows']:.0f} | "
        f"{saving_s} | {stages} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["plan", "run", "all", "gen"])
    ap.add_argument("--rows", help="comma-separated row counts")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--label", default="", help="a name for these runs in results.jsonl")
    ap.add_argument("--src", help="import batchjob from this checkout (its batchjob/ and kernels/)")
    ap.add_argument("--plan-memory", help="scheduler.plan_memory, e.g. 1GiB")
    ap.add_argument(
        "--kill-at",
        help="run: SIGKILL once this fraction of the rows is written, rerun (comma-separated)",
    )
    ap.add_argument(
        "--sample-first",
        type=int,
        default=2,
        help="--kill-at: rerun the rows of this many first tokens uninterrupted to compare",
    )
    args = ap.parse_args()
    global SRC
    SRC = args.src
    plan_rows = run_rows = [int(s) for s in (args.rows or "0").split(",") if int(s)]
    if args.what == "all" or not plan_rows:
        plan_rows = plan_rows or [100_000, 300_000, 1_000_000, 10_000_000]
        run_rows = run_rows or [500_000, 1_000_000]
    results = []
    DATA.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    jobs = []
    if args.what == "gen":
        for n in plan_rows:
            print(write_dataset(DATA / f"plan-{n}.parquet", n, PLAN_VOCAB))
        return
    if args.what in ("plan", "all"):
        jobs += [("plan", n) for n in plan_rows]
    if args.what in ("run", "all"):
        jobs += [("run", n) for n in run_rows]
    print(
        "| command | rows | wall s | peak RSS GiB | bytes/row | saving ratio "
        "| stage: wall / peak RSS |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for what, n in jobs:
        if what == "plan":
            r = bench_plan(n, args.plan_memory)
        elif args.kill_at:
            fracs = [float(f) for f in args.kill_at.split(",")]
            r = bench_run_killed(n, args.max_tokens, args.plan_memory, fracs, args.sample_first)
        else:
            r = bench_run(n, args.max_tokens, args.plan_memory)
        r["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        r["loadavg"] = os.getloadavg()
        r["label"] = args.label
        results.append(r)
        with open(DATA / "results.jsonl", "a") as f:
            f.write(json.dumps({k: v for k, v in r.items() if k != "json"}) + "\n")
        print(_row(r), flush=True)


if __name__ == "__main__":
    main()
