"""Models named as vLLM and Ray Data users name them: a Hugging Face Hub id (``org/name``)
found in a Hub cache laid out as ``huggingface_hub`` lays it out, offline
(``HF_HUB_OFFLINE=1``), for ``batchjob run --model org/name`` and ``batchjob.generate``; with
``model.revision`` and a separate ``model.tokenizer``; a local folder of that name wins."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import batchjob
from batchjob.config import ModelConfig, load_job
from batchjob.errors import EXIT_MODEL, ModelError
from batchjob.model.hub import display_name, is_hub_id
from tests.e2e.jobkit import cli, read_results

REV = "0123456789abcdef0123456789abcdef01234567"
OTHER_REV = "fedcba9876543210fedcba9876543210fedcba98"
SETTINGS = ["--set", "model.device=cpu", "--set", "engine.threads=1", "--no-progress"]
SETTINGS += ["--set", "sampling.max_tokens=4", "--set", "engine.kv_cache_bytes=8MiB"]


def add_snapshot(home: Path, repo_id: str, folder: Path, rev: str, ref: str | None) -> Path:
    """``folder`` as the snapshot ``rev`` of ``repo_id`` under ``$HF_HOME/hub`` (``ref``:
    the branch that points at it)."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / rev
    shutil.copytree(folder, snap)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(rev)
    return snap


@pytest.fixture
def hub(tmp_path: Path, run_model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf-home"
    add_snapshot(home, "org/tiny", run_model, REV, "main")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)  # no local folder "org/tiny" here
    return home


def test_hub_ids_and_paths() -> None:
    assert is_hub_id("Qwen/Qwen2.5-0.5B") and is_hub_id("models/tiny-llama")
    for not_id in ("/abs/x", "./a/b", "a/b/c", "../x", "~/m", "tiny", "a/..", "s3://b/k"):
        assert not is_hub_id(not_id), not_id
    snap = Path("/c/hub/models--Qwen--Qwen2.5-0.5B/snapshots") / REV
    assert display_name(snap) == "Qwen/Qwen2.5-0.5B"
    assert display_name(Path("/m/tiny-llama")) == "tiny-llama"


def test_run_with_a_hub_id_offline_equals_the_local_folder(
    hub: Path, tmp_path: Path, run_model: Path, run_data: Path
) -> None:
    local, by_id = tmp_path / "local.parquet", tmp_path / "hub.parquet"
    r = cli("run", "--input", run_data, "--model", run_model, "--output", local, *SETTINGS)
    assert r.exit_code == 0, r.output
    r = cli("run", "--input", run_data, "--model", "org/tiny", "--output", by_id, *SETTINGS)
    assert r.exit_code == 0, r.output
    want, got = read_results(local), read_results(by_id)
    assert got["output_token_ids"].to_pylist() == want["output_token_ids"].to_pylist()
    assert set(got["status"].to_pylist()) == {"ok"}

    prompts = pq.read_table(run_data)["prompt"].to_pylist()[:3]
    api = batchjob.generate(
        prompts,
        model={"path": "org/tiny", "device": "cpu"},
        sampling={"max_tokens": 4},
        engine={"threads": 1, "kv_cache_bytes": "8MiB"},
    )
    ref = batchjob.generate(
        prompts,
        model={"path": run_model, "device": "cpu"},
        sampling={"max_tokens": 4},
        engine={"threads": 1, "kv_cache_bytes": "8MiB"},
    )
    assert api["output_token_ids"].to_pylist() == ref["output_token_ids"].to_pylist()
    assert api["output_text"].to_pylist() == ref["output_text"].to_pylist()


def test_revision_tokenizer_and_a_local_folder_that_wins(
    hub: Path, tmp_path: Path, run_model: Path, run_data: Path
) -> None:
    snap = hub / "hub" / "models--org--tiny" / "snapshots"
    sets = {"input.path": str(run_data), "output.path": "o", "model.path": "org/tiny"}
    job = load_job(None, sets)
    assert job.model.path == snap / REV and job.model.tokenizer_path == snap / REV

    add_snapshot(hub, "org/tiny", run_model, OTHER_REV, None)  # an older commit, no branch
    job = load_job(None, {**sets, "model.revision": OTHER_REV})
    assert job.model.path == snap / OTHER_REV

    add_snapshot(hub, "org/tok", run_model, REV, "main")
    job = load_job(None, {**sets, "model.path": str(run_model), "model.tokenizer": "org/tok"})
    assert job.model.path == run_model
    assert job.model.tokenizer == hub / "hub" / "models--org--tok" / "snapshots" / REV

    shutil.copytree(run_model, tmp_path / "org" / "tiny")  # ./org/tiny exists: it wins
    job = load_job(None, sets)
    assert job.model.path == tmp_path / "org" / "tiny"
    assert ModelConfig(path="org/tiny").with_hub_snapshots().path == Path("org/tiny")


def test_a_hub_id_not_in_the_cache_offline_is_exit_5_naming_the_key(
    hub: Path, tmp_path: Path, run_data: Path
) -> None:
    out = tmp_path / "o.parquet"
    r = cli("run", "--input", run_data, "--model", "org/missing", "--output", out, *SETTINGS)
    assert r.exit_code == EXIT_MODEL, r.output
    assert "model.path: 'org/missing' is not a local folder" in r.output
    assert "HF_HUB_OFFLINE" in r.output and str(hub / "hub") in r.output
    with pytest.raises(ModelError, match="at revision 'nope'"):
        ModelConfig(path="org/tiny", revision="nope").with_hub_snapshots()
