"""`batchjob plan` over scheduler.plan_memory: streamed in partitions, the same plan file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.plan.plan_io import read_plan
from batchjob.testing.workloads import make_workload
from tests.conftest import write_parquet

DIFFERS = {"stages", "plan_path", "partitions", "multi_level_prefill_tokens"}
DIFFERS |= {"saving_ratio_multi_level"}  # a prefix shared across partitions: once per partition


def plan(tmp_path: Path, data: Path, model: Path, name: str, *sets: str) -> dict:
    out = tmp_path / name / "p.parquet"
    args = ["plan", "--input", str(data), "--model", str(model), "--output", str(tmp_path / name)]
    args += ["--plan-out", str(out), "--json", "--set", "input.batch_rows=50"]
    for s in sets:
        args += ["--set", s]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def text_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    t = make_workload("case1", scale=0.1, len_scale=0.05, form="text", vocab_size=3000)
    prompts = t.column("prompt").to_pylist()
    prompts[7] = "   "  # rejected: empty_prompt
    t = t.set_column(t.schema.get_field_index("prompt"), "prompt", pa.array(prompts))
    return write_parquet(t, tmp_path_factory.mktemp("text") / "prompts.parquet")


def test_plan_in_partitions_writes_the_in_memory_plan(
    tmp_path: Path, text_data: Path, tiny_model_dir: Path
) -> None:
    mem = plan(tmp_path, text_data, tiny_model_dir, "mem")
    part = plan(tmp_path, text_data, tiny_model_dir, "part", "scheduler.plan_memory=64KiB")
    assert "partitions" not in mem
    assert part["partitions"]["count"] > 1 and part["partitions"]["budget"] == 64 << 10
    assert part["rejected"] == mem["rejected"] == {"empty_prompt": 1}
    assert {k: v for k, v in part.items() if k not in DIFFERS} == {
        k: v for k, v in mem.items() if k not in DIFFERS
    }
    assert part["saving_ratio_multi_level"] <= mem["saving_ratio_multi_level"]
    a, b = read_plan(tmp_path / "mem" / "p.parquet"), read_plan(tmp_path / "part" / "p.parquet")
    for f in ("group_prefix_len", "group_offsets", "members", "row_ids", "decode_estimate"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert not list((tmp_path / "part.meta").glob(".plan-spill-*"))  # work files removed


@pytest.mark.parametrize(
    ("setting", "samples"),
    [
        ("sampling.n=2", 2),
        ("input.seed_column=request_id", 1),
        ("input.n_column=doc_id", None),
        ('sampling.labels=[" yes", " no"]', 1),
    ],
)
def test_jobs_of_samples_settings_and_labels_plan_in_partitions(
    tmp_path: Path, text_data: Path, tiny_model_dir: Path, setting: str, samples: int | None
) -> None:
    """Samples of a row, per-row settings and labels: spilled with the rows, each partition's
    rows expanded into their requests; the plan file is the in-memory plan's."""
    mem = plan(tmp_path, text_data, tiny_model_dir, "mem", setting)
    part = plan(tmp_path, text_data, tiny_model_dir, "part", "scheduler.plan_memory=64KiB", setting)
    assert "partitions" not in mem and part["partitions"]["count"] > 1
    if samples is not None:
        assert part["ok"] == samples * (pq.read_metadata(text_data).num_rows - 1)
    assert {k: v for k, v in part.items() if k not in DIFFERS} == {
        k: v for k, v in mem.items() if k not in DIFFERS
    }
    a, b = read_plan(tmp_path / "mem" / "p.parquet"), read_plan(tmp_path / "part" / "p.parquet")
    for f in ("group_prefix_len", "group_offsets", "members", "row_ids", "decode_estimate"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
