"""LoRA adapters in the job (model.adapters, model.adapter, input.adapter_column): the
checks, each row's adapter read and a bad name rejecting only its row, the plan keyed by
adapter. Outputs against merged-weights models: tests/backends/test_vllm_adapters.py."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.config import load_job
from batchjob.errors import ConfigError
from batchjob.plan import plan_job
from batchjob.runner.prepare import prepare
from batchjob.testing.lora_adapter import make_lora_adapter
from tests.e2e.jobkit import ROOT, cli, write_job


@pytest.fixture(scope="module")
def adapters(run_model: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_lora_adapter(root / n, run_model, seed=i) for i, n in enumerate("ab")}


def _data(tmp_path: Path, run_data: Path, names: list[str | None]) -> Path:
    t = pq.read_table(run_data).slice(0, len(names))
    path = tmp_path / "rows.parquet"
    pq.write_table(t.append_column("adapter", pa.array(names, pa.string())), path)
    return path


def _job(run_model, data, tmp_path, adapters, **sets):
    base = {
        "input.path": str(data),
        "model.path": str(run_model),
        "output.path": str(tmp_path / "out.parquet"),
        "model.adapters": "{" + ", ".join(f'{k} = "{v}"' for k, v in adapters.items()) + "}",
    }
    return load_job(None, base | sets)


def test_rows_take_their_adapter_and_a_bad_name_rejects_its_row(
    tmp_path, run_model, run_data, adapters
) -> None:
    names = ["a", "b", None, "zzz", "a", None]
    data = _data(tmp_path, run_data, names)
    job = _job(run_model, data, tmp_path, adapters, **{"input.adapter_column": "adapter"})
    loaded = prepare(job).loaded
    assert loaded.prompts.row_ids.tolist() == [0, 1, 2, 4, 5]
    assert loaded.prompts.adapter.tolist() == [0, 1, -1, 0, -1]
    assert loaded.rejected.row_ids.tolist() == [3]
    assert loaded.rejected.status == ("invalid_adapter",)
    assert "row 3: input.adapter_column 'adapter' = 'zzz'" in loaded.rejected.message[0]
    plan = plan_job(loaded.prompts, job.scheduler)  # no group mixes adapters
    for g in range(plan.num_groups):
        assert len({int(loaded.prompts.adapter[m]) for m in plan.group_members(g)}) == 1
    # model.adapter: the adapter of rows that name none
    job = _job(
        run_model,
        data,
        tmp_path,
        adapters,
        **{"input.adapter_column": "adapter", "model.adapter": "b"},
    )
    assert prepare(job).loaded.prompts.adapter.tolist() == [0, 1, 1, 0, 1]


def test_bad_adapter_settings_name_the_key(tmp_path, run_model, run_data, adapters) -> None:
    data = _data(tmp_path, run_data, ["a"])
    with pytest.raises(ConfigError, match=r"model\.adapters\.c: .* has no adapter_config.json"):
        _job(run_model, data, tmp_path, {"c": tmp_path})
    with pytest.raises(ConfigError, match=r"model\.adapter: must name one of model\.adapters"):
        _job(run_model, data, tmp_path, adapters, **{"model.adapter": "x"})
    with pytest.raises(ConfigError, match=r"input\.adapter_column: needs model\.adapters"):
        _job(run_model, data, tmp_path, {}, **{"input.adapter_column": "adapter"})
    with pytest.raises(ConfigError, match=r"model\.adapters: is for model\.task = \"generate\""):
        _job(run_model, data, tmp_path, adapters, **{"model.task": "embed"})


def test_native_engine_refuses_adapters(tmp_path, run_model, run_data, adapters) -> None:
    data = _data(tmp_path, run_data, ["a", None])
    job = write_job(tmp_path, run_model, data, "o.parquet")
    job.write_text(
        job.read_text().replace(
            "[model]\n", f'[model]\nadapters = {{ a = "{adapters["a"]}" }}\nadapter = "a"\n'
        )
    )
    r = cli("run", job)
    assert r.exit_code == 3 and "model.adapters: the native engine" in (r.stderr or r.output)


def test_adapters_example_job_plans(tmp_path, run_model, run_data, adapters) -> None:
    """jobs/adapters.toml with the tiny model and two tiny adapters in place of its own:
    `batchjob plan` keys the groups by adapter (plans run no model)."""
    data = _data(tmp_path, run_data, ["support", "legal", None, "support"])
    t = pq.read_table(data)
    t = t.append_column("question_id", pa.array(range(t.num_rows)))
    pq.write_table(t.append_column("question", t["prompt"]), data)
    table = f'{{support = "{adapters["a"]}", legal = "{adapters["b"]}"}}'
    sets = [f"model.path={run_model}", f"input.path={data}", f"model.adapters={table}"]
    sets += [f"output.path={tmp_path / 'o.parquet'}"]
    r = cli("plan", ROOT / "jobs" / "adapters.toml", *[a for s in sets for a in ("--set", s)])
    assert r.exit_code == 0, r.output
    assert "groups        3 " in r.output, r.output  # support (rows 0, 3), legal, the base
