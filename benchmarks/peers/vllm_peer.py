"""vLLM CPU peer: run a token-id Parquet workload through vLLM's offline ``LLM.generate``.

Runs INSIDE ``.venv-vllm`` (see benchmarks/peers/setup_vllm_venv.sh), never in the project venv:

    .venv-vllm/bin/python benchmarks/peers/vllm_peer.py --model DIR --input W.parquet \\
        --output-json out.json [--sort-prompts] [--kv-gib 1] [--block-size 32] [--threads 2]
    .venv-vllm/bin/python benchmarks/peers/vllm_peer.py --model DIR --plan PLAN.json [engine flags]

``--plan``: PLAN.json is a list of runs ``{"input": W.parquet, "sort_prompts": bool,
"output_json": out.json}``, all on ONE engine (one start-up), the prefix cache reset before
each; each run's JSON is the single-run JSON (start-up fields copied into every one), except
that its peak memory covers that run only (``peak_window``: "run" vs "process"). A run may
name ``"wait_for": path``: it starts only once that file exists (a caller can release runs
one by one), and the process writes ``PLAN.json.ready`` once its engine is up, so a caller
can run nothing beside the start-up. (bench_peers.py --interleave gives each run a fresh
one-run plan process instead.)

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
        self.paused = threading.Event()  # set while waiting for a gated run: no sampling
        self._lock = threading.Lock()
        self.peak_rss = 0
        self.peak_pss = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self) -> list[Any]:
        return [self._proc, *self._proc.children(recursive=True)]

    def sample(self, with_pss: bool = True) -> None:
        import psutil

        rss = pss = 0
        for p in self._tree():
            with contextlib.suppress(psutil.Error):  # exited between listing and reading
                if with_pss:
                    m = p.memory_full_info()  # reads /proc/PID/smaps_rollup
                    rss, pss = rss + m.rss, pss + m.pss
                else:
                    rss += p.memory_info().rss
        with self._lock:
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def reset(self) -> None:
        """Start a new peak window (plan mode: one per run) from the current footprint."""
        with self._lock:
            self.peak_rss = self.peak_pss = 0
        self.sample()

    def process_age_s(self) -> float:
        """Seconds since this process was created: interpreter start and imports included."""
        return time.time() - self._proc.create_time()

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
            if not self.paused.is_set():
                self.sample(with_pss=n % self._pss_every == 0)
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
    p.add_argument("--input", help="Parquet: prompt list<int>, max_tokens")
    p.add_argument("--output-json")
    p.add_argument("--sort-prompts", action="store_true", help="submit in lexicographic order")
    p.add_argument(
        "--plan",
        help="JSON list of runs {input, sort_prompts, output_json} on one engine (one "
        "start-up); replaces --input/--output-json/--sort-prompts",
    )
    p.add_argument(
        "--kv-gib",
        type=float,
        default=1.0,
        help="KV cache size; a whole number goes through VLLM_CPU_KVCACHE_SPACE, "
        "a fraction through kv_cache_memory_bytes",
    )
    p.add_argument("--block-size", type=int, default=32, help="KV block (multiple of 32 on CPU)")
    p.add_argument(
        "--stop-ids", default="", help="comma list: rows stop at these ids (EOS too), not at max"
    )
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
    args = p.parse_args(argv)
    if args.plan is not None and (args.input or args.output_json or args.sort_prompts):
        p.error("--plan replaces --input, --output-json and --sort-prompts")
    if args.plan is None and not (args.input and args.output_json):
        p.error("--input and --output-json are required (or --plan)")
    return args


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


def start_engine(args: argparse.Namespace, tree: TreeSampler) -> tuple[Any, dict[str, Any]]:
    """Build the LLM (and warm it up): returns it and the start-up fields of every run's JSON."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    startup_s = time.perf_counter() - t0
    warmup_s = None
    if args.warmup:
        t0 = time.perf_counter()
        warm = SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True, temperature=0.0)
        llm.generate([TokensPrompt(prompt_token_ids=[5] * 40)], warm, use_tqdm=False)
        llm.reset_prefix_cache()
        warmup_s = time.perf_counter() - t0
    tree.sample()
    return llm, {
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "kv_capacity_tokens": kv_capacity_tokens(llm, args.block_size),
        "startup_s": startup_s,  # LLM(...) alone
        "warmup_s": warmup_s,
        # process creation to a ready engine: interpreter, imports, start-up, warm-up
        "process_ready_s": tree.process_age_s(),
        "startup_peak_pss_tree_mib": tree.peak_pss / (1 << 20),
    }


def generate_run(
    llm: Any, args: argparse.Namespace, work: Workload, tree: TreeSampler, info: dict[str, Any]
) -> dict[str, Any]:
    """One workload through ``llm.generate``: the JSON fields, less the memory ones."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=work.prompts[i]) for i in work.order]
    stop = [int(x) for x in args.stop_ids.split(",") if x]
    params = [
        SamplingParams(
            max_tokens=work.max_tokens[i],
            min_tokens=0 if args.no_min_tokens or stop else work.max_tokens[i],
            ignore_eos=not stop,
            stop_token_ids=stop or None,
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

    generated: list[list[int]] = [[] for _ in work.prompts]
    cached = [0] * len(work.prompts)
    for i, out in zip(work.order, outs, strict=True):
        generated[i] = list(out.outputs[0].token_ids)
        cached[i] = int(out.num_cached_tokens or 0)

    n = len(work.prompts)
    prompt_tokens = sum(len(p) for p in work.prompts)
    gen_tokens = sum(len(g) for g in generated)
    return {
        "peer": "vllm",
        "versions": info["versions"],
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
        **{k: v for k, v in info.items() if k != "versions"},
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
        "rows": [
            {"row_id": work.row_ids[i], "num_cached_tokens": cached[i], "output_ids": generated[i]}
            for i in range(n)
        ],
    }


def memory_fields(tree: TreeSampler, window: str) -> dict[str, Any]:
    """Peaks so far. ru_maxrss: process lifetime, KiB on Linux; children = the largest single
    reaped descendant (plan mode: the engine is not reaped yet, only start-up helpers). Tree peaks:
    sampled (RSS every 0.1 s, PSS every 1 s and at window edges), summed over the process tree,
    since process start (``window`` "process") or since this run's start ("run", plan mode)."""
    return {
        "peak_rss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "peak_window": window,
        "peak_rss_tree_mib": tree.peak_rss / (1 << 20),
        "peak_pss_tree_mib": tree.peak_pss / (1 << 20),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Single-run mode: start, generate, shut down; memory peaks over the whole process."""
    configure_env(args)
    work = load_workload(args.input, args.sort_prompts)
    with TreeSampler() as tree:
        llm, info = start_engine(args, tree)
        result = generate_run(llm, args, work, tree, info)
        llm.llm_engine.engine_core.shutdown()  # reap the engine processes: RUSAGE_CHILDREN
        del llm
    return result | memory_fields(tree, "process")


def run_plan(args: argparse.Namespace) -> None:
    """Plan mode: every run on one engine; each run's JSON is written as soon as it is done."""
    plan = json.loads(Path(args.plan).read_text())
    configure_env(args)
    runs = [
        argparse.Namespace(
            **{
                **vars(args),
                "input": r["input"],
                "output_json": r["output_json"],
                "sort_prompts": bool(r.get("sort_prompts", False)),
            }
        )
        for r in plan
    ]
    works = [load_workload(r.input, r.sort_prompts) for r in runs]  # fail before start-up
    with TreeSampler() as tree:
        llm, info = start_engine(args, tree)
        Path(args.plan + ".ready").write_text(json.dumps(info["process_ready_s"]))
        for k, (r, work) in enumerate(zip(runs, works, strict=True)):
            wait_for = plan[k].get("wait_for")
            tree.paused.set()  # ~10% of a core otherwise (PSS reads), beside the caller's runs
            while wait_for and not Path(wait_for).exists():  # the caller's go for this run
                time.sleep(0.05)
            tree.paused.clear()
            tree.reset()
            if not llm.reset_prefix_cache():  # no run may reuse another's cached prefixes
                raise RuntimeError("reset_prefix_cache failed")
            result = generate_run(llm, r, work, tree, info)
            tree.sample()
            result |= memory_fields(tree, "run") | {"plan_index": k, "plan_runs": len(runs)}
            write_json(result, Path(r.output_json))
            print(f"[{k + 1}/{len(runs)}] {r.output_json} " + summary(result), file=sys.stderr)
        llm.llm_engine.engine_core.shutdown()
        del llm


def write_json(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


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
    if args.plan is not None:
        run_plan(args)
        return
    result = run(args)
    write_json(result, Path(args.output_json))
    print(summary(result), file=sys.stderr)


# vLLM spawns its engine processes, which re-import this module: keep LLM(...) behind the guard
if __name__ == "__main__":
    main()
