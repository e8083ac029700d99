"""Log-probabilities and scoring mode against Hugging Face transformers' logits.

``sampling.logprobs``: each generated token's log-prob and the top-N equal the float32
log-softmax of HF's logits at that step. Scoring: each label's log-prob equals the sum of HF's
log-softmax over its tokens, teacher-forced after the prompt, for single- and multi-token
labels (shared first tokens, different lengths), per-row labels, with the input's own
prefix-sharing plan (multi-token labels keep it: one request per row), tiny chunks, both
scheduling policies and a KV budget small enough to preempt rows in the middle of their labels.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from batchjob.backends.native.engine import Engine
from batchjob.backends.native.models.loader import load_model
from batchjob.backends.scoring import RowScores, _trie, row_tries
from batchjob.config import EngineConfig, SamplingConfig, SchedulerConfig
from batchjob.inputs.row_settings import RowSettings
from batchjob.plan.build import build_plan
from batchjob.testing.tiny_model import make_tiny_model
from batchjob.tokenize.prompts import TokenizedPrompts

transformers = pytest.importorskip("transformers")

N_TOKENS = 6
TOP_N = 5


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param)
    model, info = load_model(folder, dtype="float32", device="cpu", attention="torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, info, hf


def prompts_with_sharing(vocab: int, seed: int = 3) -> TokenizedPrompts:
    rng = np.random.default_rng(seed)
    doc = rng.integers(5, vocab, 29)
    seqs = [np.concatenate([doc, rng.integers(5, vocab, rng.integers(1, 9))]) for _ in range(4)]
    seqs += [rng.integers(5, vocab, n) for n in (17, 3)]
    return TokenizedPrompts.from_lists(seqs, max_tokens=N_TOKENS)


def hf_logsoftmax(hf, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), V]: log-softmax of HF's logits at every position."""
    with torch.no_grad():
        logits = hf(torch.tensor(ids, dtype=torch.long)[None]).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def engine(model, info, chunk: int = 2048) -> Engine:
    return Engine(model, info, SchedulerConfig(chunk_size=chunk), EngineConfig(block_size=16))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_hf(models, temperature):
    model, info, hf = models
    prompts = prompts_with_sharing(info.vocab_size)
    outs = {}
    sampling = SamplingConfig(
        max_tokens=N_TOKENS, ignore_eos=True, logprobs=TOP_N, temperature=temperature, seed=7
    )
    engine(model, info).run(
        prompts, build_plan(prompts), sampling, lambda o: outs.__setitem__(o.position, o)
    )
    for i in range(len(prompts)):
        o = outs[i]
        toks = o.token_ids.tolist()
        assert o.logprobs is not None and len(o.logprobs.logprob) == len(toks) == N_TOKENS
        assert o.logprobs.top_ids.shape == (N_TOKENS, TOP_N)
        ref = hf_logsoftmax(hf, prompts.row(i).tolist() + toks)
        p = len(prompts.row(i))
        for s, tok in enumerate(toks):
            row = ref[p - 1 + s]  # predicts generated token s
            assert o.logprobs.logprob[s] == pytest.approx(float(row[tok]), abs=2e-4)
            top = row.topk(TOP_N)
            np.testing.assert_allclose(o.logprobs.top_logprobs[s], top.values.numpy(), atol=2e-4)
            # ids agree wherever the values are not (near-)tied
            gaps = np.diff(top.values.numpy())
            if np.all(np.abs(gaps) > 1e-4):
                assert o.logprobs.top_ids[s].tolist() == top.indices.tolist()
        if temperature == 0.0:
            assert all(o.logprobs.logprob[s] == o.logprobs.top_logprobs[s, 0] for s in range(6))


def test_logprobs_zero_is_chosen_only(models):
    model, info, _ = models
    prompts = prompts_with_sharing(info.vocab_size)
    outs = {}
    engine(model, info).run(
        prompts,
        None,
        SamplingConfig(max_tokens=3, ignore_eos=True, logprobs=0),
        lambda o: outs.__setitem__(o.position, o),
    )
    assert outs[0].logprobs.top_ids.shape == (N_TOKENS, 0)  # the rows' own max_tokens
    assert np.all(outs[0].logprobs.logprob <= 0)


def with_labels(prompts: TokenizedPrompts, labels: list[list[list[int]]]) -> TokenizedPrompts:
    """``prompts`` with row i's labels ``labels[i]`` (token ids; texts "L0", "L1", ...) and
    max_tokens = its longest label, as ``load_prompts`` sets them."""
    settings = RowSettings(
        row_ids=prompts.row_ids,
        labels=tuple(tuple(f"L{j}" for j in range(len(lab))) for lab in labels),
        label_tokens=tuple(tuple(np.asarray(t, dtype=np.int32) for t in lab) for lab in labels),
    )
    longest = np.asarray([max(map(len, lab)) for lab in labels], dtype=np.int32)
    return dataclasses.replace(prompts, settings=settings, max_tokens=longest)


def score(
    model,
    info,
    prompts: TokenizedPrompts,
    labels: list[list[int]] | list[list[list[int]]],
    chunk: int,
    policy: str = "batchllm",
    kv_blocks: int | None = None,
    decode_reserve: bool = True,
    kv_threshold: float = 0.95,
):
    """Run scoring as the native backend does; ``labels``: one list for every row, or one
    per row. ``kv_blocks``: the KV budget in blocks of 16 tokens (default: 2 GiB)."""
    per_row = labels if isinstance(labels[0][0], list) else [labels] * len(prompts)
    prompts = with_labels(prompts, per_row)  # type: ignore[arg-type]
    tries, names = row_tries(prompts)
    got = {}
    scores = RowScores(tries, names, prompts.row_ids, lambda o: got.__setitem__(o.position, o))
    kv_bytes = None if kv_blocks is None else kv_blocks * 16 * info.kv_bytes_per_token
    eng = Engine(
        model,
        info,
        SchedulerConfig(
            chunk_size=chunk,
            policy=policy,
            decode_reserve=decode_reserve,
            kv_threshold=kv_threshold,
        ),
        EngineConfig(block_size=16, kv_cache_bytes=kv_bytes),
    )
    plan = build_plan(prompts)
    run = eng.score(prompts, plan, [t.steps for t in tries], scores)
    return [got[i] for i in range(len(prompts))], plan, run


def hf_label_logprobs(hf, prompt: list[int], labels: list[list[int]]) -> list[float]:
    """Teacher-forced: the sum of HF's log-softmax over each label's tokens after the prompt."""
    want = []
    for t in labels:
        ref = hf_logsoftmax(hf, prompt + t)
        want.append(sum(float(ref[len(prompt) - 1 + k, tok]) for k, tok in enumerate(t)))
    return want


def trie_nodes(labels: list[list[int]]) -> set[tuple[int, ...]]:
    """The label-trie nodes with children: each costs one scored position."""
    return {tuple(t[:k]) for t in labels for k in range(len(t))}


MULTI = [[11, 30, 31], [11, 30, 9], [12], [40, 41], [11, 5, 6, 7, 8]]


@pytest.mark.parametrize("policy", ["batchllm", "baseline"])
@pytest.mark.parametrize("chunk", [2048, 7])
@pytest.mark.parametrize(
    "labels",
    [
        [[11], [12], [40]],  # single-token: the prompt's last logits only
        MULTI,  # multi-token, shared first tokens, lengths 1 to 5
    ],
)
def test_label_logprobs_match_hf(models, labels, chunk, policy):
    model, info, hf = models
    prompts = prompts_with_sharing(info.vocab_size)
    outs, plan, run = score(model, info, prompts, labels, chunk, policy)
    for i, o in enumerate(outs):
        want = hf_label_logprobs(hf, prompts.row(i).tolist(), labels)
        np.testing.assert_allclose(o.label_logprobs, want, atol=3e-4)
        assert o.label == f"L{int(np.argmax(want))}"
        assert o.finish_reason == "score" and len(o.token_ids) == 0
    s = run.scheduler
    assert s.decode_tokens == 0 and s.preemptions == 0
    if policy == "batchllm":  # the input's plan as is + one token per non-root trie node
        extra = len(trie_nodes(labels)) - 1
        assert s.prefill_tokens == plan.stats.single_level_prefill_tokens + extra * len(prompts)


def test_per_row_labels_in_shared_groups(models):
    """Each row its own labels (some sharing first tokens, of different lengths), the rows in
    groups sharing a 29-token prefix: still one request per row on the input's plan."""
    model, info, hf = models
    prompts = prompts_with_sharing(info.vocab_size)
    per_row = [
        [[11, 30, 31], [11, 30, 9], [12]],
        [[7]],
        [[40, 41, 42, 43], [40, 41], [40, 9]],
        [[11], [12, 13]],
        MULTI,
        [[5, 6], [6, 5]],
    ]
    outs, plan, run = score(model, info, prompts, per_row, 2048)
    assert plan.num_groups < len(prompts)  # some rows share a prefix
    for i, o in enumerate(outs):
        want = hf_label_logprobs(hf, prompts.row(i).tolist(), per_row[i])
        np.testing.assert_allclose(o.label_logprobs, want, atol=3e-4)
        assert o.label == f"L{int(np.argmax(want))}"
    extra = sum(len(trie_nodes(lab)) - 1 for lab in per_row)
    assert run.scheduler.prefill_tokens == plan.stats.single_level_prefill_tokens + extra


@pytest.mark.parametrize("policy", ["batchllm", "baseline"])
def test_scoring_preempted_mid_labels_matches_hf(models, policy):
    """A KV budget of 8 blocks of 16 tokens, rows of a shared 16-token block + 10 own tokens,
    labels whose first step (with the prompt) fits the row's first own block and whose second
    step (12 tokens, after a rewind) needs one more; rows admitted on the blocks in use up to
    the last one (batchllm without its decode reserve and with kv_threshold 1: otherwise it
    waits for blocks instead): rows are preempted in their second step and recompute the
    prompt and that step's path; every score still equals HF's."""
    model, info, hf = models
    rng = np.random.default_rng(5)
    doc = rng.integers(5, info.vocab_size, 16)
    seqs = [np.concatenate([doc, rng.integers(5, info.vocab_size, 10)]) for _ in range(10)]
    prompts = TokenizedPrompts.from_lists(seqs, max_tokens=1)
    labels = [[11, 20], [11, 21], list(range(12, 24))]
    outs, _, run = score(model, info, prompts, labels, 2048, policy, 8, False, kv_threshold=1.0)
    assert run.scheduler.preemptions > 0 and run.scheduler.recomputed_tokens > 0
    for i, o in enumerate(outs):
        want = hf_label_logprobs(hf, prompts.row(i).tolist(), labels)
        np.testing.assert_allclose(o.label_logprobs, want, atol=3e-4)


def test_single_token_labels_cost_one_prefill(models):
    """Single-token labels: the prompts' own prefill on the input's plan, nothing more."""
    model, info, _ = models
    prompts = prompts_with_sharing(info.vocab_size)
    _, plan, run = score(model, info, prompts, [[11], [12]], 2048)
    assert run.scheduler.decode_tokens == 0
    assert run.scheduler.prefill_tokens == plan.stats.single_level_prefill_tokens
    assert plan.stats.single_level_prefill_tokens < plan.stats.logical_prefill_tokens


@pytest.mark.parametrize("seed", range(20))
def test_trie_steps_visit_every_node_once_on_held_kv(seed):
    """The teacher-forced walk: each trie node with children is scored exactly once, at the
    token that ends its prefix, and every step starts from a branch point whose tokens the
    sequence still holds (a prefix of the previous step's path)."""
    rng = np.random.default_rng(seed)
    labels = list({tuple(rng.integers(1, 4, int(rng.integers(1, 6))).tolist()) for _ in range(8)})
    trie = _trie(tuple(np.asarray(t, np.int32) for t in labels))
    seen = [0]  # the root: the prompt's last token
    held: tuple[int, ...] = ()
    for base, path, nodes in trie.steps:
        p = tuple(path.tolist())
        assert base <= len(held) and p[:base] == held[:base] and len(nodes) == len(p) - base
        for j, node in enumerate(nodes.tolist(), start=base):
            assert trie.prefixes[node] == p[: j + 1]
            seen.append(node)
        held = p
    assert sorted(seen) == list(range(len(trie.prefixes)))


@pytest.mark.parametrize("top_n", [0, 3])
def test_token_logprobs_in_row_slices_equal_one_pass(top_n):
    """A few rows at a time (the memory bound for long prompt log-probs) gives the one-pass
    log-softmax's values, ids and order."""
    from batchjob.backends.native.sampling import token_logprobs

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 50, generator=g) * 4
    tokens = torch.randint(0, 50, (37,), generator=g)
    lp = torch.log_softmax(logits, dim=-1)
    for slice_bytes in (4 * 50 * 4, 1, 1 << 28):  # 4 rows, 1 row, all rows at once
        chosen, ids, vals = token_logprobs(logits, tokens, top_n, slice_bytes=slice_bytes)
        torch.testing.assert_close(chosen, lp.gather(1, tokens[:, None]).squeeze(1))
        assert ids.shape == vals.shape == (37, top_n) and ids.dtype == torch.int32
        if top_n:
            top = lp.topk(top_n, dim=-1, sorted=True)
            assert torch.equal(ids, top.indices.int())
            torch.testing.assert_close(vals, top.values)
