"""batchjob's vLLM backend on token-id Parquet workloads, several runs on ONE engine.

    .venv/bin/python benchmarks/peers/batchjob_vllm_peer.py --model DIR --policy batchllm \\
        --plan PLAN.json [--kv-bytes 1073741824] [--chunk-size N] [--max-model-len 4096]

PLAN.json: a list of runs ``{"input": W.parquet, "output_json": out.json}``. Each run is the
pipeline's path without Parquet output: load_prompts -> build_plan -> VllmBackend.run (plan
order; ``--policy batchllm``: batchjob's scheduler class, ``baseline``: vLLM's own), greedy,
ignore_eos, ``--dtype`` (float32 by default), block 32. The engine starts once (its prefix
cache is reset before each run); each JSON has the same fields as vllm_peer.py's that
bench_peers.py reads: ``generate_s`` (= plan + run, start-up excluded), ``saving_ratio``
(achieved, from the requests' num_cached_tokens), ``process_ready_s``, peak memory of the
process tree, rows; and the run's per-iteration records beside it (``<output_json
stem>.iterations.parquet``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

GIB = 1 << 30


def job_for(args: argparse.Namespace, data: str):
    from batchjob.config import load_job

    return load_job(
        None,
        {
            "input.path": data,
            "model.path": args.model,
            "model.dtype": args.dtype,
            "model.max_model_len": str(args.max_model_len),
            "output.path": str(Path(args.plan).parent / "unused.parquet"),
            "engine.backend": "vllm",
            "engine.block_size": "32",
            "engine.kv_cache_bytes": str(args.kv_bytes),
            "scheduler.policy": args.policy,
            "sampling.ignore_eos": "false" if args.stop_ids else "true",
            "sampling.temperature": "0",
        }
        | ({"sampling.stop_token_ids": f"[{args.stop_ids}]"} if args.stop_ids else {})
        | ({"scheduler.chunk_size": str(args.chunk_size)} if args.chunk_size else {})
        | (
            {"scheduler.kv_threshold": str(args.kv_threshold)}
            if getattr(args, "kv_threshold", None) is not None
            else {}
        ),
    )


def tree_memory_mib() -> float:
    """Summed PSS of this process and its children (the vLLM worker)."""
    import psutil

    total = 0
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_full_info().pss
    return total / (1 << 20)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--policy", choices=("batchllm", "baseline"), default="batchllm")
    p.add_argument("--kv-bytes", type=int, default=GIB)
    p.add_argument(
        "--chunk-size", type=int, default=None, help="scheduler.chunk_size (unset: the backend's)"
    )
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--stop-ids", default="", help="comma list: rows stop at these ids, not at max")
    args = p.parse_args(argv)

    from batchjob.backends.base import RunSink
    from batchjob.backends.vllm.backend import VllmBackend
    from batchjob.outputs.report import iterations_table
    from batchjob.plan.build import build_plan
    from batchjob.runner.execute import backend_config
    from batchjob.storage.atomic import write_parquet_atomic
    from batchjob.tokenize.batched import load_prompts
    from batchjob.tokenize.prompts import TokenizedPrompts

    runs = json.loads(Path(args.plan).read_text())
    import psutil

    t_start = psutil.Process().create_time()  # as vllm_peer.py: interpreter and imports count
    backend = None
    for k, r in enumerate(runs):
        job = job_for(args, r["input"])
        loaded, model = load_prompts(job.input, job.model, job.sampling, job.engine.backend)
        prompts = loaded.prompts
        if backend is None:
            t0 = time.perf_counter()
            backend = VllmBackend(backend_config(job), lambda ids: "", model)
            # started for this job's plan: the attention choice weighs its decode/prefill mix
            sched = job.scheduler
            backend.check_fits(
                prompts, build_plan(prompts, enlarge=sched.enlarge, order=sched.reorder)
            )
            startup_s = time.perf_counter() - t0
            # warm-up (vllm_peer.py --warmup does the same): first-call costs out of the timing
            warm = TokenizedPrompts.from_lists([[5] * 40, [6] * 40], max_tokens=4)
            backend.run(warm, build_plan(warm), RunSink(lambda o: None))
            ready_s = time.time() - t_start
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        plan = build_plan(prompts, enlarge=job.scheduler.enlarge, order=job.scheduler.reorder)
        plan_s = time.perf_counter() - t0
        out: dict[int, list[int]] = {}
        info = backend.run(
            prompts, plan, RunSink(lambda o, out=out: out.__setitem__(o.row_id, o.token_ids))
        )
        generate_s = plan_s + info.wall_s
        prompt_tokens = int(prompts.lengths.sum())
        first_time = info.computed_prefill_tokens - info.recomputed_tokens
        result = {
            "peer": f"batchjob-vllm-{args.policy}",
            "num_requests": len(prompts),
            "prompt_tokens": prompt_tokens,
            "generated_tokens": int(sum(len(v) for v in out.values())),
            "startup_s": startup_s,
            "process_ready_s": ready_s,
            "plan_s": plan_s,
            "run_s": info.wall_s,
            "generate_s": generate_s,
            "saving_ratio": 1 - first_time / prompt_tokens,
            "saving_ratio_planned": plan.stats.saving_ratio_single_level,
            "preemptions": info.preemptions,
            "iterations": len(info.iterations),
            "mean_tokens_per_iteration": (
                sum(i.decode_tokens + i.prefill_tokens for i in info.iterations)
                / max(len(info.iterations), 1)
            ),
            "peak_kv_bytes": info.peak_kv_bytes,
            "loadavg_1m": [load_before, os.getloadavg()[0]],
            "peak_pss_tree_mib": tree_memory_mib(),
            "rows": [{"row_id": rid, "output_ids": ids.tolist()} for rid, ids in out.items()],
        }
        dest = Path(r["output_json"])
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_parquet_atomic(
            iterations_table(info.iterations), dest.with_suffix(".iterations.parquet")
        )
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(dest)
        keys = ("num_requests", "generate_s", "saving_ratio", "saving_ratio_planned")
        print(
            f"[{k + 1}/{len(runs)}] {dest} " + json.dumps({x: result[x] for x in keys}),
            file=sys.stderr,
            flush=True,
        )
    if backend is not None:
        backend.close()


# the vLLM worker is spawned and re-imports the main module: keep the work behind the guard
if __name__ == "__main__":
    main()
