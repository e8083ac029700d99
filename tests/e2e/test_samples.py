"""``n`` samples per prompt on the native engine: one result row per (row, sample), the
samples planned as sharing their prompt, greedy samples equal, seeded samples reproducible
across runs and across a kill -9 + rerun, per-row ``n`` with bad values as row statuses."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchjob
from batchjob.config import InputConfig, ModelConfig, SamplingConfig
from batchjob.plan.build import build_plan
from batchjob.runner.execute import job_samples
from batchjob.tokenize.batched import load_prompts
from batchjob.tokenize.samples import expand_samples
from tests.e2e.jobkit import cli, killed_run, write_job

COLS = ["row_id", "sample_index", "output_token_ids", "finish_reason", "status"]


def _run(tmp: Path, model: Path, data: Path, name: str, *sets: str) -> tuple[pa.Table, dict]:
    out = tmp / name
    job = write_job(tmp, model, data, out, flush_rows="3")
    res = cli("run", job, "--no-progress", *(a for s in sets for a in ("--set", s)))
    assert res.exit_code == 0, res.output
    report = json.loads((tmp / f"{name}.meta" / "report.json").read_text())
    return pq.read_table(out), report


def test_greedy_samples_share_the_prompt_and_equal_n1(tmp_path, run_model, run_data):
    one, rep1 = _run(tmp_path, run_model, run_data, "n1")
    eight, rep8 = _run(tmp_path, run_model, run_data, "n8", "sampling.n=8")
    rows = one.num_rows
    assert eight.num_rows == 8 * rows
    assert eight.column_names[:2] == ["row_id", "sample_index"]
    assert eight["row_id"].to_pylist() == [r for r in range(rows) for _ in range(8)]
    assert eight["sample_index"].to_pylist() == list(range(8)) * rows
    # every pass-through column repeated for each sample of its row
    assert eight["request_id"].to_pylist() == [
        r for r in one["request_id"].to_pylist() for _ in range(8)
    ]
    tokens = eight["output_token_ids"].to_pylist()
    for r, want in enumerate(one["output_token_ids"].to_pylist()):
        assert tokens[8 * r : 8 * r + 8] == [want] * 8  # greedy: all samples = n = 1
    # what ran is what the plan of the samples says: the best single-level grouping, at
    # least as good as (a) the n = 1 groups with each row's samples as extra members and (b)
    # each row's samples as one group (its prompt once, one last token per other sample)
    inp = InputConfig(path=str(run_data))
    sampling = SamplingConfig(max_tokens=6, n=8)
    loaded, _ = load_prompts(inp, ModelConfig(path=run_model), sampling, "native")
    plan = build_plan(expand_samples(loaded.prompts, *job_samples(sampling, inp)))
    assert rep8["computed_prefill_tokens"] == plan.stats.single_level_prefill_tokens
    assert rep8["saving_ratio_achieved"] == pytest.approx(plan.stats.saving_ratio_single_level)
    assert rep8["prompt_tokens"] == 8 * rep1["prompt_tokens"]
    plan1 = build_plan(loaded.prompts)
    own = loaded.prompts.lengths - np.repeat(plan1.group_prefix_len, np.diff(plan1.group_offsets))
    grouped_as_n1 = rep1["computed_prefill_tokens"] + 7 * int(own.sum())
    row_groups = rep1["prompt_tokens"] + 7 * rows
    assert rep8["computed_prefill_tokens"] <= min(grouped_as_n1, row_groups)
    # in fact the rows' plan, each further sample computing only its last prompt token (it
    # copies the rest of its own prompt KV from the row's first sample)
    assert rep8["computed_prefill_tokens"] == rep1["computed_prefill_tokens"] + 7 * rows


def test_distinct_prompts_are_computed_once_for_all_samples(tmp_path, run_model):
    data = tmp_path / "distinct.parquet"
    rng = np.random.default_rng(0)
    prompts = [  # no two share a first token: nothing to share but within a row
        [10 + i, *rng.integers(3, 2000, size=int(rng.integers(5, 40))).tolist()] for i in range(12)
    ]
    pq.write_table(pa.table({"prompt": pa.array(prompts, pa.list_(pa.int32()))}), data)
    _, rep = _run(tmp_path, run_model, data, "d", "sampling.n=5")
    # one prompt computed once: its tokens, plus the last token of each of 4 more samples
    assert rep["computed_prefill_tokens"] == sum(map(len, prompts)) + 4 * len(prompts)


def _killed(job: Path, point: str, *sets: str) -> int:
    return killed_run(job, *[a for s in sets for a in ("--set", s)], spec=point).returncode


def test_seeded_samples_reproduce_across_runs_and_a_kill(tmp_path, run_model, run_data):
    sets = ("sampling.n=4", "sampling.temperature=1.0", "sampling.seed=7")
    a, _ = _run(tmp_path, run_model, run_data, "a", *sets)
    b, _ = _run(tmp_path, run_model, run_data, "b", *sets)
    assert a.select(COLS).equals(b.select(COLS))
    per_row = a["output_token_ids"].to_pylist()
    distinct = [len({tuple(t) for t in per_row[i : i + 4]}) for i in range(0, len(per_row), 4)]
    assert max(distinct) > 1  # the samples of a row are drawn independently
    one, _ = _run(
        tmp_path, run_model, run_data, "one", "sampling.temperature=1.0", "sampling.seed=7"
    )
    first = a.filter(pa.compute.equal(a["sample_index"], 0))
    assert first["output_token_ids"].equals(one["output_token_ids"])  # sample 0 = n 1
    out = tmp_path / "killed"
    job = write_job(tmp_path, run_model, run_data, out, flush_rows="3")
    sets_small = (*sets, "scheduler.chunk_size=16")
    assert _killed(job, "part:3", *sets_small) == -signal.SIGKILL
    parts = sorted((tmp_path / "killed.meta" / "parts").glob("part-*.parquet"))
    done = pa.concat_tables([pq.read_table(p) for p in parts])
    assert 0 < done.num_rows < a.num_rows  # some samples written, others left to the rerun
    res = cli("run", job, "--no-progress", *(x for s in sets for x in ("--set", s)))
    assert res.exit_code == 0, res.output
    got = pq.read_table(out)
    assert got.select(COLS).equals(a.select(COLS))


def test_per_row_n_and_bad_values(tmp_path, run_model):
    data = tmp_path / "rows.parquet"
    n = pa.array([1, 3, None, 0, 70000, 2], pa.int64())
    prompts = ["babu bado kima", "kima babu", "bado bado", "babu", "kima kima", "babu kima"]
    pq.write_table(pa.table({"prompt": prompts, "n": n}), data)
    out = tmp_path / "out.parquet"
    job = write_job(tmp_path, run_model, data, out)
    res = cli("run", job, "--no-progress", "--set", "input.n_column=n", "--set", "sampling.n=2")
    assert res.exit_code == 0, res.output
    t = pq.read_table(out)
    rows = t["row_id"].to_pylist()
    assert [rows.count(r) for r in range(6)] == [1, 3, 2, 1, 1, 2]  # null: the job's n = 2
    status = dict(zip(rows, t["status"].to_pylist(), strict=True))
    assert status[3] == status[4] == "invalid_n"
    bad = t.filter(pa.compute.equal(t["status"], "invalid_n"))
    assert bad["sample_index"].null_count == 2  # a rejected row: one result, no sample
    assert (
        "input.n_column" in bad["message"][0].as_py() and "[1, 65536]" in bad["message"][0].as_py()
    )


@pytest.mark.parametrize(
    "sets,key",
    [
        (["sampling.n=0"], "sampling.n"),
        (["sampling.n=65537"], "sampling.n"),
        (["sampling.n=2", 'sampling.labels=["a","b"]'], "sampling.n"),
    ],
)
def test_bad_n_is_a_config_error(tmp_path, run_model, run_data, sets, key):
    job = write_job(tmp_path, run_model, run_data, tmp_path / "o.parquet")
    res = cli("run", job, *(a for s in sets for a in ("--set", s)))
    assert res.exit_code == 3 and key in res.output, res.output


def test_generate_returns_every_sample(run_model):
    got = batchjob.generate(
        ["babu bado", "kima"],
        model={"path": run_model, "device": "cpu"},
        sampling={"n": 3, "max_tokens": 4},
        engine={"threads": 1, "kv_cache_bytes": "8MiB"},
    )
    assert got["row_id"].to_pylist() == [0, 0, 0, 1, 1, 1]
    assert got["sample_index"].to_pylist() == [0, 1, 2] * 2
    ids = got["output_token_ids"].to_pylist()
    assert ids[0] == ids[1] == ids[2] and ids[3] == ids[4] == ids[5]  # greedy
    assert np.all(np.asarray(got["status"].to_pylist()) == "ok")


def test_plan_and_run_agree_on_the_computed_prompt_tokens_with_n_4(tmp_path, run_model, run_data):
    """``batchjob plan`` plans what ``batchjob run`` runs (one prepare step): with
    ``sampling.n = 4`` both count every row's 4 samples, and the prompt tokens the plan says
    will be computed are the ones the run computed."""
    job = write_job(tmp_path, run_model, run_data, tmp_path / "n4")
    n4 = ("--set", "sampling.n=4")
    planned = cli("plan", job, "--json", *n4)
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.stdout)
    ran = cli("run", job, "--json", "--no-progress", *n4)
    assert ran.exit_code == 0, ran.output
    run = json.loads(ran.stdout)
    rows = len(pq.read_table(run_data))
    assert plan["ok"] == run["requests_run"] == 4 * rows
    assert plan["logical_prefill_tokens"] == run["prompt_tokens"]
    assert run["recomputed_tokens"] == 0
    assert plan["single_level_prefill_tokens"] == run["computed_prefill_tokens"]
