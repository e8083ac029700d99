"""Engine time and its split (attention, linear layers, other torch ops, the rest) on one
peer workload, in-process, with the peer benchmark's model and 1 GiB KV budget.

    .venv/bin/python benchmarks/profile_engine.py --workload case1 --scale 0.03
    .venv/bin/python benchmarks/profile_engine.py --attention torch       # the gather path
    .venv/bin/python benchmarks/profile_engine.py --profile               # + torch profiler split
    .venv/bin/python benchmarks/profile_engine.py --head-dim 32 --workload micro-512-64-s8 \
        --scale 0.25 --len-scale 1 --max-tokens 32     # the peer model's shape at head dim 32
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

from lib.peers import job_toml  # noqa: E402
from lib.workloads import build_model, model_dir, write_workload  # noqa: E402

import batchjob.backends.native.engine as engine_mod  # noqa: E402
from batchjob.backends.native.attention import cpu as attention_cpu  # noqa: E402
from batchjob.backends.native.attention import torch_path as attention  # noqa: E402
from batchjob.backends.native.attention.calibrate import KINDS, batch_kind  # noqa: E402
from batchjob.backends.native.models import cpu_linear  # noqa: E402
from batchjob.backends.native.models.llama import LlamaForCausalLM  # noqa: E402
from batchjob.backends.native.models.onednn_linear import OneDnnLinear  # noqa: E402
from batchjob.backends.native.models.onednn_ops import onednn_available  # noqa: E402
from batchjob.backends.native.output_processor import OutputProcessor  # noqa: E402
from batchjob.config import load_job  # noqa: E402
from batchjob.runner import pipeline  # noqa: E402
from batchjob.testing.model_shapes import SHAPES, make_shaped_model  # noqa: E402

LINEAR_OPS = ("aten::mm", "aten::addmm", "linear: C kernel", "mkldnn::_linear_pointwise")
GROUPS = {  # torch ops, by what they do in the model
    "linear layers": LINEAR_OPS,
    "KV writes": ("aten::index_copy_",),
}


def _traced(backend_cls: type) -> None:
    """Name every ``attend`` call in the profile, whatever it runs inside."""
    attend = backend_cls.attend

    def wrapped(self, *args, **kwargs):
        kind = batch_kind(args[3])  # (q, k_cache, v_cache, meta, scale)
        record = torch.profiler.record_function
        with record("attention"), record(f"attention: {kind}"):
            return attend(self, *args, **kwargs)

    backend_cls.attend = wrapped


def _traced_stages() -> None:
    """Name the forward, its logits (norm, projection, float32 copy) and the sampling."""
    record = torch.profiler.record_function

    def named(fn, label):
        def wrapped(*args, **kwargs):
            with record(label):
                return fn(*args, **kwargs)

        return wrapped

    LlamaForCausalLM.forward = named(LlamaForCausalLM.forward, "stage: forward")
    LlamaForCausalLM.logits = named(LlamaForCausalLM.logits, "stage: logits")
    engine_mod.sample_batch = named(engine_mod.sample_batch, "stage: sampling")
    OutputProcessor.process = named(OutputProcessor.process, "stage: outputs")


def gemm_rate(hidden: int, inter: int, dtype: torch.dtype) -> float:
    """GFLOP/s of the model's gate-up product at 512 rows: the machine's matmul rate in this
    dtype, the faster of torch's ``F.linear`` and oneDNN's product on a packed weight (the
    float32 ``F.linear`` reached half of oneDNN's on a Zen 5 EPYC), each the best of 15
    calls: a VM's neighbours only ever slow a call down."""
    w = torch.randn(2 * inter, hidden).to(dtype)
    x = torch.randn(512, hidden).to(dtype)
    fns = [lambda a: F.linear(a, w)]
    if onednn_available(dtype):
        fns.append(OneDnnLinear(w, None))
    best = float("inf")
    for fn in fns:
        for _ in range(3):
            fn(x)
        for _ in range(15):
            t = time.perf_counter()
            fn(x)
            best = min(best, time.perf_counter() - t)
    return 2 * 512 * hidden * 2 * inter / best / 1e9


def linear_flops_per_token(cfg: dict) -> int:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    q = heads * d
    per_layer = h * (q + 2 * kv * d) + q * h + 3 * h * cfg["intermediate_size"]
    return 2 * cfg["num_hidden_layers"] * per_layer


def _traced_linear() -> None:
    """Name every linear layer the C kernel runs (torch's show as aten::mm / addmm)."""
    run = cpu_linear.PackedLinear.kernel_forward

    def wrapped(self, x):
        with torch.profiler.record_function("linear: C kernel"):
            return run(self, x)

    cpu_linear.PackedLinear.kernel_forward = wrapped


@click.command()
@click.option("--workload", default="case1", show_default=True)
@click.option("--scale", default=0.03, show_default=True)
@click.option("--len-scale", default=0.5, show_default=True)
@click.option("--max-tokens", default=50, show_default=True)
@click.option("--attention", "attn", default="auto", show_default=True)
@click.option("--linear", type=click.Choice(["auto", "torch"]), default="auto", show_default=True,
              help="engine.linear: torch runs every linear layer on torch's sgemm.")  # fmt: skip
@click.option("--head-dim", default=128, show_default=True, help="128: bench_peers' model.")
@click.option("--kv-heads", default=8, show_default=True, help="< 8: grouped-query attention.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="model.dtype (the model folder is float32).")  # fmt: skip
@click.option("--model-shape", type=click.Choice(sorted(SHAPES)), default=None,
              help="A real checkpoint's shape (models/<name>, random weights).")  # fmt: skip
@click.option("--profile", is_flag=True, help="Split engine time with torch.profiler.")
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "out" / "profile_engine")
def main(
    workload, scale, len_scale, max_tokens, attn, linear, head_dim, kv_heads, dtype, model_shape,
    profile, out,
) -> None:  # fmt: skip
    if model_shape:
        model = make_shaped_model(ROOT / "models" / model_shape, model_shape)
    else:
        model = build_model(model_dir(head_dim, kv_heads), False, head_dim, kv_heads)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    data = out / f"{workload}-{scale}-{len_scale}-{max_tokens}-v{vocab}.parquet"
    write_workload(workload, scale, len_scale, max_tokens, vocab, data)
    toml = job_toml(
        data, model, out / "results.parquet", "batchllm", max_tokens, 1 << 30, 2048, dtype
    )
    engine = f'[engine]\nattention = "{attn}"\nlinear = "{linear}"\n'
    (out / "job.toml").write_text(toml.replace("[engine]\n", engine))
    job = load_job(out / "job.toml")
    torch.set_num_threads(2)
    if not profile:
        s = pipeline.run(job).summary
        print(f"{workload} scale {scale}: {s.requests_run} requests, engine {s.engine_s:.1f} s")
        return
    # one class only: CpuAttention falls back to TorchAttention, which would count twice
    _traced(attention.TorchAttention if attn == "torch" else attention_cpu.CpuAttention)
    _traced_linear()
    _traced_stages()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        s = pipeline.run(job).summary
    ev = {e.key: e for e in prof.key_averages()}
    attn_s = ev["attention"].cpu_time_total / 1e6 if "attention" in ev else 0.0
    print(f"{workload} scale {scale}: {s.requests_run} requests, engine {s.engine_s:.1f} s")
    print(f"  attention (whole attend calls): {attn_s:.1f} s ({attn_s / s.engine_s:.0%})")
    for kind in KINDS:  # what each batch kind's attend calls took (batch_kind's split)
        if (e := ev.get(f"attention: {kind}")) is not None:
            t = e.cpu_time_total / 1e6
            print(f"    {kind:12s} {t:5.1f} s in {e.count} calls ({t / s.engine_s:.0%})")
    for name, keys in GROUPS.items():
        t = sum(ev[k].self_cpu_time_total for k in keys if k in ev) / 1e6
        print(f"  {name}: {t:.1f} s ({t / s.engine_s:.0%})")
    top = sorted(ev.values(), key=lambda e: -e.self_cpu_time_total)[:12]
    for e in top:
        print(f"    {e.key:40s} self {e.self_cpu_time_total / 1e6:6.2f} s  n {e.count}")
    stage_split(ev, s, model, dtype)


def stage_split(ev: dict, s, model: Path, dtype: str) -> None:
    """Where a step's time goes, and the job's matmul FLOP/s against this machine's rate."""

    def total(key: str) -> float:
        return ev[key].cpu_time_total / 1e6 if key in ev else 0.0

    linear_all = sum(ev[k].self_cpu_time_total for k in LINEAR_OPS if k in ev) / 1e6
    fwd, logits, attn = total("stage: forward"), total("stage: logits"), total("attention")
    sampling = total("stage: sampling") + total("stage: outputs")
    layers_linear = max(linear_all - logits, 0.0)  # the logits stage is mostly its projection
    rows = {
        "linear layers (every layer's projections)": layers_linear,
        "attention (KV write excluded)": attn,
        "logits (final norm, vocabulary projection, float32 copy)": logits,
        "other layer glue (norms, RoPE, SiLU-mul, residual adds, KV writes)": max(
            fwd - layers_linear - attn - logits, 0.0
        ),
        "sampling and output handling": sampling,
        "host between forwards (scheduler, batch building)": max(s.engine_s - fwd - sampling, 0),
    }
    print(f"  stage split of engine {s.engine_s:.2f} s:")
    for k, v in rows.items():
        print(f"    {k:70s} {v:6.2f} s {v / s.engine_s:6.1%}")
    cfg = json.loads((model / "config.json").read_text())
    tokens = s.computed_prefill_tokens + s.generated_tokens
    flops = (
        tokens * linear_flops_per_token(cfg)
        + s.generated_tokens * 2 * cfg["hidden_size"] * cfg["vocab_size"]
    )
    td = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    rate = gemm_rate(cfg["hidden_size"], cfg["intermediate_size"], td)
    job = flops / s.engine_s / 1e9
    print(f"  roofline: {flops / 1e12:.2f} TFLOP of matmuls (linear + logits) in "
          f"{s.engine_s:.2f} s = {job:.0f} GFLOP/s; the machine's {dtype} GEMM "
          f"{rate:.0f} GFLOP/s: the job at {job / rate:.0%} of it (linear layers alone "
          f"{tokens * linear_flops_per_token(cfg) / max(layers_linear, 1e-9) / 1e9:.0f} "
          "GFLOP/s)")  # fmt: skip


if __name__ == "__main__":
    main()
