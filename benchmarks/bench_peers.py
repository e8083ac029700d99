"""batchjob against its real peers: one comparison table (markdown + Parquet) and a plot.

    .venv/bin/python benchmarks/bench_peers.py --workloads case1 --repeats 1 --with-vllm
    .venv/bin/python benchmarks/bench_peers.py --smoke            # tiny, < 1 min, no vLLM
    .venv/bin/python benchmarks/bench_peers.py --head-dims 32,64,128 --workloads natural-qa

Head dims: one benchmark model per ``--head-dims`` entry (models/bench-peer[-d<D>]: Llama,
hidden 256, 8 layers, 8 heads x D, random weights, built locally on first use); every system
runs on each. Every run and table row records the head dim and the machine's CPU (model name
and the ISA flags that pick kernel paths: avx2, fma, avx512f, avx512_bf16, amx_bf16).

Systems, all on the same model folder, token ids, fixed output lengths, dtype (``--dtype``,
float32 by default) and KV budget:
``batchjob`` (native engine, batchllm policy, `batchjob run` in a subprocess), ``baseline``
(the same engine with the FCFS baseline policy: the ablation), ``vllm-file`` and
``vllm-sorted`` (benchmarks/peers/vllm_peer.py in .venv-vllm, rows in file order /
lexicographic order; "vLLM best" is the faster of the two), ``batchjob-vllm`` and
``batchjob-vllm-order`` (batchjob's vLLM backend, benchmarks/peers/batchjob_vllm_peer.py: plan
order with batchjob's scheduler class / with vLLM's own scheduler; one engine per system for
all its runs) and optionally ``hf`` (benchmarks/peers/hf_peer.py).
Default order: the batchjob/baseline/hf runs first; then all vLLM runs (every workload, both
orders, every repeat) through ONE ``vllm_peer.py --plan`` process (one 60-100 s engine
start-up instead of one per run, the prefix cache reset between runs); then each
batchjob-vllm system's runs through one ``batchjob_vllm_peer.py --plan`` process. A vLLM run's
``end_to_end_s`` is that process's ready time (spawn, imports, start-up) + its own
generate_s: what it would cost alone.
``--interleave``: every run is a fresh process with its own engine (vLLM-family systems: a
one-run plan), in the order ``lib.matrix.interleaved_schedule`` gives: per workload, per
repeat, one run of each chosen system, the systems' order rotated by one each repeat (two
systems, three repeats: A1 B1 B2 A2 A3 B3), so a drift of the machine's speed lasting minutes
reaches both sides of a ratio, and neither system always runs first. Nothing runs beside a
timed run (no idle engine of another system); each pays its own start-up, which stays outside
run_s for every system as in the default order (run_s: vLLM ``generate``, batchjob-vllm plan +
``VllmBackend.run``, both after their engine's start-up and one warm-up request), and inside
end_to_end_s. Match fractions are filled in once the repeat's batchjob run is done. Before the
timed runs of each model, one untimed run of each system on the first workload (``--warmup``,
the default): vLLM's first run on a fresh machine fills its compile cache and batchjob's its
calibration cache, which every later fresh process reuses.
EOS: every system decodes exactly max_tokens tokens and EOS may be sampled (batchjob
``ignore_eos``; vllm_peer ``--no-min-tokens``), so outputs compare token by token;
``--stop-ids N``: every system stops a row at EOS or any of N ids instead (still greedy).
Throughput excludes start-up everywhere: batchjob engine_s + plan_s, vLLM/HF generate_s.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pyarrow as pa
from lib import matrix, peers, reports, workloads
from lib.timing import profile_split
from lib.workloads import ROOT, SMOKE_WORKLOAD, WORKLOADS

from batchjob.model.host_cpu import host_cpu
from batchjob.storage.atomic import write_parquet_atomic
from batchjob.testing.model_shapes import SHAPES, make_shaped_model


@dataclass(frozen=True)
class Options:
    """The command line, as click parses it (see the options' help)."""

    workloads: str
    systems: str
    with_vllm: bool
    with_hf: bool
    repeats: int
    scale: float | None
    len_scale: float | None
    max_tokens: int | None
    kv_gib: float
    chunk_size: int
    vllm_budget: bool
    backend_chunk_size: int | None
    max_model_len: int | None
    head_dims: str
    model_shapes: str
    kv_heads: int
    dtype: str
    interleave: bool
    warmup: bool
    stop_ids: int
    smoke: bool
    out: Path
    resume: bool
    profile_stats: Path | None


@click.command()
@click.option(
    "--workloads",
    default="case1,micro-2000-200-s16",
    show_default=True,
    help=f"Comma list of: {', '.join(WORKLOADS)}",
)
@click.option("--systems", default="batchjob,baseline,vllm-file,vllm-sorted", show_default=True)
@click.option("--with-vllm/--no-vllm", default=True, help="Drop the vLLM systems.")
@click.option("--with-hf", is_flag=True, help="Add HF generate (small workloads only).")
@click.option("--repeats", default=3, show_default=True)
@click.option("--scale", type=float, default=None, help="Override every workload's scale.")
@click.option("--len-scale", type=float, default=None, help="Override every len_scale.")
@click.option("--max-tokens", type=int, default=None, help="Override every max_tokens.")
@click.option("--kv-gib", type=float, default=1.0, show_default=True)
@click.option("--chunk-size", default=2048, show_default=True)
@click.option(
    "--max-model-len",
    type=int,
    default=None,
    help="vLLM systems' max_model_len (default: the model's 4096; a KV budget under 4096 "
    "tokens needs less).",
)
@click.option(
    "--vllm-budget/--vllm-default-budget",
    default=False,
    help="Give the vLLM systems (the vLLM peer and batchjob's vllm backend) --chunk-size as "
    "their step budget (default: vLLM's own, 4096 on CPU, which the backend also takes when "
    "scheduler.chunk_size is unset).",
)
@click.option(
    "--backend-chunk-size",
    type=int,
    default=None,
    help="scheduler.chunk_size of batchjob's vllm backend systems (default: the vLLM systems' "
    "budget: --chunk-size with --vllm-budget, else the backend's own, vLLM's default).",
)
@click.option(
    "--head-dims",
    default="128",
    show_default=True,
    help="Comma list: one benchmark model per head dim (the same shape otherwise: hidden 256, "
    "8 layers, 8 heads), built locally with random weights; e.g. 32,64,128.",
)
@click.option(
    "--model-shapes",
    default="",
    help="Comma list of real checkpoints' shapes (batchjob.testing.model_shapes: "
    f"{', '.join(SHAPES)}), each built in models/<name> with random weights; replaces "
    "--head-dims/--kv-heads.",
)
@click.option(
    "--kv-heads",
    type=click.IntRange(1, 8),
    default=8,
    show_default=True,
    help="The benchmark models' KV heads (8 query heads; 2 = groups of 4, as Llama 3's 32/8); "
    "the KV budget in GiB stays, so fewer KV heads hold more tokens.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="model.dtype of every system (batchjob, its vLLM backend, vLLM's --dtype).",
)
@click.option(
    "--interleave",
    is_flag=True,
    help="Alternate the systems' runs: per workload and repeat one run of each system, the "
    "order rotated each repeat (A1 B1 B2 A2 A3 B3), every run a fresh process with its own "
    "engine (start-up outside run_s, as always). Default: all batchjob runs, then all vLLM "
    "runs of a head dim in one process, then each batchjob-vllm system's in one process.",
)
@click.option(
    "--warmup/--no-warmup",
    default=True,
    show_default=True,
    help="With --interleave: one untimed run of each system on the first workload, per model, "
    "before the timed runs (compile caches, calibration).",
)
@click.option(
    "--stop-ids",
    default=0,
    show_default=True,
    help="Rows stop at any of N token ids (100 .. 100 + N - 1), greedy, so their output "
    "lengths vary as answers do; 0: every row decodes max_tokens (ignore_eos).",
)
@click.option("--smoke", is_flag=True, help="Tiny model and workload; vLLM only with --with-vllm.")
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "out" / "bench_peers")
@click.option(
    "--resume",
    is_flag=True,
    help="Keep the runs already in OUT/peers_runs.parquet (same workload/system/repeat).",
)
@click.option(
    "--profile-stats",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Only print the time split of a cProfile dump of `batchjob run` (see the docs).",
)
def main(**options) -> None:
    o = Options(**options)
    peers.STOP_IDS[:] = peers.stop_id_list(o.stop_ids)
    if o.profile_stats is not None:
        split = profile_split(o.profile_stats)
        total = sum(split.values())
        for k, v in split.items():
            print(f"{k:40s} {v:8.2f} s  {v / total:6.1%}")
        return
    settings, dims = _settings(o)
    cpu = host_cpu()
    print(f"CPU: {cpu.summary()}; head dims {dims}", flush=True)
    runs = matrix.Runs(
        settings.out / "peers_runs.parquet", o.resume, cpu.model, " ".join(cpu.key_flags)
    )
    for variant in _variants(o, settings.out, dims):
        matrix.run_variant(settings, variant, runs)
    rows = reports.summary_rows(runs.items, settings.scales)
    table = reports.markdown(rows)
    out = settings.out
    (out / "peers.md").write_text(table + "\n")
    write_parquet_atomic(
        pa.table({k: [r[k] for r in rows] for k in rows[0]}), out / "peers.parquet"
    )
    reports.plot(rows, out / "peers.png")
    print("\n" + table + f"\n\nwrote {out}/peers.md, peers.parquet, peers_runs.parquet, peers.png")


def _settings(o: Options) -> tuple[matrix.Settings, list[int]]:
    """The shared settings of every run, and the head dims of the benchmark models."""
    out = o.out.resolve()  # job files and peers get absolute paths
    out.mkdir(parents=True, exist_ok=True)
    chosen = [s for s in o.systems.split(",") if s]
    dims = [int(d) for d in o.head_dims.split(",") if d]
    kv_gib = o.kv_gib
    if o.smoke:
        name, sc, ls, mt = SMOKE_WORKLOAD
        scales = {name: (sc, ls, mt)}
        kv_gib = 1 / 64  # 16 MiB: 16k tokens of the 1 KiB/token tiny model (vLLM: >= max len)
        chosen = [s for s in chosen if "vllm" not in s or "--with-vllm" in sys.argv]
        if "--head-dims" not in sys.argv:
            dims = [32]  # the tiny model's own (hidden 64, 2 heads)
    else:
        scales = {n: WORKLOADS[n] for n in o.workloads.split(",")}
        if o.scale or o.len_scale or o.max_tokens:
            scales = {
                n: (o.scale or a, o.len_scale or b, o.max_tokens or c)
                for n, (a, b, c) in scales.items()
            }
    if not o.with_vllm or not peers.VLLM_PY.exists():
        chosen = [s for s in chosen if not s.startswith("vllm")]
    if not o.with_vllm or not peers.HAVE_VLLM:
        chosen = [s for s in chosen if s not in peers.BACKEND_POLICY]
    if o.with_hf and "hf" not in chosen:
        chosen.append("hf")
    settings = matrix.Settings(
        out=out,
        systems=chosen,
        scales=scales,
        repeats=o.repeats,
        kv_gib=kv_gib,
        chunk_size=o.chunk_size,
        vllm_chunk=o.chunk_size if o.vllm_budget else None,
        backend_chunk=o.backend_chunk_size or (o.chunk_size if o.vllm_budget else None),
        max_model_len=o.max_model_len,
        dtype=o.dtype,
        interleave=o.interleave,
        warmup=o.warmup and not o.smoke,
    )
    return settings, dims


def _variants(o: Options, out: Path, dims: list[int]) -> list[matrix.Variant]:
    """The benchmark models every system runs on: --model-shapes, else one per head dim."""
    shaped = [
        matrix.Variant(
            n, SHAPES[n].head_dim, SHAPES[n].kv_heads, make_shaped_model(ROOT / "models" / n, n)
        )
        for n in o.model_shapes.split(",")
        if n
    ]
    return shaped or [
        matrix.Variant(
            "bench-peer",
            hd,
            o.kv_heads,
            workloads.build_model(
                out / f"smoke-model-d{hd}" if o.smoke else workloads.model_dir(hd, o.kv_heads),
                smoke=o.smoke,
                head_dim=hd,
                kv_heads=o.kv_heads,
            ),
        )
        for hd in dims
    ]


if __name__ == "__main__":
    main()
