from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from batchjob.cli import _Group, build_job, main
from batchjob.errors import EXIT_CONFIG, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_MODEL
from batchjob.plan.build import build_plan
from batchjob.plan.plan_io import read_plan
from batchjob.testing.workloads import make_workload
from batchjob.tokenize.batched import load_prompts
from tests.conftest import write_model_folder, write_parquet

ROOT = Path(__file__).resolve().parents[2]


def write_job(tmp_path: Path, data: Path, model: Path | None, extra: str = "") -> Path:
    model_line = f'[model]\npath = "{model}"\n' if model else ""
    job = tmp_path / "job.toml"
    job.write_text(
        f'[input]\npath = "{data}"\nbatch_rows = 64\n{model_line}'
        f'[output]\npath = "out/results.parquet"\n{extra}'
    )
    return job


@pytest.fixture(scope="module")
def case1_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("case1")
    out = {}
    for form in ("ids", "text"):
        t = make_workload("case1", scale=0.05, len_scale=0.05, seed=0, form=form, vocab_size=3000)
        out[form] = write_parquet(t, d / form / "prompts.parquet")
    return out


def invoke(*args: str) -> click.testing.Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("form", ["ids", "text"])
def test_plan_case1_prints_summary_and_writes_plan(
    tmp_path: Path, case1_data: dict[str, Path], tiny_model_dir: Path, form: str
) -> None:
    job = write_job(tmp_path, case1_data[form], tiny_model_dir)
    r = invoke("plan", str(job))
    assert r.exit_code == 0, r.output
    for word in ("requests", "groups", "share degree", "prefix len", "distinct len"):
        assert word in r.stdout
    assert "multi-level" in r.stdout and "single-level plan" in r.stdout
    assert "tok/s" in r.stdout and "KV estimate" in r.stdout
    plan_file = tmp_path / "out" / "results.parquet.meta" / "plan.parquet"  # default: in <meta>
    assert str(plan_file) in r.stdout and plan_file.is_file()

    # round trip: the file holds the plan the planner builds for these prompts
    j = build_job(str(job))
    data, _ = load_prompts(j.input, j.model, j.sampling, "native")
    want = build_plan(data.prompts)
    got = read_plan(plan_file)
    for f in ("group_prefix_len", "group_offsets", "members", "row_ids", "decode_estimate"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    assert got.stats == want.stats


def test_plan_json_numbers(tmp_path: Path, case1_data: dict[str, Path], tiny_model_dir: Path):
    job = write_job(tmp_path, case1_data["ids"], tiny_model_dir)
    out = tmp_path / "elsewhere" / "p.parquet"
    r = invoke("plan", str(job), "--json", "--plan-out", str(out))
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)  # nothing but JSON on stdout
    assert s["requests"] == s["ok"] == 150 and s["rejected"] == {}
    assert sum(s["share_buckets"].values()) == s["groups"]
    assert 4 < s["share_degree"]["mean"] < 10  # case1: ~7 queries per document
    assert 0.3 < s["saving_ratio_single_level"] <= s["saving_ratio_multi_level"] < 0.8
    # Eq. 2 of the single-level plan, recomputed from the plan file
    plan = read_plan(out)
    sizes = np.diff(plan.group_offsets)
    processed = s["logical_prefill_tokens"] - int(((sizes - 1) * plan.group_prefix_len).sum())
    assert s["single_level_prefill_tokens"] == processed
    assert s["saving_ratio_single_level"] == pytest.approx(
        1 - processed / s["logical_prefill_tokens"]
    )
    # KV: 2 * 2 layers * 2 kv heads * 16 dims * 4 bytes (float32 tiny model)
    assert s["kv"]["bytes_per_token"] == 512
    assert s["kv"]["largest_group_bytes"] == 512 * s["kv"]["largest_group_tokens"]
    assert [st["name"] for st in s["stages"]] == ["read", "tokenize", "plan"]
    assert s["stages"][2]["tokens"] == s["logical_prefill_tokens"]
    assert s["plan_path"] == str(out)


def test_plan_overrides_and_rejects(tmp_path: Path, case1_data: dict[str, Path]) -> None:
    # no model: ids work without one; KV says n/a
    job = write_job(tmp_path, case1_data["ids"], None)
    r = invoke("plan", str(job), "--json", "--set", "input.limit=40")
    s = json.loads(r.stdout)
    assert s["requests"] == 40 and s["kv"] is None
    r = invoke("plan", str(job), "--set", "input.limit=40")
    assert "n/a" in r.stdout
    # per-row rejects are counted, not fatal
    t = pa.table({"prompt": pa.array([[5, 6, 7], [], [5, 6, 8], [1] * 9], pa.list_(pa.int32()))})
    data = write_parquet(t, tmp_path / "small.parquet")
    r = invoke("plan", "--input", str(data), "--output", str(tmp_path / "o"), "--json")
    s = json.loads(r.stdout)
    assert s["requests"] == 4 and s["ok"] == 3 and s["rejected"] == {"empty_prompt": 1}
    assert (tmp_path / "o.meta" / "plan.parquet").is_file()
    r = invoke(
        "plan",
        "--input",
        str(data),
        "--output",
        str(tmp_path / "o"),
        "--model",
        str(write_model_folder(tmp_path / "m", None, max_len=8)),
        "--json",
    )
    assert json.loads(r.stdout)["rejected"] == {"empty_prompt": 1, "prompt_too_long": 1}


def test_exit_codes(tmp_path: Path, case1_data: dict[str, Path]) -> None:
    job = write_job(tmp_path, case1_data["ids"], None, "[scheduler]\nchunk_sise = 3\n")
    cases = [
        ((str(job),), EXIT_CONFIG, "scheduler.chunk_sise"),
        ((str(job), "--set", "oops"), EXIT_CONFIG, "--set"),
        (("--input", str(tmp_path / "none.parquet"), "--output", "o"), EXIT_INPUT, "none.parquet"),
        (("--input", str(case1_data["text"]), "--output", "o"), EXIT_MODEL, "model.path"),
        (
            ("--input", str(case1_data["text"]), "--output", "o", "--model", str(tmp_path)),
            EXIT_MODEL,
            "config.json",
        ),
    ]
    for args, code, needle in cases:
        r = invoke("plan", *args)
        assert r.exit_code == code, (args, r.output)
        assert r.stderr.startswith("error: ") and needle in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_keyboard_interrupt_exits_130() -> None:
    @click.group(cls=_Group)
    def grp() -> None:
        pass

    @grp.command()
    def boom() -> None:
        raise KeyboardInterrupt

    r = CliRunner().invoke(grp, ["boom"])
    assert r.exit_code == EXIT_INTERRUPTED and "interrupted" in r.stderr


def test_console_entry_point_exit_code(tmp_path: Path) -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchjob.cli",
            "plan",
            "--input",
            str(tmp_path / "x.parquet"),
            "--output",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == EXIT_INPUT and p.stderr.startswith("error: ") and p.stdout == ""


def test_scheduler_glue_files() -> None:
    dag = (ROOT / "jobs" / "airflow_dag.py").read_text()
    ast.parse(dag)
    assert "BashOperator" in dag and "batchjob run" in dag.replace("{BATCHJOB} run", "batchjob run")
    cron = (ROOT / "jobs" / "crontab.example").read_text()
    assert "batchjob run jobs/case1.toml" in cron
