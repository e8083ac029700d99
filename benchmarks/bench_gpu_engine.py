"""Engine benchmark on a CUDA GPU: a Llama-3-8B-shaped model, `batchllm` vs `baseline`.

    python benchmarks/bench_gpu_engine.py --model-dir /dev/shm/llama3-8b-random \
        --workloads case1,micro-2000-200-s16 --scale 0.25 --max-tokens 64

The model has Llama-3-8B's shapes (bf16, 32 layers, 32 heads, 8 KV heads, head dim 128,
hidden 4096, intermediate 14336, vocab 128256) and random weights, written as a sharded
safetensors checkpoint and read by batchjob's own loader (``--layers`` shrinks it for a
smoke run). The KV budget comes from ``engine.gpu_memory_fraction``. Every request
generates exactly ``--max-tokens`` tokens (EOS ignored).

Every configuration (workload x policy x ``--cuda-graphs`` value) runs twice on one engine:
a first, untimed run at the timed scale (it compiles and autotunes the Triton kernels for
every shape the workload reaches, and carries a torch.profiler window of
``--profile-iters`` decode-phase iterations: GPU kernel time over wall time), then the
timed run. A warm-up at a smaller scale misses shapes: on an H200 the first full-scale run
then paid ~12 s of compiling inside its timing, whichever configuration came first.

Per configuration it prints requests/s and tokens/s, the per-iteration split of host time
(scheduler, batch building, the model call: kernel launches, the forward is asynchronous;
the rest of the loop: sampling, finish checks, the wait for the GPU), the median wall time
of a decode-only iteration, and how many requests generated the same tokens as the
workload's first configuration. ``--cuda-graphs 512,0`` runs the forward with CUDA graphs
and eagerly, side by side.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click
import torch

ROOT = Path(__file__).resolve().parent.parent

from lib.workloads import prompts_from_table  # noqa: E402

import batchjob.backends.native.engine as engine_mod  # noqa: E402
from batchjob.backends.native.engine import Engine  # noqa: E402
from batchjob.backends.native.models.cuda_graphs import PiecewiseForward  # noqa: E402
from batchjob.backends.native.models.loader import load_model  # noqa: E402
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig  # noqa: E402
from batchjob.plan.build import build_plan  # noqa: E402
from batchjob.testing.workloads import make_workload  # noqa: E402

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def write_random_checkpoint(folder: Path, layers: int, device: str, seed: int = 0) -> None:
    """A sharded bf16 checkpoint of LLAMA3_8B's shapes, one shard per layer, drawn on ``device``
    (kept when the folder already holds this configuration)."""
    from safetensors.torch import save_file

    cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
    done = folder / "config.json"
    if done.exists() and json.loads(done.read_text()) == cfg:
        return
    folder.mkdir(parents=True, exist_ok=True)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * 128, cfg["num_key_value_heads"] * 128
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * std
        return t.cpu()

    shards: dict[str, dict[str, torch.Tensor]] = {
        "embed": {"model.embed_tokens.weight": rand(v, h)},
        "head": {"lm_head.weight": rand(v, h), "model.norm.weight": torch.ones(h).bfloat16()},
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shards[f"layer{i}"] = {
            p + "input_layernorm.weight": torch.ones(h).bfloat16(),
            p + "post_attention_layernorm.weight": torch.ones(h).bfloat16(),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
    weight_map = {}
    for name, tensors in shards.items():
        file = f"model-{name}.safetensors"
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg))  # last: marks the folder complete


class HostTimers:
    """Seconds of host time per loop part, by wrapping the engine module's calls."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self._orig_build = engine_mod.build_batch
        self._orig_make = engine_mod.make_scheduler

    def _timed(self, key: str, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[key] += time.perf_counter() - t

        return wrapper

    def install(self, engine: Engine) -> None:
        engine_mod.build_batch = self._timed("build_batch", self._orig_build)

        def make(*a, **kw):
            sched = self._orig_make(*a, **kw)
            sched.schedule = self._timed("schedule", sched.schedule)
            sched.update = self._timed("scheduler_update", sched.update)
            return sched

        engine_mod.make_scheduler = make
        engine.forward = _TimedModel(
            engine.forward, self._timed("model_call_launch", engine.forward)
        )

    def remove(self, engine: Engine) -> None:
        engine_mod.build_batch = self._orig_build
        engine_mod.make_scheduler = self._orig_make
        engine.forward = engine.forward.inner


class _TimedModel:
    """The model, its calls timed on the host (launches only: the forward is asynchronous)."""

    def __init__(self, inner, timed_call) -> None:
        self.inner = inner
        self.call = timed_call

    def __call__(self, *a):
        return self.call(*a)


@dataclass(frozen=True)
class Result:
    workload: str
    policy: str
    cuda_graph_max_tokens: int  # 0: eager
    requests: int
    prompt_tokens: int
    generated_tokens: int
    prefill_tokens_computed: int
    wall_s: float
    plan_s: float
    iterations: int
    preemptions: int
    requests_per_s: float
    tokens_per_s: float
    schedule_s: float
    build_batch_s: float
    model_call_launch_s: float
    scheduler_update_s: float
    rest_of_loop_s: float
    profiled_iters: int
    profiled_wall_s: float
    profiled_gpu_kernel_s: float
    decode_iter_ms: float  # median wall time of a decode-only iteration (no prefill tokens)

    @property
    def gpu_busy(self) -> float:
        return self.profiled_gpu_kernel_s / self.profiled_wall_s if self.profiled_wall_s else 0.0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_once(
    engine: Engine,
    prompts,
    name: str,
    policy: str,
    graphs: int,
    profile_iters: int,
    op_table: int = 0,
) -> tuple[Result, dict[int, tuple[int, ...]]]:
    """One run; its result and each request's generated tokens by row id. ``op_table`` > 0
    also traces host ops in the profiled window and prints the top ``op_table`` by host time
    and by GPU time."""
    timers = HostTimers()
    timers.install(engine)
    prof_start = 40  # past the first prefill-heavy iterations: a mixed/decode window
    state: dict = {}

    def on_iter(rec) -> None:
        i = rec.iteration
        if profile_iters and i == prof_start and torch.cuda.is_available():
            _sync()
            activities = [torch.profiler.ProfilerActivity.CUDA]
            if op_table:
                activities.append(torch.profiler.ProfilerActivity.CPU)
            state["prof"] = torch.profiler.profile(activities=activities)
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        elif "prof" in state and "t1" not in state and i == prof_start + profile_iters:
            _sync()
            state["t1"] = time.perf_counter()
            state["prof"].__exit__(None, None, None)

    _sync()
    t0 = time.perf_counter()
    plan = build_plan(prompts) if policy == "batchllm" else None
    plan_s = time.perf_counter() - t0
    outputs: dict[int, tuple[int, ...]] = {}
    try:
        run = engine.run(
            prompts,
            plan,
            SamplingConfig(max_tokens=1, ignore_eos=True),
            lambda o: outputs.__setitem__(o.row_id, tuple(o.token_ids.tolist())),
            on_iteration=on_iter,
        )
    finally:
        timers.remove(engine)
    _sync()
    wall = time.perf_counter() - t0
    gpu_s, prof_wall = 0.0, 0.0
    if "t1" in state:
        prof_wall = state["t1"] - state["t0"]
        events = state["prof"].key_averages()
        # with host ops traced, an op's row repeats its kernels' time: count GPU events only
        cuda = torch.autograd.DeviceType.CUDA
        kernels = [e for e in events if not op_table or e.device_type == cuda]
        gpu_s = sum(e.self_device_time_total for e in kernels) / 1e6  # us -> s
        if op_table:
            print(f"# {name} {policy} graphs<={graphs}: iterations {prof_start}-", end="")
            print(f"{prof_start + profile_iters - 1} of the first run")
            for key in ("self_cpu_time_total", "self_device_time_total"):
                print(events.table(sort_by=key, row_limit=op_table, max_name_column_width=60))
    loop_s = sum(r.wall_s for r in run.iterations)
    host = dict(timers.s)
    named = sum(host.values())
    logical = int(prompts.lengths.sum())
    gen = sum(map(len, outputs.values()))
    decode = [r.wall_s for r in run.iterations if r.prefill_tokens == 0 and r.decode_tokens]
    return Result(
        workload=name,
        policy=policy,
        cuda_graph_max_tokens=graphs,
        requests=len(prompts),
        prompt_tokens=logical,
        generated_tokens=gen,
        prefill_tokens_computed=int(run.scheduler.prefill_tokens),
        wall_s=wall,
        plan_s=plan_s,
        iterations=len(run.iterations),
        preemptions=run.scheduler.preemptions,
        requests_per_s=len(prompts) / wall,
        tokens_per_s=(logical + gen) / wall,
        schedule_s=host.get("schedule", 0.0),
        build_batch_s=host.get("build_batch", 0.0),
        model_call_launch_s=host.get("model_call_launch", 0.0),
        scheduler_update_s=host.get("scheduler_update", 0.0),
        rest_of_loop_s=max(loop_s - named, 0.0),
        profiled_iters=profile_iters if "t1" in state else 0,
        profiled_wall_s=prof_wall,
        profiled_gpu_kernel_s=gpu_s,
        decode_iter_ms=1e3 * statistics.median(decode) if decode else 0.0,
    ), outputs


@click.command()
@click.option("--model-dir", type=click.Path(path_type=Path), required=True)
@click.option("--layers", default=32, show_default=True)
@click.option("--workloads", default="case1,micro-2000-200-s16", show_default=True)
@click.option("--scale", default=0.25, show_default=True, help="workload rows scale")
@click.option("--max-tokens", default=64, show_default=True, help="fixed output length")
@click.option("--policies", default="batchllm,baseline", show_default=True)
@click.option("--chunk-size", default=8192, show_default=True)
@click.option("--gpu-memory-fraction", default=0.9, show_default=True)
@click.option("--attention", default="auto", show_default=True)
@click.option("--profile-iters", default=20, show_default=True)
@click.option(
    "--op-table",
    default=0,
    show_default=True,
    help="also trace host ops in the profiled window; print this many top ops (0: none)",
)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="JSON lines here")
@click.option("--device", default="cuda", show_default=True, help="cpu: a smoke run of the code")
@click.option("--kv-mib", default=None, type=int, help="KV budget (default: the GPU fraction)")
@click.option(
    "--cuda-graphs",
    default="512",
    show_default=True,
    help="engine.cuda_graph_max_tokens values to run, comma-separated (0: eager)",
)
def main(
    model_dir, layers, workloads, scale, max_tokens, policies, chunk_size,
    gpu_memory_fraction, attention, profile_iters, op_table, out, device, kv_mib, cuda_graphs,
) -> None:  # fmt: skip
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu_engine.py needs a CUDA GPU (or --device cpu for a smoke run)")
    t = time.perf_counter()
    write_random_checkpoint(model_dir, layers, device)
    t_write = time.perf_counter() - t
    print(f"# checkpoint in {model_dir}: {t_write:.1f} s", flush=True)
    t = time.perf_counter()
    model, info = load_model(model_dir, dtype="bfloat16", device=device, attention=attention)
    _sync()
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    kv_bytes = kv_mib << 20 if kv_mib else None
    limits = [int(x) for x in cuda_graphs.split(",")]
    print(
        f"# {gpu}, torch {torch.__version__}; checkpoint written in "
        f"{t_write:.1f} s, loaded in {time.perf_counter() - t:.1f} s; {info.num_layers} layers, "
        f"attention {type(model.attn_backend).__name__}",
        flush=True,
    )
    results = []
    for name in workloads.split(","):
        table = make_workload(
            name, scale=scale, seed=0, vocab_size=info.vocab_size, max_tokens=max_tokens
        )
        prompts = prompts_from_table(table)
        first_outputs: dict[int, tuple[int, ...]] | None = None
        for policy, graphs in itertools.product(policies.split(","), limits):
            engine = Engine(
                model,
                info,
                SchedulerConfig(policy=policy, chunk_size=chunk_size),
                EngineConfig(
                    block_size=16,
                    gpu_memory_fraction=gpu_memory_fraction,
                    kv_cache_bytes=kv_bytes,
                    cuda_graph_max_tokens=graphs,
                ),
            )
            pieces = engine.forward if isinstance(engine.forward, PiecewiseForward) else None
            if pieces:  # every bucket captured at start-up, as vLLM does
                t_capture = time.perf_counter()
                pieces.capture_all()
                _sync()
                print(f"# captured {graphs} tokens: {time.perf_counter() - t_capture:.1f} s")
            # the first run compiles what this scale reaches and is the profiled one (CUPTI's
            # tracing slows graph replays, so the timed run is never profiled)
            prof, _ = run_once(engine, prompts, name, policy, graphs, profile_iters, op_table)
            before = (len(pieces.captured), pieces.capture_s) if pieces else (0, 0.0)
            r, outputs = run_once(engine, prompts, name, policy, graphs, 0)
            r = replace(
                r,
                profiled_iters=prof.profiled_iters,
                profiled_wall_s=prof.profiled_wall_s,
                profiled_gpu_kernel_s=prof.profiled_gpu_kernel_s,
            )
            if pieces and len(pieces.captured) > before[0]:
                print(f"# timed run captured {len(pieces.captured) - before[0]} buckets")
            first_outputs = first_outputs if first_outputs is not None else outputs
            same = sum(first_outputs.get(k) == v for k, v in outputs.items())
            results.append(r)
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
            loop = r.schedule_s + r.build_batch_s + r.model_call_launch_s
            print(
                f"{name} {policy} graphs<={graphs}: {r.requests} req, "
                f"{r.requests_per_s:.2f} req/s, {r.tokens_per_s:.0f} tok/s, "
                f"{r.iterations} iters, decode iteration {r.decode_iter_ms:.2f} ms, "
                f"{r.preemptions} preempt, "
                f"prefill computed {r.prefill_tokens_computed} of {r.prompt_tokens}; host s: "
                f"schedule {r.schedule_s:.2f} build {r.build_batch_s:.2f} launch "
                f"{r.model_call_launch_s:.2f} update {r.scheduler_update_s:.2f} rest "
                f"{r.rest_of_loop_s:.2f} (named {loop:.2f} of {r.wall_s:.2f}); profiled "
                f"{r.profiled_iters} iters of the first run: GPU kernels {r.gpu_busy:.0%} of "
                f"wall; {same} of {len(outputs)} requests' tokens equal the first configuration's",
                flush=True,
            )
            if out is not None:
                with open(out, "a") as f:
                    f.write(json.dumps(asdict(r)) + "\n")
    by = {(r.workload, r.policy, r.cuda_graph_max_tokens): r for r in results}
    for name in workloads.split(","):
        for g in limits:
            b, base = by.get((name, "batchllm", g)), by.get((name, "baseline", g))
            if b and base:
                ratio = b.tokens_per_s / base.tokens_per_s
                print(f"{name} graphs<={g}: batchllm / baseline = {ratio:.2f}x")
        for policy in policies.split(","):
            runs = [by.get((name, policy, g)) for g in limits]
            if len(runs) > 1 and all(runs) and limits[-1] == 0:
                first, eager = runs[0], runs[-1]
                assert first is not None and eager is not None
                ratio = first.tokens_per_s / eager.tokens_per_s
                print(f"{name} {policy}: graphs<={limits[0]} / eager = {ratio:.2f}x")


if __name__ == "__main__":
    main()
