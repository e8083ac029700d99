"""The cluster driver's planning cost at scale: global plan + shard balancing, in memory.

A share-heavy synthetic token-id workload (groups of 8-16 rows share an 8-24-token prefix,
each row adds a 2-8-token suffix, max_tokens 8-64, rows shuffled) is generated with numpy
straight into ``TokenizedPrompts`` (no Parquet, no Python object per row). Timed: the
planner (``build_plan``, per stage), the cost model (``group_costs``), the LPT balancer
(``balance``) for several shard counts with the cost spread ((max - min) / mean shard cost),
and cutting the plan into every worker's prompts + plan (``split``, one pass).

    .venv/bin/python benchmarks/bench_shard.py --rows 10000000 --shards 2,8,64,512

Prints a Markdown table and one JSON line. Every step is reported as wall time and as this
process's CPU time (user + system): on a shared machine the CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np

from batchjob.plan.build import build_plan
from batchjob.plan.shard import balance, group_costs, split
from batchjob.tokenize.prompts import TokenizedPrompts

VOCAB = 32_000
CHUNK = 1 << 20  # rows whose tokens are built at once


def share_heavy(rows: int, seed: int = 0) -> TokenizedPrompts:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(8, 17, size=rows // 8 + 1)
    cut = int(np.searchsorted(np.cumsum(sizes), rows)) + 1
    sizes = sizes[:cut]
    sizes[-1] -= int(sizes.sum()) - rows
    groups = len(sizes)
    prefix_len = rng.integers(8, 25, size=groups)
    prefix_off = np.concatenate([[0], np.cumsum(prefix_len)])
    prefix_tok = rng.integers(16, VOCAB, size=int(prefix_off[-1]), dtype=np.int32)

    group_of = np.repeat(np.arange(groups), sizes)[rng.permutation(rows)]  # shuffled rows
    p_row = prefix_len[group_of]
    lengths = p_row + rng.integers(2, 9, size=rows)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=np.int32)
    for r0 in range(0, rows, CHUNK):
        r1 = min(rows, r0 + CHUNK)
        lens = lengths[r0:r1]
        t0, t1 = int(offsets[r0]), int(offsets[r1])
        row = np.repeat(np.arange(r0, r1), lens)
        j = np.arange(t1 - t0) - (np.repeat(offsets[r0:r1], lens) - t0)  # index in its row
        in_prefix = j < p_row[row]
        chunk = rng.integers(16, VOCAB, size=t1 - t0, dtype=np.int32)  # suffixes: random
        chunk[in_prefix] = prefix_tok[prefix_off[group_of[row[in_prefix]]] + j[in_prefix]]
        tokens[t0:t1] = chunk
    return TokenizedPrompts(
        row_ids=np.arange(rows, dtype=np.int64),
        tokens=tokens,
        offsets=offsets,
        max_tokens=rng.integers(8, 65, size=rows).astype(np.int32),
    )


class Clock:
    """Wall and process CPU seconds since the last ``lap``."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def _fmt(wc: tuple[float, float]) -> str:
    return f"{wc[0]:.2f} s ({wc[1]:.2f} s CPU)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--shards", default="2,8,64,512")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shard_counts = [int(s) for s in args.shards.split(",")]

    clock = Clock()
    prompts = share_heavy(args.rows, args.seed)
    gen_s = clock.lap()

    stages: dict[str, tuple[float, float]] = {}
    stage_clock = Clock()
    plan = build_plan(prompts, on_stage=lambda name: stages.__setitem__(name, stage_clock.lap()))
    plan_s = clock.lap()
    costs = group_costs(plan, prompts.lengths)
    cost_s = clock.lap()

    shards = []
    for n in shard_counts:
        clock.lap()
        sh = balance(costs, n)
        bal_s = clock.lap()
        for _ in split(prompts, plan, sh):  # what the driver sends its workers
            pass
        split_s = clock.lap()
        shards.append({"shards": n, "balance_s": bal_s, "split_s": split_s, "spread": sh.spread})

    out = {
        "rows": args.rows,
        "tokens": len(prompts.tokens),
        "groups": plan.num_groups,
        "saving_ratio": plan.stats.saving_ratio_single_level,
        "generate_s": gen_s,
        "plan_s": plan_s,
        "plan_stages_s": stages,
        "group_costs_s": cost_s,
        "shards": shards,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "seconds": "[wall, process CPU]",
    }
    print(
        f"{args.rows:,} rows, {out['tokens']:,} tokens, {plan.num_groups:,} groups, "
        f"saving {out['saving_ratio']:.3f}; generate {_fmt(gen_s)}; plan {_fmt(plan_s)} "
        f"[{', '.join(f'{k} {_fmt(v)}' for k, v in stages.items())}]; group costs "
        f"{_fmt(cost_s)}; peak RSS {out['peak_rss_gib']:.1f} GiB\n"
    )
    print("| shards | balance (LPT) | split into every worker's prompts + plan | cost spread |")
    print("|---:|---:|---:|---:|")
    for r in shards:
        bal, cut = _fmt(r["balance_s"]), _fmt(r["split_s"])
        print(f"| {r['shards']} | {bal} | {cut} | {r['spread']:.4%} |")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
