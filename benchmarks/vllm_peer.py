"""vLLM CPU peer: run a token-id Parquet workload through vLLM's offline ``LLM.generate``.

Runs INSIDE ``.venv-vllm`` (see benchmarks/setup_vllm_venv.sh), never in the project venv:

    .venv-vllm/bin/python benchmarks/vllm_peer.py --model DIR --input W.parquet \\
        --output-json out.json [--sort-prompts] [--kv-gib 1] [--block-size 32] [--threads 2]

Input: a ``prompt`` column (list<int>, token ids), a ``max_tokens`` column, and optionally a
``row_id`` column (else the file row index). Every row decodes exactly ``max_tokens`` tokens
greedily (ignore_eos, min_tokens = max_tokens; ``--no-min-tokens``: ignore_eos alone, so
EOS can be sampled, as batchjob's ignore_eos does) with prefix caching on, so the only freedom
left to vLLM is scheduling. The JSON holds start-up and generate times apart (start-up
includes torch inductor compilation), throughput, the prefix-cache saving ratio
(sum num_cached_tokens / sum prompt tokens), peak RSS, and the generated ids per row in
file order, for token-by-token comparison with batchjob.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30


@dataclass(frozen=True)
class Workload:
    """Rows in file order; ``order`` is the submission order (indices into the rows)."""

    row_ids: list[int]
    prompts: list[list[int]]
    max_tokens: list[int]
    order: list[int]


def load_workload(path: str, sort_prompts: bool) -> Workload:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for col in ("prompt", "max_tokens"):
        if col not in table.column_names:
            raise SystemExit(f"{path}: missing column {col!r} (have {table.column_names})")
    prompts = [list(map(int, p)) for p in table.column("prompt").to_pylist()]
    max_tokens = [int(m) for m in table.column("max_tokens").to_pylist()]
    if "row_id" in table.column_names:
        row_ids = [int(r) for r in table.column("row_id").to_pylist()]
    else:
        row_ids = list(range(len(prompts)))
    if not prompts:
        raise SystemExit(f"{path}: no rows")
    if any(not p for p in prompts) or any(m < 1 for m in max_tokens):
        raise SystemExit(f"{path}: empty prompt or max_tokens < 1")
    order = list(range(len(prompts)))
    if sort_prompts:  # lexicographic on token ids: neighbours share the longest prefixes
        order.sort(key=lambda i: prompts[i])
    return Workload(row_ids, prompts, max_tokens, order)


class TreeSampler:
    """Background thread: peak memory of this process and all its descendants, summed.

    vLLM runs the engine core and the CPU worker in spawned processes, so ``getrusage`` of
    one process undercounts what the peer holds at once. Summed RSS counts pages shared by
    the processes (torch libraries, shared-memory queues) once per process; summed PSS
    splits them, so it is the fair figure for "memory held by the peer".
    """

    def __init__(self, interval_s: float = 0.1, pss_every: int = 10) -> None:
        import psutil  # a vLLM dependency

        self._proc = psutil.Process()
        self._interval = interval_s
        self._pss_every = pss_every  # PSS reads walk page tables (~4 ms/GiB): sample it less
        self._stop = threading.Event()
        self.peak_rss = 0
        self.peak_pss = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self) -> list[Any]:
        return [self._proc, *self._proc.children(recursive=True)]

    def _sample(self, with_pss: bool) -> None:
        import psutil

        rss = pss = 0
        for p in self._tree():
            with contextlib.suppress(psutil.Error):  # exited between listing and reading
                if with_pss:
                    m = p.memory_full_info()  # reads /proc/PID/smaps_rollup
                    rss, pss = rss + m.rss, pss + m.pss
                else:
                    rss += p.memory_info().rss
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds used so far by this process and its descendants."""
        import psutil

        total = 0.0
        for p in self._tree():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            self._sample(with_pss=n % self._pss_every == 0)
            n += 1
            self._stop.wait(self._interval)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF checkpoint folder")
    p.add_argument("--input", required=True, help="Parquet: prompt list<int>, max_tokens")
    p.add_argument("--output-json", required=True)
    p.add_argument("--sort-prompts", action="store_true", help="submit in lexicographic order")
    p.add_argument(
        "--kv-gib",
        type=float,
        default=1.0,
        help="KV cache size; a whole number goes through VLLM_CPU_KVCACHE_SPACE, "
        "a fraction through kv_cache_memory_bytes",
    )
    p.add_argument("--block-size", type=int, default=32, help="KV block (multiple of 32 on CPU)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="sets OMP_NUM_THREADS (unset: vLLM drops the EngineCore to 1 torch thread); "
        "the worker's OpenMP threads follow --omp-bind instead",
    )
    p.add_argument(
        "--omp-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND: 'auto' (vLLM default: on 2 cores the worker gets "
        "core 0 only, core 1 is reserved), a core list like '0-1', or 'nobind'",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    p.add_argument(
        "--no-multiprocessing",
        action="store_true",
        help="VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core in this process",
    )
    p.add_argument("--warmup", action="store_true", help="one short request before timing")
    p.add_argument(
        "--no-min-tokens",
        action="store_true",
        help="ignore_eos only: EOS may be sampled but does not stop a row (batchjob's "
        "ignore_eos); default also masks EOS with min_tokens = max_tokens",
    )
    return p.parse_args(argv)


def configure_env(args: argparse.Namespace) -> None:
    """Environment that vLLM reads at import or engine start: set before importing vllm."""
    if args.kv_gib <= 0:
        raise SystemExit("--kv-gib must be > 0")
    if float(args.kv_gib).is_integer():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.kv_gib))
    else:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the bytes argument
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.omp_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    if args.no_multiprocessing:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "enable_prefix_caching": True,
        "enforce_eager": args.enforce_eager,
        "skip_tokenizer_init": True,  # token ids in, token ids out
        "seed": 0,
    }
    if not float(args.kv_gib).is_integer():
        kw["kv_cache_memory_bytes"] = int(args.kv_gib * GIB)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return kw


def kv_capacity_tokens(llm: Any, block_size: int) -> int | None:
    """Tokens the KV cache holds, as the engine reported it back to the front end."""
    blocks = getattr(llm.llm_engine.vllm_config.cache_config, "num_gpu_blocks", None)
    return None if blocks is None else int(blocks) * block_size


def run(args: argparse.Namespace) -> dict[str, Any]:
    configure_env(args)
    work = load_workload(args.input, args.sort_prompts)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with TreeSampler() as tree:
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(args))
        startup_s = time.perf_counter() - t0
        kv_tokens = kv_capacity_tokens(llm, args.block_size)

        warmup_s = None
        if args.warmup:
            t0 = time.perf_counter()
            warm = SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True, temperature=0.0)
            llm.generate([TokensPrompt(prompt_token_ids=[5] * 40)], warm, use_tqdm=False)
            llm.reset_prefix_cache()
            warmup_s = time.perf_counter() - t0

        prompts = [TokensPrompt(prompt_token_ids=work.prompts[i]) for i in work.order]
        params = [
            SamplingParams(
                max_tokens=work.max_tokens[i],
                min_tokens=0 if args.no_min_tokens else work.max_tokens[i],
                ignore_eos=True,
                temperature=0.0,
                detokenize=False,
            )
            for i in work.order
        ]
        load_before, cpu0 = os.getloadavg()[0], tree.cpu_seconds()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        generate_s = time.perf_counter() - t0
        load_after, generate_cpu_s = os.getloadavg()[0], tree.cpu_seconds() - cpu0
        llm.llm_engine.engine_core.shutdown()  # reap the engine processes: RUSAGE_CHILDREN
        del llm

    generated: list[list[int]] = [[] for _ in work.prompts]
    cached = [0] * len(work.prompts)
    for i, out in zip(work.order, outs, strict=True):
        generated[i] = list(out.outputs[0].token_ids)
        cached[i] = int(out.num_cached_tokens or 0)

    n = len(work.prompts)
    prompt_tokens = sum(len(p) for p in work.prompts)
    gen_tokens = sum(len(g) for g in generated)
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "peer": "vllm",
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "model": str(Path(args.model).resolve()),
        "input": str(Path(args.input).resolve()),
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("model", "input")},
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cpu_count": os.cpu_count(),
        },
        # 1-minute load average around generate: other work on the machine skews timings
        "loadavg_1m": [load_before, load_after],
        "num_requests": n,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen_tokens,
        "kv_capacity_tokens": kv_tokens,
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        "generate_s": generate_s,
        # CPU seconds the peer's processes used during generate (all threads, all processes):
        # far below generate_s x cores means it waited for the CPU (other load, spin-free idle)
        "generate_cpu_s": generate_cpu_s,
        "requests_per_s": n / generate_s,
        "prompt_tokens_per_s": prompt_tokens / generate_s,
        "generated_tokens_per_s": gen_tokens / generate_s,
        "total_tokens_per_s": (prompt_tokens + gen_tokens) / generate_s,
        "cached_prompt_tokens": sum(cached),
        "saving_ratio": sum(cached) / prompt_tokens,
        # ru_maxrss is KiB on Linux; children = the largest single reaped descendant
        "peak_rss_self_mib": self_kib / 1024,
        "peak_rss_children_mib": child_kib / 1024,
        # sampled over the whole run (RSS every 0.1 s, PSS every 1 s), summed over the tree
        "peak_rss_tree_mib": tree.peak_rss / (1 << 20),
        "peak_pss_tree_mib": tree.peak_pss / (1 << 20),
        "rows": [
            {"row_id": work.row_ids[i], "num_cached_tokens": cached[i], "output_ids": generated[i]}
            for i in range(n)
        ],
    }


def summary(result: dict[str, Any]) -> str:
    keys = (
        "num_requests",
        "prompt_tokens",
        "generated_tokens",
        "kv_capacity_tokens",
        "startup_s",
        "generate_s",
        "generate_cpu_s",
        "requests_per_s",
        "total_tokens_per_s",
        "saving_ratio",
        "peak_pss_tree_mib",
    )
    return json.dumps({k: result[k] for k in keys})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    print(summary(result), file=sys.stderr)


# vLLM spawns its engine processes, which re-import this module: keep LLM(...) behind the guard
if __name__ == "__main__":
    main()
