"""float32 vs bfloat16 engine throughput on the peer benchmark's models.

    .venv/bin/python benchmarks/bench_dtype.py                          # d 32/64/128, 2 workloads
    .venv/bin/python benchmarks/bench_dtype.py --head-dims 128 --workloads natural-qa --repeats 3

Decides ``model.dtype = "auto"`` on a CPU with bf16 hardware (AMX / AVX-512 BF16): `batchjob
run` (native engine, batchllm) on the same data and model folder with ``model.dtype`` set to
float32 and to bfloat16, the two interleaved per repeat; tokens/s = (prompt + generated) /
(engine + plan seconds) from the run summary, plus the run's CPU seconds (steadier than wall
time on a shared machine). ``match`` = rows whose output ids equal float32's (bf16 rounding
changes greedy output on random weights; the HF parity tests stay in float32).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent

from lib.peers import job_toml, outputs_by_row  # noqa: E402
from lib.timing import run_child  # noqa: E402
from lib.workloads import WORKLOADS, build_model, model_dir, write_workload  # noqa: E402

from batchjob.model.host_cpu import cpu_summary  # noqa: E402

PY = sys.executable


@click.command()
@click.option("--workloads", default="natural-qa,case1", show_default=True)
@click.option("--head-dims", default="32,64,128", show_default=True)
@click.option("--scale", type=float, default=0.5, show_default=True, help="x each one's scale.")
@click.option("--repeats", default=2, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "out" / "bench_dtype")
def main(workloads, head_dims, scale, repeats, threads, out) -> None:
    out = out.resolve()
    print(f"# {cpu_summary()}; engine.threads {threads}")
    print(
        "| head dim | workload (requests) | fp32 tok/s | bf16 tok/s | **bf16 / fp32** "
        "| fp32 CPU s | bf16 CPU s | bf16 match |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for hd in map(int, head_dims.split(",")):
        model = build_model(model_dir(hd), smoke=False, head_dim=hd)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        for name in workloads.split(","):
            sc, ls, mt = WORKLOADS[name]
            data = out / "data" / f"{name}-{sc * scale}.parquet"
            t = write_workload(name, sc * scale, ls, mt, vocab, data)
            res: dict[str, list[tuple[float, float]]] = {"float32": [], "bfloat16": []}
            ids: dict[str, dict[int, list[int]]] = {}
            for rep in range(repeats):
                for dtype in ("float32", "bfloat16"):
                    d = out / "runs" / f"d{hd}-{name}-{dtype}-{rep}"
                    d.mkdir(parents=True, exist_ok=True)
                    toml = job_toml(
                        data, model, d / "r.parquet", "batchllm", mt, 1 << 30, 2048, dtype, threads
                    )
                    (d / "job.toml").write_text(toml)
                    cmd = [PY, "-m", "batchjob.cli", "run", str(d / "job.toml"), "--json"]
                    _, _, cpu = run_child([*cmd, "--no-progress"], d / "log.txt")
                    s = json.loads((d / "log.txt").read_text())
                    tokens = s["prompt_tokens"] + s["generated_tokens"]
                    res[dtype].append((tokens / (s["engine_s"] + s["stage_s"]["plan_s"]), cpu))
                    ids[dtype] = outputs_by_row(d / "r.parquet")
            f32, b16 = (statistics.median(x for x, _ in res[k]) for k in ("float32", "bfloat16"))
            c32, c16 = (statistics.median(c for _, c in res[k]) for k in ("float32", "bfloat16"))
            match = sum(ids["bfloat16"][r] == v for r, v in ids["float32"].items()) / t.num_rows
            print(
                f"| {hd} | {name} ({t.num_rows}) | {f32:.0f} | {b16:.0f} | **{b16 / f32:.2f}x** "
                f"| {c32:.1f} | {c16:.1f} | {match:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
