"""The piecewise CUDA-graph forward (``models.cuda_graphs``): buckets, padding and the cut at
attention. On the CPU the pieces run eagerly on the same padded static buffers
(``capture=False``); on a GPU the same engine runs capture and replay real graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchjob.backends.native.engine import Engine, graphed_forward
from batchjob.backends.native.models.cuda_graphs import (
    PiecewiseForward,
    bucket_for,
    capture_sizes,
)
from batchjob.backends.native.models.loader import load_model
from batchjob.backends.native.models.rope import RopeTable
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig
from batchjob.errors import ConfigError
from batchjob.plan.build import build_plan
from batchjob.testing.tiny_model import make_tiny_model
from batchjob.tokenize.prompts import TokenizedPrompts

MAX_TOKENS = 8


def test_capture_sizes_pad_little_and_end_at_the_limit():
    assert capture_sizes(0) == ()
    assert capture_sizes(1) == (1,)
    assert capture_sizes(12) == (1, 2, 4, 8, 12)
    sizes = capture_sizes(512)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 512
    assert list(sizes) == sorted(set(sizes))
    assert capture_sizes(1000)[-1] == 1000
    for t in range(9, 1001):  # past 8 tokens a batch pads by at most an eighth
        b = bucket_for(capture_sizes(1000), t)
        assert b is not None and t <= b <= t + max(8, t // 8)
    with pytest.raises(ValueError):
        capture_sizes(-1)


def test_bucket_for_is_the_smallest_size_holding_the_batch():
    sizes = capture_sizes(300)
    for t in range(0, 310):
        want = min((s for s in sizes if s >= t), default=None) if t > 0 else None
        assert bucket_for(sizes, t) == want


def test_cuda_graph_max_tokens_is_checked_and_ignored_on_the_cpu(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.cuda_graph_max_tokens"):
        EngineConfig(cuda_graph_max_tokens=-1)
    folder = make_tiny_model(tmp_path / "m")
    model, info = load_model(folder, dtype="float32", device="cpu", attention="torch")
    engine = Engine(model, info, SchedulerConfig(), EngineConfig(kv_cache_bytes=1 << 22))
    assert engine.forward is model
    assert graphed_forward(model, info, EngineConfig(cuda_graph_max_tokens=64), engine.kv) is model


def prompts_with_groups(vocab: int, seed: int) -> TokenizedPrompts:
    """Two documents asked several questions each and unrelated rows: batches of 1 to ~40
    tokens (decode steps, prefill chunks), some above the bucket limit used below."""
    rng = np.random.default_rng(seed)
    seqs = []
    for doc_len, members in ((29, 5), (17, 4)):
        doc = rng.integers(5, vocab, doc_len)
        seqs += [
            np.concatenate([doc, rng.integers(5, vocab, rng.integers(1, 9))])
            for _ in range(members)
        ]
    seqs += [rng.integers(5, vocab, n) for n in (19, 6, 1)]
    return TokenizedPrompts.from_lists(
        [seqs[i] for i in rng.permutation(len(seqs))], max_tokens=MAX_TOKENS
    )


def run(engine: Engine, prompts: TokenizedPrompts) -> list[list[int]]:
    outs: dict[int, list[int]] = {}
    engine.run(
        prompts,
        build_plan(prompts),
        SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True),
        lambda o: outs.__setitem__(o.position, o.token_ids.tolist()),
    )
    return [outs[i] for i in range(len(prompts))]


def engine_for(model, info, chunk: int) -> Engine:
    cfg = EngineConfig(block_size=8, kv_cache_bytes=256 * 8 * info.kv_bytes_per_token)
    return Engine(model, info, SchedulerConfig(chunk_size=chunk), cfg)


@pytest.fixture(scope="module", params=["llama", "qwen3"])  # qwen3: q/k norms written back
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(
        tmp_path_factory.mktemp(request.param), family=request.param, heads=4, kv_heads=2
    )
    return load_model(folder, dtype="float32", device="cpu", attention="cpu")


@pytest.mark.parametrize("chunk", [13, 2048])
def test_piecewise_engine_run_equals_the_eager_one(tiny, chunk):
    """Batches of up to 16 tokens run as pieces in buckets (rows padded), larger ones eagerly:
    the greedy tokens are the eager forward's, on decode steps and prefill chunks."""
    model, info = tiny
    prompts = prompts_with_groups(info.vocab_size, seed=4)
    want = run(engine_for(model, info, chunk), prompts)
    engine = engine_for(model, info, chunk)
    pieces = PiecewiseForward(model, 16, max_position=info.max_position, capture=False)
    engine.forward = pieces
    assert run(engine, prompts) == want
    assert pieces.captured, "no batch ran as pieces"
    assert len(set(pieces.captured)) == len(pieces.captured), "a bucket was built twice"
    assert all(b in capture_sizes(16) for b in pieces.captured)


def test_piecewise_logits_equal_eager_whatever_the_padding_rows_hold(tiny):
    """One batch's logits through a bucket larger than it, after a larger batch left its rows
    in the padding, equal the eager forward's."""
    model, info = tiny
    prompts = prompts_with_groups(info.vocab_size, seed=5)
    engine = engine_for(model, info, 2048)
    batches = []
    engine.forward = lambda *a: batches.append(a) or model(*a)  # record the real batches
    run(engine, prompts)
    pieces = PiecewiseForward(model, 64, max_position=info.max_position, capture=False)
    big = max(batches, key=lambda a: a[0].shape[0])
    small = [a for a in batches if a[0].shape[0] not in pieces.sizes]
    decode = min(small, key=lambda a: a[0].shape[0])  # a decode step between two buckets
    pieces(*big)  # its rows stay in the static buffers
    got = pieces(*decode)
    assert bucket_for(pieces.sizes, decode[0].shape[0]) > decode[0].shape[0]
    torch.testing.assert_close(got, model(*decode), rtol=1e-5, atol=1e-5)


def test_a_regrown_rope_table_drops_the_pieces(tiny):
    """Captured graphs hold the RoPE table's address: a new table means new pieces."""
    model, info = tiny
    prompts = prompts_with_groups(info.vocab_size, seed=6)
    engine = engine_for(model, info, 2048)
    pieces = PiecewiseForward(model, 64, max_position=info.max_position, capture=False)
    engine.forward = pieces
    run(engine, prompts)
    before = len(pieces.captured)
    model.rope = RopeTable(model.rope.dtype)  # as if the table had been rebuilt
    run(engine, prompts)
    assert len(pieces.captured) > before
    assert model.rope.cos.shape[0] >= info.max_position


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_cuda_graphs_give_the_eager_tokens(tmp_path, attention):
    """On a GPU, float32: captured and replayed pieces (cuda_graph_max_tokens = 512) against
    the eager forward (unset), same model, same plan, same tokens."""
    folder = make_tiny_model(tmp_path / "m", family="llama")
    model, info = load_model(folder, dtype="float32", device="cuda", attention=attention)
    prompts = prompts_with_groups(info.vocab_size, seed=7)
    outs = []
    for limit in (None, 512):  # unset: eager
        cfg = EngineConfig(block_size=16, kv_cache_bytes=1 << 24, cuda_graph_max_tokens=limit)
        engine = Engine(model, info, SchedulerConfig(chunk_size=13), cfg)
        assert isinstance(engine.forward, PiecewiseForward) == (limit == 512)
        outs.append(run(engine, prompts))
    assert outs[0] == outs[1]
    assert isinstance(engine.forward, PiecewiseForward) and engine.forward.captured


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graph_logits_equal_eager_in_half_precision(tmp_path, dtype):
    """On a GPU: one decode batch's logits through a captured bucket larger than it (after a
    larger batch) against the eager forward, within half-precision rounding."""
    folder = make_tiny_model(tmp_path / "m", family="qwen3")
    model, info = load_model(folder, dtype=dtype, device="cuda", attention="auto")
    prompts = prompts_with_groups(info.vocab_size, seed=8)
    engine = engine_for(model, info, 2048)
    batches = []
    engine.forward = lambda *a: batches.append(a) or model(*a)
    run(engine, prompts)
    pieces = PiecewiseForward(model, 64, max_position=info.max_position)
    big = max(batches, key=lambda a: a[0].shape[0])
    decode = min(
        (a for a in batches if a[0].shape[0] not in pieces.sizes), key=lambda a: a[0].shape[0]
    )
    pieces(*big)
    got = pieces(*decode)
    assert pieces.captured
    torch.testing.assert_close(got, model(*decode), rtol=3e-2, atol=3e-2)
