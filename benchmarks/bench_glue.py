"""The native Llama layer's glue before and after the in-place rewrite, in one run (issue 12).

    .venv/bin/python benchmarks/bench_glue.py                # bench-peer shapes, D 32/64/128
    .venv/bin/python benchmarks/bench_glue.py --tokens 512 --head-dims 128 --repeats 50

"glue": RMSNorm x2, RoPE on q and k, residual adds x2, SiLU-mul and the per-forward cos/sin
(divided over the layers), on the outputs of the real projections; "layer": a whole decoder
layer with a stand-in attention (KV write skipped, output = q), so what the glue changes in
the matmuls (a strided gate half as the down projection's input) is counted too. ``before``
is the code as it was (HF's out-of-place formulas, copied below), ``after`` the model's.
Timed as CPU seconds of this thread with one torch thread (steadier than wall time on a
shared machine), before/after interleaved call by call; median of ``--repeats``.
"""

from __future__ import annotations

import platform
import statistics
import time
from types import SimpleNamespace

import click
import torch
import torch.nn.functional as F

from batchjob.backends.native.models.config import ModelConfig, RopeConfig
from batchjob.backends.native.models.llama import DecoderLayer, rms_norm, silu_mul_
from batchjob.backends.native.models.rope import (
    RopeTable,
    apply_rope,
    apply_rope_,
    inv_frequencies,
    rope_cos_sin,
)
from batchjob.model.host_cpu import cpu_summary

NO_META = SimpleNamespace(slot_mapping=None)  # the stand-in attention reads no metadata


def old_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class StandIn:
    """Attention backend stand-in: no KV write, the output is q (same shape as attention's)."""

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        pass

    def attend(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        return q.contiguous()


def old_layer_forward(layer: DecoderLayer, h, cos, sin, backend) -> torch.Tensor:
    """DecoderLayer.forward before the rewrite (split views, out-of-place glue)."""
    a, eps = layer.attn, layer.input_norm.eps
    t = h.shape[0]
    x = old_rms_norm(h, layer.input_norm.weight, eps)
    q, k, _ = a.qkv(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
    q = q.view(t, a.num_heads, a.head_dim)
    k = k.view(t, a.num_kv_heads, a.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = backend.attend(q, None, None, None, a.scale)
    h = h + a.o_proj(o.reshape(t, a.q_size))
    x = old_rms_norm(h, layer.post_norm.weight, eps)
    gate, up = layer.mlp.gate_up(x).split([layer.mlp.inter, layer.mlp.inter], dim=-1)
    return h + layer.mlp.down(F.silu(gate) * up)


def cpu_time(fn) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def measure(layer: DecoderLayer, t: int, layers: int, repeats: int, seed: int) -> dict:
    """Median CPU microseconds of glue/layer before/after for one [t, hidden] batch."""
    a, inter, dt = layer.attn, layer.mlp.inter, layer.input_norm.weight.dtype
    heads, kv_heads, d = a.num_heads, a.num_kv_heads, a.head_dim
    qs, kvs, hidden = a.q_size, a.kv_size, layer.input_norm.weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4000, (t,), generator=g)
    h0 = torch.randn(t, hidden, generator=g).to(dt)
    qkv0 = torch.randn(t, qs + 2 * kvs, generator=g).to(dt)
    gu0 = torch.randn(t, 2 * inter, generator=g).to(dt)
    add0 = torch.randn(t, hidden, generator=g).to(dt)
    w = layer.input_norm.weight
    inv = inv_frequencies(RopeConfig(theta=10000.0, rope_type="default"), d)
    table = RopeTable(dt)
    cos_f, sin_f = rope_cos_sin(pos, inv, dt)  # [T, 1, D]: before
    cos_h, sin_h = table.lookup(pos, inv)  # [T, 1, D/2]: after (table filled once)
    h1, qkv1, gu1, hl = h0.clone(), qkv0.clone(), gu0.clone(), h0.clone()
    backend = StandIn()

    def glue_before() -> None:
        old_rms_norm(h0, w, 1e-6)
        q, k, _ = qkv0.split([qs, kvs, kvs], dim=-1)
        apply_rope(q.view(t, heads, d), cos_f, sin_f)
        apply_rope(k.view(t, kv_heads, d), cos_f, sin_f)
        h = h0 + add0
        old_rms_norm(h, w, 1e-6)
        gate, up = gu0.split([inter, inter], dim=-1)
        F.silu(gate) * up
        h + add0

    def glue_after() -> None:
        rms_norm(h1, w, 1e-6)
        apply_rope_(qkv1[:, : qs + kvs].view(t, heads + kv_heads, d), cos_h, sin_h)
        h1.add_(add0)
        rms_norm(h1, w, 1e-6)
        silu_mul_(gu1, inter)
        h1.add_(add0)

    fns = {
        "glue before": glue_before,
        "glue after": glue_after,
        "layer before": lambda: old_layer_forward(layer, h0, cos_f, sin_f, backend),
        "layer after": lambda: layer(hl, cos_h, sin_h, (None, None), NO_META, backend),
        "cos/sin before": lambda: rope_cos_sin(pos, inv, dt),
        "cos/sin after": lambda: table.lookup(pos, inv),
    }
    res: dict[str, list[float]] = {k: [] for k in fns}
    with torch.inference_mode():
        for rep in range(repeats + 2):
            for x, x0 in ((h1, h0), (qkv1, qkv0), (gu1, gu0), (hl, h0)):
                x.copy_(x0)  # untimed: the in-place ops start from the same values
            for k, fn in fns.items():
                took = cpu_time(fn)
                if rep >= 2:  # warm-up
                    res[k].append(took)
    m = {k: statistics.median(v) * 1e6 for k, v in res.items()}
    for when in ("before", "after"):  # cos/sin: once per forward, 1 / layers of it per layer
        m[f"glue {when}"] += m[f"cos/sin {when}"] / layers
        m[f"layer {when}"] += m[f"cos/sin {when}"] / layers
    return m


@click.command()
@click.option("--tokens", default="64,512,2048", show_default=True, help="Tokens per batch.")
@click.option("--head-dims", default="32,64,128", show_default=True)
@click.option("--hidden", default=256, show_default=True)
@click.option("--heads", default=8, show_default=True, help="Query heads = KV heads.")
@click.option("--intermediate", default=512, show_default=True)
@click.option("--layers", default=8, show_default=True, help="Layers the cos/sin are shared by.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32")
@click.option("--repeats", default=30, show_default=True)
def main(tokens, head_dims, hidden, heads, intermediate, layers, dtype, repeats) -> None:
    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    print(f"# {cpu_summary()}; torch {torch.__version__}, 1 thread, {dtype}, {platform.node()}")
    print(
        "| head dim | tokens | glue before us | glue after us | **glue x** "
        "| layer before us | layer after us | **layer x** | glue share of layer before |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d in map(int, head_dims.split(",")):
        cfg = ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=1000,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=1,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=d,
            rms_norm_eps=1e-6,
            rope=RopeConfig(theta=10000.0, rope_type="default"),
            max_position=4096,
            tie_word_embeddings=False,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_window=None,
            bos_token_id=None,
            eos_token_ids=(),
            torch_dtype=dtype,
        )
        layer = DecoderLayer(cfg, dt)
        g = torch.Generator().manual_seed(d)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for t in map(int, tokens.split(",")):
            m = measure(layer, t, layers, repeats, seed=t)
            gb, ga, lb, la = (
                m[k] for k in ("glue before", "glue after", "layer before", "layer after")
            )
            print(
                f"| {d} | {t} | {gb:.0f} | {ga:.0f} | **{gb / ga:.2f}x** "
                f"| {lb:.0f} | {la:.0f} | **{lb / la:.2f}x** | {gb / lb:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
