"""First-use kernel calibration is reported apart from the throughput.

A job on a CPU whose calibration cache is empty measures its linear layers at load and its
attention classes on first use; the report's ``stage_s.calibration_s`` states both, and
``run_s`` (the engine's time, which the per-second figures divide by) excludes the part spent
inside the loop. A later job reads the decisions from the cache: no calibration.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.backends.native.attention import calibrate as calib
from batchjob.backends.native.models import cpu_linear
from batchjob.cli import main
from batchjob.kernels.cpu import build
from batchjob.testing.tiny_model import make_tiny_model
from batchjob.testing.workloads import make_workload


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", vocab_size=300, layers=2)


def _job(tmp: Path, model: Path, data: Path, out: str) -> Path:
    job = tmp / f"{out}.toml"
    job.write_text(
        f'[input]\npath = "{data}"\n[model]\npath = "{model}"\ndevice = "cpu"\n'
        "[sampling]\nmax_tokens = 4\n[scheduler]\nchunk_size = 64\n"
        f'[engine]\nkv_cache_bytes = "8MiB"\n[output]\npath = "{tmp / out}.parquet"\n'
    )
    return job


def test_calibration_seconds_reported_apart_from_the_run(tmp_path, model_dir, monkeypatch):
    if build.load_kernel() is None:
        pytest.skip("the C kernels did not build: nothing is calibrated")
    monkeypatch.setenv("BATCHJOB_KERNEL_CACHE", str(tmp_path / "cache"))  # an empty cache
    monkeypatch.setenv("BATCHJOB_CPU_CALIBRATE", "1")
    monkeypatch.setattr(calib, "_CALIBRATIONS", {})
    monkeypatch.setattr(cpu_linear, "flush_bytes", lambda: 1 << 20)  # all within the budget
    table = make_workload(
        "case1", scale=0.01, len_scale=0.05, seed=1, form="ids", vocab_size=300, vocab_lo=10
    )
    data = tmp_path / "prompts.parquet"
    pq.write_table(table, data)
    reports = []
    for out in ("first", "second", "third", "fourth"):  # a loaded machine may spend the
        res = CliRunner().invoke(main, ["run", str(_job(tmp_path, model_dir, data, out)), "--json"])
        assert res.exit_code == 0, res.output  # budget: a later load measures the rest
        reports.append(json.loads((tmp_path / f"{out}.parquet.meta" / "report.json").read_text()))
        if out != "first" and reports[-1]["stage_s"]["calibration_s"] == 0.0:
            break
    stages = [r["stage_s"] for r in reports]
    assert stages[0]["calibration_s"] > 0
    assert all(
        s["run_s"] == pytest.approx(r["engine_s"]) for s, r in zip(stages, reports, strict=True)
    )
    assert stages[-1]["calibration_s"] == 0.0  # every decision read from the cache
    assert list((tmp_path / "cache").glob("*.calibration.json"))
