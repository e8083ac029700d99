"""batchllm with the decode-growth reserve off (admission by blocks in use) and on, same process,
same model and KV budget: preemptions and engine seconds on a decode-heavy, memory-bound run.

    python benchmarks/bench_decode_reserve.py   # micro-1000-1000-s16, 128 outputs, 16 MiB KV
"""

from __future__ import annotations

import click
import torch
from bench_engine import ROOT, measure, workload_prompts  # the script's folder is on sys.path

from batchjob.backends.native.engine import Engine
from batchjob.backends.native.models.loader import load_model
from batchjob.config import EngineConfig, SchedulerConfig


@click.command()
@click.option("--workload", default="micro-1000-1000-s16", show_default=True)
@click.option("--kv-mib", default=16, show_default=True)
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--chunk-size", default=512, show_default=True)
def main(workload: str, kv_mib: int, max_tokens: int, chunk_size: int) -> None:
    torch.manual_seed(0)
    model_dir = ROOT / "models" / "bench-llama"  # built by bench_engine.py on its first run
    model, info = load_model(model_dir, dtype="float32", device="auto", attention="auto")
    prompts = workload_prompts(workload, info.vocab_size, max_tokens)
    for reserve in (False, True):
        cfg = SchedulerConfig(policy="batchllm", chunk_size=chunk_size, decode_reserve=reserve)
        engine = Engine(model, info, cfg, EngineConfig(kv_cache_bytes=kv_mib << 20, block_size=16))
        m = measure(engine, prompts, workload, "batchllm")
        print(
            f"decode_reserve={reserve}: preemptions {m.preemptions}, engine {m.wall_s:.1f} s, "
            f"{m.tokens_per_s:.0f} tok/s, {m.iterations} iterations",
            flush=True,
        )


if __name__ == "__main__":
    main()
