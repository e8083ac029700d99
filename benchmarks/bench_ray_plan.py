"""`batchjob plan` over ``scheduler.plan_memory``: one process against a Ray cluster's workers.

The same token-id datasets as ``bench_scale.py`` (groups of 8-16 rows sharing a 16-64-token
prefix, 256k-row row groups). Each repeat runs, interleaved, the single-process partitioned
plan and the same job with ``cluster.address = "local"`` and ``cluster.workers = W`` (the
workers read, spill and plan their partitions; the driver merges the plan file). Reported:
the plan stage's wall time (single process: every partition; cluster: the workers' planning
and the driver's merge), each worker's planning seconds (its partitions, splits included,
from the driver's log line), the read + tokenize + spill stage, and the driver's peak RSS
(VmHWM of the `batchjob` process; Ray's own processes are not in it).

    .venv/bin/python benchmarks/bench_ray_plan.py --rows 1000000,2000000 --workers 4 \\
        --plan-memory 256MiB --repeats 3

A local cluster's workers share this machine's cores: with fewer cores than workers the
per-worker seconds are what each worker spent, not a speed-up. Results: one JSON line per
run appended to data/scale/ray_plan.jsonl and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scale import DATA, OUT, PLAN_VOCAB, _cli, _env, measure, write_dataset

_PER_WORKER = re.compile(r"cluster: planning per worker: (.*)$")
_ONE = re.compile(r"(w\d+\S*) ([\d.]+) s")


def per_worker(log: Path) -> dict[str, float]:
    for line in log.read_text().splitlines():
        if m := _PER_WORKER.search(line):
            return {w: float(s) for w, s in _ONE.findall(m.group(1))}
    return {}


def one(rows: int, workers: int, plan_memory: str, rep: int) -> dict:
    data = write_dataset(DATA / f"plan-{rows}.parquet", rows, PLAN_VOCAB)
    out = OUT / f"rayplan-{rows}-{workers}"
    cmd = [*_cli(), "-v", "plan", "--input", str(data), "--output", str(out), "--json"]
    cmd += ["--set", "input.batch_rows=65536", "--set", f"scheduler.plan_memory={plan_memory}"]
    if workers:
        cmd += ["--set", "cluster.address=local", "--set", f"cluster.workers={workers}"]
        cmd += ["--set", f"cluster.num_cpus={min(1.0, 2 / workers)}"]
    log = OUT / f"rayplan-{rows}-{workers}-{rep}.log"
    OUT.mkdir(parents=True, exist_ok=True)
    r = measure(cmd, _env(), log)
    stages = {s["name"]: s["seconds"] for s in r["json"].get("stages", [])}
    return {
        "rows": rows,
        "workers": workers,
        "plan_memory": plan_memory,
        "repeat": rep,
        "wall_s": r["wall_s"],
        "peak_rss_kb": r["peak_rss_kb"],
        "stage_peak_kb": r.get("stage_peak_kb", {}),
        "stage_s": stages,
        "per_worker_plan_s": per_worker(log) if workers else {},
        "partitions": r["json"].get("partitions", {}).get("count"),
        "saving_ratio_single_level": r["json"].get("saving_ratio_single_level"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1000000")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--plan-memory", default="256MiB")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    results = []
    for rows in map(int, a.rows.split(",")):
        for rep in range(a.repeats):
            for w in (0, a.workers):  # interleaved: single process, then the cluster
                r = one(rows, w, a.plan_memory, rep)
                results.append(r)
                with open(DATA / "ray_plan.jsonl", "a") as f:
                    f.write(json.dumps(r) + "\n")
                print(json.dumps(r), file=sys.stderr, flush=True)
    print(
        "| rows | workers | partitions | read+tokenize+spill s | plan s | per-worker plan s "
        "(min-max) | driver peak RSS | saving |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rows in sorted({r["rows"] for r in results}):
        for w in (0, a.workers):
            rs = [r for r in results if r["rows"] == rows and r["workers"] == w]
            med = statistics.median

            def st(name: str, rs=rs) -> float:
                return statistics.median([r["stage_s"].get(name, 0.0) for r in rs])

            if w:
                mins = med([min(r["per_worker_plan_s"].values(), default=0) for r in rs])
                maxs = med([max(r["per_worker_plan_s"].values(), default=0) for r in rs])
                pw = f"{mins:.1f}-{maxs:.1f}"
            else:
                pw = f"{st('plan'):.1f} (one process)"
            rss = med([r["peak_rss_kb"] for r in rs]) / 2**20
            print(
                f"| {rows:,} | {w or 1}{'' if w else ' (no Ray)'} | {rs[0]['partitions']} | "
                f"{st('read') + st('tokenize'):.1f} | {st('plan'):.1f} | {pw} | {rss:.2f} GiB | "
                f"{100 * rs[0]['saving_ratio_single_level']:.2f}% |"
            )


if __name__ == "__main__":
    main()
