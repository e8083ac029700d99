"""Per-iteration time split of the native engine on a decode-heavy run.

    .venv/bin/python benchmarks/profile_decode.py                       # natural-qa, ~1000 rows
    .venv/bin/python benchmarks/profile_decode.py --min-decode 1 --scale 0.2   # quicker

Runs the job in-process (the peer benchmark's model at head dim 32 by default, fp32, 1 GiB
KV, batchllm) and times each iteration's phases with ``time.perf_counter`` spans wrapped
around the engine's own functions from outside (so the same script times an older commit:
``PYTHONPATH=<old tree> .venv/bin/python benchmarks/profile_decode.py``):

* scheduler: ``schedule()`` + ``update()``;
* batch metadata: ``build_batch`` (SchedulerOutput -> tensors and AttentionMetadata);
* forward, split into attention (``write_kv`` + ``attend`` of the attention backend), linear
  layers (every ``F.linear``, the LM head included) and glue (the rest of the forward:
  embedding, RMSNorm, RoPE, SiLU-mul, residual adds, logits gather);
* sampling: ``sample`` (and the batched logprob/target calls when asked);
* output handling: the rest of the engine loop (stop checks, appends, ``on_finish``, records).

Only iterations with at least ``--min-decode`` decode tokens are tabled (the decode-heavy
steady state); the totals line covers the whole run.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

from lib.peers import job_toml  # noqa: E402
from lib.workloads import build_model, write_workload  # noqa: E402

import batchjob.backends.native.engine as engine_mod  # noqa: E402
import batchjob.backends.native.output_processor as output_processor  # noqa: E402
from batchjob.backends.native.models.llama import LlamaForCausalLM  # noqa: E402
from batchjob.config import load_job  # noqa: E402
from batchjob.runner import pipeline  # noqa: E402

CLOCK: list[Callable[[], float]] = [time.thread_time]  # --clock
PHASES = ("scheduler", "batch metadata", "attention", "linear", "glue", "sampling", "output")


class Spans:
    """Seconds per phase of the current iteration; nested spans count once (outermost)."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = defaultdict(float)
        self.iters: list[tuple[int, float, dict[str, float]]] = []  # (decode tokens, wall, ...)
        self.depth: dict[str, int] = defaultdict(int)
        self.t_iter = 0.0
        self.decode = 0

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self.depth[phase]:
                return fn(*args, **kwargs)
            self.depth[phase] += 1
            t0 = CLOCK[0]()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cur[phase] += CLOCK[0]() - t0
                self.depth[phase] -= 1

        return timed

    def begin(self, decode_tokens: int, t0: float) -> None:
        self.close(t0)
        self.t_iter, self.decode, self.cur = t0, decode_tokens, defaultdict(float)

    def close(self, now: float) -> None:
        if self.t_iter:
            self.iters.append((self.decode, now - self.t_iter, dict(self.cur)))
            self.t_iter = 0.0


def instrument(spans: Spans) -> None:
    """Wrap the engine's phases (module attributes the engine loop calls) with spans."""
    make_scheduler = engine_mod.make_scheduler

    def make(*args, **kwargs):
        sched = make_scheduler(*args, **kwargs)
        schedule, update = sched.schedule, sched.update

        def timed_schedule():
            t0 = CLOCK[0]()
            out = schedule()
            spans.begin(out.num_decode_tokens, t0)
            spans.cur["scheduler"] += CLOCK[0]() - t0
            return out

        timed_update = spans.wrap("scheduler", update)

        def update_and_close(*a, **kw):
            done = timed_update(*a, **kw)  # the finished requests' outputs
            if not sched.has_unfinished():  # the last iteration ends here, not at write-out
                spans.close(CLOCK[0]())
            return done

        sched.schedule = timed_schedule
        sched.update = update_and_close
        return sched

    engine_mod.make_scheduler = make
    for name in ("build_batch",):
        setattr(engine_mod, name, spans.wrap("batch metadata", getattr(engine_mod, name)))
    for mod in (engine_mod, output_processor):  # log-probs are the output processor's
        for name in ("sample", "sample_batch", "_step_logprobs", "_target_logprobs"):
            if hasattr(mod, name):
                setattr(mod, name, spans.wrap("sampling", getattr(mod, name)))
    LlamaForCausalLM.forward = spans.wrap("forward", LlamaForCausalLM.forward)
    F.linear = spans.wrap("linear", F.linear)


def instrument_attention(spans: Spans, backend: object) -> None:
    for name in ("write_kv", "attend"):
        setattr(backend, name, spans.wrap("attention", getattr(backend, name)))


def table(spans: Spans, min_decode: int) -> str:
    rows = [(d, w, c) for d, w, c in spans.iters if d >= min_decode]
    if not rows:
        return f"no iteration with >= {min_decode} decode tokens"
    n = len(rows)
    wall = sum(w for _, w, _ in rows)
    tot: dict[str, float] = defaultdict(float)
    for _, w, c in rows:
        fwd = c.get("forward", 0.0)
        tot["attention"] += c.get("attention", 0.0)
        tot["linear"] += c.get("linear", 0.0)
        tot["glue"] += fwd - c.get("attention", 0.0) - c.get("linear", 0.0)
        tot["scheduler"] += c.get("scheduler", 0.0)
        tot["batch metadata"] += c.get("batch metadata", 0.0)
        tot["sampling"] += c.get("sampling", 0.0)
        known = fwd + sum(c.get(k, 0.0) for k in ("scheduler", "batch metadata", "sampling"))
        tot["output"] += w - known
    dec = np.mean([d for d, _, _ in rows])
    lines = [
        f"{n} iterations with >= {min_decode} decode tokens (mean {dec:.0f} decode tokens), "
        f"{1e3 * wall / n:.2f} ms per iteration",
        "",
        "| phase | ms / iteration | share |",
        "| --- | ---: | ---: |",
    ]
    for p in PHASES:
        label = {
            "attention": "forward: attention",
            "linear": "forward: linear",
            "glue": "forward: glue",
        }
        lines.append(f"| {label.get(p, p)} | {1e3 * tot[p] / n:.2f} | {tot[p] / wall:.1%} |")
    model = tot["attention"] + tot["linear"] + tot["glue"]
    lines.append(
        f"| **not model compute** | {1e3 * (wall - model) / n:.2f} | {(wall - model) / wall:.1%} |"
    )
    return "\n".join(lines)


@click.command()
@click.option("--workload", default="natural-qa", show_default=True)
@click.option("--scale", default=1.0, show_default=True)
@click.option("--len-scale", default=0.5, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--head-dim", default=32, show_default=True)
@click.option("--kv-gib", default=1.0, show_default=True)
@click.option(
    "--min-decode",
    default=500,
    show_default=True,
    help="Table iterations with this many decode tokens or more.",
)
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "out" / "profile_decode")
@click.option("--threads", default=1, show_default=True, help="torch threads (1: cpu clock exact).")
@click.option(
    "--clock",
    type=click.Choice(["cpu", "wall"]),
    default="cpu",
    show_default=True,
    help="cpu: this thread's CPU time (robust on a shared machine, with --threads 1).",
)
@click.option("--verbose", is_flag=True, help="Also print every iteration.")
def main(
    workload,
    scale,
    len_scale,
    max_tokens,
    head_dim,
    kv_gib,
    min_decode,
    out,
    threads,
    clock,
    verbose,
) -> None:
    name = "bench-peer" if head_dim == 128 else f"bench-peer-d{head_dim}"
    model = build_model(ROOT / "models" / name, smoke=False, head_dim=head_dim)
    data = out / f"{workload}-{scale}-{len_scale}-{max_tokens}.parquet"
    write_workload(workload, scale, len_scale, max_tokens, 1000, data)
    kv = int(kv_gib * (1 << 30))
    (out / "job.toml").write_text(
        job_toml(data, model, out / "results.parquet", "batchllm", max_tokens, kv, 2048).replace(
            "threads = 2", f"threads = {threads}"
        )
    )
    job = load_job(out / "job.toml")
    torch.set_num_threads(threads)
    CLOCK[0] = time.thread_time if clock == "cpu" else time.perf_counter
    spans = Spans()
    instrument(spans)
    engine_init = engine_mod.Engine.__init__

    def init(self, model, *args, **kwargs):
        engine_init(self, model, *args, **kwargs)
        instrument_attention(spans, model.attn_backend)

    engine_mod.Engine.__init__ = init
    s = pipeline.run(job).summary
    spans.close(CLOCK[0]())
    print(f"engine module: {engine_mod.__file__}", file=sys.stderr)
    print(
        f"{workload} scale {scale} len-scale {len_scale} max-tokens {max_tokens}, head dim "
        f"{head_dim}: {s.requests_run} requests, {len(spans.iters)} iterations, engine "
        f"{s.engine_s:.1f} s"
    )
    print(table(spans, min_decode))
    if verbose:
        for i, (d, w, c) in enumerate(spans.iters):
            print(i, d, f"{w * 1e3:.1f}", {k: round(v * 1e3, 1) for k, v in c.items()})


if __name__ == "__main__":
    main()
