"""batchllm with the decode-growth reserve off (admission by blocks in use) and on, same process,
same model and KV budget: preemptions and engine seconds on a decode-heavy, memory-bound run.
The two settings alternate (off, on, off, on, ...) so a drift of the machine's speed hits both.

    python benchmarks/bench_decode_reserve.py   # micro-1000-1000-s16, 128 outputs, 16 MiB KV
    # the issue's shape: natural-QA rows, ~1000 sequences decoding, a 1 GiB cache that fills
    python benchmarks/bench_decode_reserve.py --workload natural-qa --scale 1.5 --len-scale 1 \\
        --max-tokens 32 --kv-mib 1024 --head-dim 32 --chunk-size 2048 --repeats 2
"""

from __future__ import annotations

import statistics

import click
import torch
from bench_engine import ROOT, VOCAB, measure, prompts_from_table, workload_prompts

from batchjob.backends.native.engine import Engine
from batchjob.backends.native.models.loader import load_model
from batchjob.config import EngineConfig, SchedulerConfig
from batchjob.model.host_cpu import cpu_summary
from batchjob.testing.workloads import make_workload


@click.command()
@click.option("--workload", default="micro-1000-1000-s16", show_default=True)
@click.option("--scale", type=float, default=None, help="Default: bench_engine's for it.")
@click.option("--len-scale", type=float, default=None)
@click.option("--kv-mib", default=16, show_default=True)
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--chunk-size", default=512, show_default=True)
@click.option(
    "--head-dim",
    type=int,
    default=None,
    help="Use bench_peers' model of this head dim (hidden 256, 8 layers, 8 heads); "
    "default: bench_engine's bench-llama.",
)
@click.option("--threads", default=2, show_default=True)
@click.option("--repeats", default=1, show_default=True, help="Runs of each setting.")
def main(
    workload: str,
    scale: float | None,
    len_scale: float | None,
    kv_mib: int,
    max_tokens: int,
    chunk_size: int,
    head_dim: int | None,
    threads: int,
    repeats: int,
) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    if head_dim is None:
        model_dir = ROOT / "models" / "bench-llama"  # built by bench_engine.py on its first run
    else:
        from bench_peers import build_model

        name = "bench-peer" if head_dim == 128 else f"bench-peer-d{head_dim}"
        model_dir = build_model(ROOT / "models" / name, smoke=False, head_dim=head_dim)
    model, info = load_model(model_dir, dtype="float32", device="auto", attention="auto")
    if scale is None and len_scale is None:
        prompts = workload_prompts(workload, info.vocab_size, max_tokens)
    else:
        table = make_workload(
            workload,
            scale=1.0 if scale is None else scale,
            len_scale=1.0 if len_scale is None else len_scale,
            seed=0,
            form="ids",
            vocab_size=min(info.vocab_size, VOCAB),
            max_tokens=max_tokens,
        )
        prompts = prompts_from_table(table)
    print(
        f"{cpu_summary()}; {model_dir.name}, {len(prompts)} requests, {max_tokens} outputs, "
        f"KV {kv_mib} MiB, {threads} threads",
        flush=True,
    )
    runs: dict[bool, list] = {False: [], True: []}
    ecfg = EngineConfig(kv_cache_bytes=kv_mib << 20, block_size=16)
    # warm-up, not counted: kernel build and first-use calibration happen here
    measure(
        Engine(model, info, SchedulerConfig(policy="batchllm"), ecfg), prompts, workload, "batchllm"
    )
    for _ in range(repeats):
        for reserve in (False, True):
            cfg = SchedulerConfig(policy="batchllm", chunk_size=chunk_size, decode_reserve=reserve)
            m = measure(Engine(model, info, cfg, ecfg), prompts, workload, "batchllm")
            runs[reserve].append(m)
            print(
                f"decode_reserve={reserve}: preemptions {m.preemptions}, engine {m.wall_s:.1f} s, "
                f"{m.tokens_per_s:.0f} tok/s, {m.iterations} iterations, "
                f"{m.mean_tokens_per_iter:.0f} tokens/iteration",
                flush=True,
            )
    off, on = (statistics.median(m.wall_s for m in runs[r]) for r in (False, True))
    print(f"median engine s: reserve off {off:.1f}, on {on:.1f}; on / off {on / off:.3f}")


if __name__ == "__main__":
    main()
