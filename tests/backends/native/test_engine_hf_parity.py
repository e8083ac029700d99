"""The engine's greedy outputs equal Hugging Face transformers token for token.

Real tiny models of each family (random weights), real planner, real scheduler, paged KV:
with and without shared prefixes, chunk sizes that split a prefix mid-block, and a KV
budget so small that preemption (recompute) happens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchjob.backends.native.engine import Engine
from batchjob.backends.native.models.loader import load_model
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig
from batchjob.plan.build import build_plan
from batchjob.testing.tiny_model import FAMILIES, make_tiny_model
from batchjob.tokenize.prompts import TokenizedPrompts

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10


def hf_greedy(hf, prompt: np.ndarray, n: int) -> list[int]:
    """Reference: full forward per step, argmax (no EOS handling: ignore_eos)."""
    x = torch.tensor(prompt, dtype=torch.long)[None]
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(hf(x).logits[0, -1].argmax())
            out.append(t)
            x = torch.cat([x, torch.tensor([[t]])], dim=1)
    return out


def shared_prompts(vocab: int, seed: int) -> TokenizedPrompts:
    """Two documents asked several questions each, plus unrelated rows, shuffled."""
    rng = np.random.default_rng(seed)
    seqs = []
    for doc_len, members in ((37, 4), (21, 3)):
        doc = rng.integers(5, vocab, doc_len)
        seqs += [
            np.concatenate([doc, rng.integers(5, vocab, rng.integers(1, 14))])
            for _ in range(members)
        ]
    seqs += [rng.integers(5, vocab, n) for n in (23, 9, 1)]
    order = rng.permutation(len(seqs))
    return TokenizedPrompts.from_lists([seqs[i] for i in order], max_tokens=MAX_TOKENS)


@pytest.fixture(
    scope="module",
    params=FAMILIES,
)
def family_model(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param)
    model, info = load_model(folder, dtype="float32", device="cpu", attention="torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = shared_prompts(info.vocab_size, seed=1)
    refs = [hf_greedy(hf, prompts.row(i), MAX_TOKENS) for i in range(len(prompts))]
    return model, info, prompts, refs


def run_engine(model, info, prompts, sched: SchedulerConfig, eng: EngineConfig, use_plan: bool):
    engine = Engine(model, info, sched, eng)
    plan = build_plan(prompts) if use_plan else None
    outs = {}
    run = engine.run(
        prompts,
        plan,
        SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True),
        lambda o: outs.__setitem__(o.position, o.token_ids.tolist()),
    )
    return [outs[i] for i in range(len(prompts))], run, plan


@pytest.mark.parametrize(
    "policy,chunk,kv_blocks",
    [
        ("batchllm", 2048, 256),  # whole prompts in one iteration
        ("batchllm", 13, 256),  # chunks split prefixes mid-block
        ("batchllm", 24, 9),  # tiny KV: decode growth forces preemption
        ("baseline", 17, 256),  # vLLM-like policy with LRU prefix cache
        ("baseline", 24, 9),
    ],
)
def test_greedy_matches_hf(family_model, policy, chunk, kv_blocks):
    model, info, prompts, refs = family_model
    bs = 8
    # tiny KV: admission by blocks in use alone, so that decode growth preempts (recompute)
    reserve = kv_blocks >= 16
    sched = SchedulerConfig(
        policy=policy, chunk_size=chunk, kv_threshold=0.9, decode_reserve=reserve
    )
    eng = EngineConfig(block_size=bs, kv_cache_bytes=kv_blocks * bs * info.kv_bytes_per_token)
    outs, run, plan = run_engine(model, info, prompts, sched, eng, use_plan=policy == "batchllm")
    assert outs == refs
    if policy == "batchllm":
        assert plan.stats.saving_ratio_single_level > 0.3
        shared = int(sum(plan.group_prefix_len))
        assert run.scheduler.prefixes_computed == int(np.count_nonzero(plan.group_prefix_len))
        assert run.scheduler.prefix_tokens >= shared
    if kv_blocks < 16:
        assert run.scheduler.preemptions > 0, "the small KV budget should force preemption"
        if policy == "batchllm":  # the decode-growth reserve avoids it on the same budget
            sched = SchedulerConfig(policy=policy, chunk_size=chunk, kv_threshold=0.9)
            outs, run, _ = run_engine(model, info, prompts, sched, eng, use_plan=True)
            assert outs == refs and run.scheduler.preemptions == 0


@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_unwritten_kv_slots_never_reach_outputs(family_model, attention, monkeypatch):
    """What a KV slot holds before it is written (a freed block's stale rows, a block's
    unwritten tail) never reaches an output: with the cache filled with NaN before the run,
    every path still gives HF's tokens (such slots are masked, never multiplied in)."""
    from batchjob.backends.native.attention.registry import get_attention_backend

    model, info, prompts, refs = family_model
    monkeypatch.setattr(model, "attn_backend", get_attention_backend(attention, "cpu"))
    engine = Engine(
        model,
        info,
        SchedulerConfig(chunk_size=13),
        EngineConfig(block_size=8, kv_cache_bytes=1 << 22),
    )
    engine.kv_cache.fill_(float("nan"))
    outs = {}
    engine.run(
        prompts,
        build_plan(prompts),
        SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True),
        lambda o: outs.__setitem__(o.position, o.token_ids.tolist()),
    )
    assert [outs[i] for i in range(len(prompts))] == refs


def test_same_seed_same_output_whatever_schedule(family_model):
    model, info, prompts, _ = family_model
    params = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=MAX_TOKENS)
    results = []
    for policy, chunk in (("batchllm", 2048), ("baseline", 11)):
        engine = Engine(
            model,
            info,
            SchedulerConfig(policy=policy, chunk_size=chunk),
            EngineConfig(block_size=8, kv_cache_bytes=256 * 8 * info.kv_bytes_per_token),
        )
        outs = {}
        engine.run(
            prompts,
            build_plan(prompts) if policy == "batchllm" else None,
            params,
            lambda o, outs=outs: outs.__setitem__(o.row_id, o.token_ids.tolist()),
        )
        results.append(outs)
    assert results[0] == results[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_cuda_greedy_equals_cpu_path(tmp_path, attention):
    """The same engine on CUDA (torch path, then the Triton kernels) gives the CPU's tokens."""
    folder = make_tiny_model(tmp_path / "m", family="llama")
    cpu_model, cpu_info = load_model(folder, dtype="float32", device="cpu", attention="torch")
    prompts = shared_prompts(cpu_info.vocab_size, seed=2)
    sched, eng = SchedulerConfig(chunk_size=13), EngineConfig(block_size=16, kv_cache_bytes=1 << 24)
    expected, _, _ = run_engine(cpu_model, cpu_info, prompts, sched, eng, use_plan=True)
    gpu_model, gpu_info = load_model(folder, dtype="float32", device="cuda", attention=attention)
    got, _, _ = run_engine(gpu_model, gpu_info, prompts, sched, eng, use_plan=True)
    assert got == expected


CUDA_ONLY = (
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
)
# Low precision: greedy tokens may differ from float32's where two logits are closer than the
# rounding, so each step is checked against HF float32 on the engine's own sequence: the
# engine's token is HF's argmax up to this log-prob margin, and the engine's log-prob of it is
# within the same margin of HF's (bf16 keeps 8 mantissa bits, fp16 11).
LOGPROB_TOL = {"bfloat16": 0.08, "float16": 0.015}


@pytest.mark.parametrize(
    "device,dtype,family",
    [
        ("cpu", "bfloat16", "llama"),
        ("cpu", "bfloat16", "granite"),  # its multipliers on the C glue's bf16 paths
        ("cpu", "bfloat16", "smollm3"),
        ("cpu", "bfloat16", "olmo2"),  # norms on the branch outputs, scaled in float32
        ("cpu", "bfloat16", "phi3"),  # RoPE on part of each head, in the C pass
        ("cpu", "bfloat16", "gemma3"),  # norms of 1 + w (float32) in C, GELU in oneDNN
        ("cpu", "float16", "llama"),
        pytest.param("cuda", "bfloat16", "llama", marks=CUDA_ONLY),
        pytest.param("cuda", "float16", "llama", marks=CUDA_ONLY),
    ],
)
def test_low_precision_greedy_within_tolerance_of_hf(tmp_path, device, dtype, family):
    """bf16/fp16 engine (the default attention of the device: C kernel on CPU, Triton on
    CUDA) vs HF float32, step by step, on shared-prefix prompts through the plan."""
    folder = make_tiny_model(tmp_path / "m", family=family)
    model, info = load_model(folder, dtype=dtype, device=device, attention="auto")
    prompts = shared_prompts(info.vocab_size, seed=3)
    engine = Engine(
        model,
        info,
        SchedulerConfig(chunk_size=13),
        EngineConfig(block_size=16, kv_cache_bytes=1 << 24),
    )
    outs = {}
    engine.run(
        prompts,
        build_plan(prompts),
        SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
        lambda o: outs.__setitem__(o.position, o),
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tol = LOGPROB_TOL[dtype]
    worst_margin = worst_diff = 0.0
    for i in range(len(prompts)):
        prompt, got = prompts.row(i), outs[i]
        toks = torch.tensor(got.token_ids, dtype=torch.long)
        seq = torch.cat([torch.tensor(prompt, dtype=torch.long), toks])[None]
        with torch.no_grad():
            lp = torch.log_softmax(hf(seq).logits[0, len(prompt) - 1 : -1].double(), dim=-1)
        chosen = lp[torch.arange(len(toks)), toks]
        worst_margin = max(worst_margin, float((lp.max(dim=-1).values - chosen).max()))
        diff = (torch.from_numpy(got.logprobs.logprob) - chosen).abs().max()
        worst_diff = max(worst_diff, float(diff))
    assert worst_margin <= tol, f"a token {worst_margin:.4f} below HF's best (tol {tol})"
    assert worst_diff <= tol, f"log-probs {worst_diff:.4f} from HF's (tol {tol})"
