"""Engine benchmark: `batchllm` vs `baseline` policy on the same engine, model and KV budget.

    .venv/bin/python benchmarks/bench_engine.py            # all workloads, 3 repeats
    .venv/bin/python benchmarks/bench_engine.py --workloads case1 --repeats 1

Workloads are the paper's shapes from batchjob/testing/workloads.py, scaled for a 2-core CPU, rows
shuffled. The model (random weights) and the KV budget are sized so that the dataset's KV
is several times the budget, as a 7B model's is on a GPU. Reports medians over repeats:
throughput (requests/s, prompt and total tokens/s), achieved saving ratio, mean/min tokens
per iteration, preemptions, and the ratio batchllm / baseline measured in the same run.
Writes the table to stdout and ``--out``.md, every run to ``--out``.parquet (default
out/bench_engine). ``--no-decode-reserve``: batchllm admits new prefill by KV blocks in use.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import torch

ROOT = Path(__file__).resolve().parent.parent

from lib.workloads import prompts_from_table  # noqa: E402

from batchjob.backends.native.engine import Engine  # noqa: E402
from batchjob.backends.native.models.loader import load_model  # noqa: E402
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig  # noqa: E402
from batchjob.plan.build import build_plan  # noqa: E402
from batchjob.storage.atomic import write_parquet_atomic  # noqa: E402
from batchjob.testing.tiny_model import make_tiny_model  # noqa: E402
from batchjob.testing.workloads import make_workload  # noqa: E402
from batchjob.tokenize.prompts import TokenizedPrompts  # noqa: E402

# name -> (scale, len_scale): ~100-200 requests of a few hundred tokens each on 2 cores
WORKLOADS = {
    "micro-2000-200-s16": (0.1, 0.25),
    "micro-2000-200-s4": (0.1, 0.25),
    "micro-1000-1000-s16": (0.1, 0.25),
    "micro-200-2000-s16": (0.1, 0.25),
    "case1": (0.05, 0.25),
    "case2": (0.15, 0.25),
    "nosharing": (0.15, 0.5),
}
VOCAB = 2048


@dataclass(frozen=True)
class Measurement:
    workload: str
    policy: str
    requests: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    plan_s: float
    saving_ratio_achieved: float
    saving_ratio_planned: float
    mean_tokens_per_iter: float
    min_tokens_per_iter: int
    iterations: int
    preemptions: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.wall_s


def workload_prompts(name: str, vocab_size: int, max_tokens: int) -> TokenizedPrompts:
    """Workload ``name`` at this benchmark's scale, as token ids of the model's vocabulary."""
    scale, len_scale = WORKLOADS[name]
    table = make_workload(
        name,
        scale=scale,
        len_scale=len_scale,
        seed=0,
        form="ids",
        vocab_size=vocab_size,
        max_tokens=max_tokens,
    )
    return prompts_from_table(table)


def measure(engine: Engine, prompts: TokenizedPrompts, name: str, policy: str) -> Measurement:
    t0 = time.perf_counter()
    plan = build_plan(prompts) if policy == "batchllm" else None
    plan_s = time.perf_counter() - t0
    generated = []
    run = engine.run(
        prompts,
        plan,
        SamplingConfig(max_tokens=1, ignore_eos=True),
        lambda o: generated.append(len(o.token_ids)),
    )
    tokens = np.array([r.decode_tokens + r.prefill_tokens for r in run.iterations])
    logical = int(prompts.lengths.sum())
    first_time = run.scheduler.prefill_tokens - run.scheduler.recomputed_tokens
    return Measurement(
        workload=name,
        policy=policy,
        requests=len(prompts),
        prompt_tokens=logical,
        generated_tokens=int(sum(generated)),
        wall_s=run.wall_s + plan_s,
        plan_s=plan_s,
        saving_ratio_achieved=1 - first_time / logical,
        saving_ratio_planned=plan.stats.saving_ratio_single_level if plan else float("nan"),
        mean_tokens_per_iter=float(tokens.mean()),
        min_tokens_per_iter=int(tokens.min()),
        iterations=len(tokens),
        preemptions=run.scheduler.preemptions,
    )


def markdown(rows: list[dict]) -> str:
    head = list(rows[0].keys())
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command()
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--kv-mib", default=48, show_default=True, help="KV budget for both policies.")
@click.option("--chunk-size", default=512, show_default=True)
@click.option("--max-num-seqs", default=256, show_default=True, help="baseline cap (vLLM's)")
@click.option("--max-tokens", default=32, show_default=True, help="Output tokens per row.")
@click.option("--decode-reserve/--no-decode-reserve", default=True, show_default=True,
              help="scheduler.decode_reserve (batchllm): off admits new prefill by KV blocks "
              "in use.")  # fmt: skip
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "out" / "bench_engine",
              help="Writes OUT.md (the table) and OUT.parquet (every run); default "
              "out/bench_engine.")  # fmt: skip
def main(
    workloads, repeats, kv_mib, chunk_size, max_num_seqs, max_tokens, decode_reserve, out: Path
) -> None:
    torch.manual_seed(0)
    model_dir = ROOT / "models" / "bench-llama"
    if not (model_dir / "config.json").exists():
        make_tiny_model(
            model_dir,
            family="llama",
            vocab_size=VOCAB,
            hidden=256,
            layers=4,
            heads=4,
            kv_heads=4,
            intermediate=688,
            max_position=8192,
        )
    model, info = load_model(model_dir, dtype="float32", device="auto", attention="auto")
    print(
        f"model: {info.num_layers} layers, {info.num_kv_heads} kv heads x {info.head_dim}, "
        f"{info.kv_bytes_per_token} KV bytes/token; KV budget {kv_mib} MiB; "
        f"torch threads {torch.get_num_threads()}; device {info.device}"
    )
    results: list[Measurement] = []
    summary_rows = []
    for name in workloads.split(","):
        prompts = workload_prompts(name, info.vocab_size, max_tokens)
        kv_need = int(prompts.lengths.sum() + max_tokens * len(prompts)) * info.kv_bytes_per_token
        per_policy: dict[str, list[Measurement]] = {}
        for _ in range(repeats):
            for policy in ("batchllm", "baseline"):
                engine = Engine(
                    model,
                    info,
                    SchedulerConfig(
                        policy=policy,
                        chunk_size=chunk_size,
                        max_num_seqs=max_num_seqs,
                        decode_reserve=decode_reserve,
                    ),
                    EngineConfig(kv_cache_bytes=kv_mib << 20, block_size=16),
                )
                m = measure(engine, prompts, name, policy)
                per_policy.setdefault(policy, []).append(m)
                results.append(m)
                del engine
        med = {p: statistics.median(m.tokens_per_s for m in ms) for p, ms in per_policy.items()}
        b, base = per_policy["batchllm"][0], per_policy["baseline"][0]
        row = {
            "workload": name,
            "requests": b.requests,
            "prompt_tok": b.prompt_tokens,
            "KV need/budget": kv_need / (kv_mib << 20),
            "batchllm tok/s": med["batchllm"],
            "baseline tok/s": med["baseline"],
            "ratio": med["batchllm"] / med["baseline"],
            "saving plan": b.saving_ratio_planned,
            "saving batchllm": b.saving_ratio_achieved,
            "saving baseline": base.saving_ratio_achieved,
            "tok/iter batchllm mean/min": f"{b.mean_tokens_per_iter:.0f}/{b.min_tokens_per_iter}",
            "tok/iter baseline mean/min": (
                f"{base.mean_tokens_per_iter:.0f}/{base.min_tokens_per_iter}"
            ),
            "preempt b/base": f"{b.preemptions}/{base.preemptions}",
        }
        summary_rows.append(row)
        print(
            markdown([row]).splitlines()[-1] if len(summary_rows) > 1 else markdown([row]),
            flush=True,
        )
    table_md = markdown(summary_rows)
    print("\n" + table_md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table_md + "\n")
    cols = [f for f in Measurement.__dataclass_fields__]
    write_parquet_atomic(
        pa.table({c: [getattr(m, c) for m in results] for c in cols}),
        out.with_suffix(".parquet"),
    )


if __name__ == "__main__":
    main()
