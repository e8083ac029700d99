from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.config import JobConfig, load_job, parse_assignments, parse_bytes
from batchjob.errors import ConfigError
from batchjob.outputs.naming import OutputLayout

FULL = """
[input]
path = "data/prompts.parquet"
prompt_column = "text"
id_column = "doc"
max_tokens_column = "limit"
batch_rows = 1000
limit = 50

[model]
path = "../models/tiny"
dtype = "bfloat16"
device = "cuda:1"
max_model_len = 2048

[sampling]
max_tokens = 64
temperature = 1
top_k = 40
top_p = 0.9
seed = 7
stop_token_ids = [2, 5]
stop = ["\\n\\n"]
ignore_eos = true

[scheduler]
policy = "baseline"
chunk_size = 512
kv_threshold = 0.8
max_num_seqs = 32
enlarge = false
reorder = false

[engine]
backend = "native"
kv_cache_bytes = "1.5GiB"
gpu_memory_fraction = 0.5
block_size = 32
attention = "torch"
threads = 2

[output]
path = "/abs/out/results.parquet"
report_path = "report.json"
overwrite = true
rows_per_file = 10
"""

MINIMAL = """
[input]
path = "in.parquet"
[output]
path = "out"
"""


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    p = tmp_path / "jobs" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_full_file_values_and_relative_paths(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, FULL))
    d = (tmp_path / "jobs").resolve()
    assert job.input.path == str(d / "data/prompts.parquet")
    assert job.input.prompt_column == "text" and job.input.id_column == "doc"
    assert job.input.max_tokens_column == "limit"
    assert (job.input.batch_rows, job.input.limit) == (1000, 50)
    assert job.model.path == d.parent / "models/tiny"  # normalised, no ".."
    assert (job.model.dtype, job.model.device, job.model.max_model_len) == (
        "bfloat16",
        "cuda:1",
        2048,
    )
    s = job.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.seed) == (64, 1.0, 40, 0.9, 7)
    assert isinstance(s.temperature, float)
    assert s.stop_token_ids == (2, 5) and s.stop == ("\n\n",) and s.ignore_eos is True
    sc = job.scheduler
    assert (sc.policy, sc.chunk_size, sc.kv_threshold, sc.max_num_seqs) == (
        "baseline",
        512,
        0.8,
        32,
    )
    assert sc.enlarge is False and sc.reorder is False
    e = job.engine
    assert e.kv_cache_bytes == int(1.5 * 2**30)
    assert (e.gpu_memory_fraction, e.block_size, e.attention, e.threads) == (0.5, 32, "torch", 2)
    o = job.output
    assert o.path == Path("/abs/out/results.parquet") and o.report_path == d / "report.json"
    assert o.overwrite is True and o.rows_per_file == 10
    layout = OutputLayout.of(o)
    assert layout.report_file == d / "report.json"
    assert layout.plan_file == Path("/abs/out/results.parquet.meta/plan.parquet")
    assert job.source == (tmp_path / "jobs" / "job.toml").resolve()
    assert job.to_dict()["sampling"]["stop_token_ids"] == [2, 5]


def test_defaults(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, MINIMAL))
    assert job.input.prompt_column == "prompt" and job.input.id_column is None
    assert job.input.max_tokens_column == "max_tokens" and job.input.batch_rows == 65536
    assert job.model.path is None and job.model.dtype == "auto" and job.model.device == "auto"
    assert job.sampling.max_tokens == 128 and job.sampling.temperature == 0.0
    assert job.scheduler.policy == "batchllm" and job.scheduler.chunk_size is None
    assert job.scheduler.kv_threshold is None and job.scheduler.enlarge and job.scheduler.reorder
    # unset: the paper's margin on the native engine, vLLM's whole block pool on vllm
    assert job.scheduler.kv_threshold_for("native") == 0.95
    assert job.scheduler.kv_threshold_for("vllm") == 1.0
    assert job.engine.backend == "native" and job.engine.kv_cache_bytes is None
    assert job.engine.block_size is None and job.engine.attention == "auto"
    assert job.output.overwrite is False and job.output.rows_per_file == 100000
    out = (tmp_path / "jobs" / "out").resolve()
    layout = OutputLayout.of(job.output)
    assert layout.report_file == out.with_name("out.meta") / "report.json"
    assert layout.plan_file == out.with_name("out.meta") / "plan.parquet"
    with pytest.raises(AttributeError):
        job.sampling.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "section,line,key",
    [
        ("scheduler", "chunk_size = 0", "scheduler.chunk_size"),
        ("scheduler", 'chunk_size = "big"', "scheduler.chunk_size"),
        ("scheduler", "chunk_size = true", "scheduler.chunk_size"),
        ("scheduler", 'policy = "fifo"', "scheduler.policy"),
        ("scheduler", "kv_threshold = 1.5", "scheduler.kv_threshold"),
        ("sampling", "temperature = -1", "sampling.temperature"),
        ("sampling", "top_p = 0", "sampling.top_p"),
        ("sampling", 'stop_token_ids = ["a"]', "sampling.stop_token_ids"),
        ("sampling", 'ignore_eos = "yes"', "sampling.ignore_eos"),
        ("model", 'dtype = "int4"', "model.dtype"),
        ("model", 'device = "tpu"', "model.device"),
        ("engine", 'kv_cache_bytes = "2 parsecs"', "engine.kv_cache_bytes"),
        ("engine", 'attention = "flash"', "engine.attention"),
        ("engine", 'backend = "sglang"', "engine.backend"),
        ("input", "batch_rows = -5", "input.batch_rows"),
        ("output", "rows_per_file = 0", "output.rows_per_file"),
        ("scheduler", "chunksize = 4", "scheduler.chunksize"),
        ("model", "trust_remote_code = true", "model.trust_remote_code"),
    ],
)
def test_bad_values_name_key_and_file(tmp_path: Path, section: str, line: str, key: str) -> None:
    text = MINIMAL + f"\n[{section}]\n{line}\n"
    if section in ("input", "output"):  # merge into the existing table
        text = MINIMAL.replace(f"[{section}]\n", f"[{section}]\n{line}\n")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_job(path)
    msg = str(ei.value)
    assert key in msg and str(path) in msg


def test_unknown_section_missing_required_and_bad_toml(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL + "\n[engines]\nbackend = 'native'\n")
    with pytest.raises(ConfigError, match=r"unknown section \[engines\]") as ei:
        load_job(p)
    assert str(p) in str(ei.value)
    p = write(tmp_path, "[output]\npath = 'x'\n", "noinput.toml")
    with pytest.raises(ConfigError, match=r"input\.path: required") as ei:
        load_job(p)
    assert "noinput.toml" in str(ei.value)
    p = write(tmp_path, "[input\npath=", "broken.toml")
    with pytest.raises(ConfigError, match="invalid TOML") as ei:
        load_job(p)
    assert "broken.toml" in str(ei.value)
    with pytest.raises(ConfigError, match="not found"):
        load_job(tmp_path / "nope.toml")


def test_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    cwd = tmp_path / "elsewhere"
    overrides = parse_assignments(
        [
            "scheduler.chunk_size=4096",
            "scheduler.enlarge=true",
            "sampling.temperature=0.7",
            "sampling.stop_token_ids=[1, 2, 3]",
            "sampling.stop=['END']",
            "engine.kv_cache_bytes=512MiB",
            "input.id_column=2024",  # text key: raw string, not an int
            "input.limit=none",
            "input.path=rel/x.parquet",  # CLI paths: relative to the current directory
            "model.dtype=float16",
            "output.plan_path=/tmp/p.parquet",
        ]
    )
    job = load_job(path, overrides, cwd=cwd)
    assert job.scheduler.chunk_size == 4096 and job.scheduler.enlarge is True
    assert job.sampling.temperature == 0.7 and job.sampling.stop_token_ids == (1, 2, 3)
    assert job.sampling.stop == ("END",)
    assert job.engine.kv_cache_bytes == 512 * 2**20
    assert job.input.id_column == "2024" and job.input.limit is None
    assert job.input.path == str(cwd / "rel/x.parquet")
    assert job.model.dtype == "float16" and OutputLayout.of(job.output).plan_file == Path(
        "/tmp/p.parquet"
    )
    # untouched keys keep the file's values
    assert job.scheduler.max_num_seqs == 32


def test_override_errors_name_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"scheduler\.chunk_size.*>= 1"):
        load_job(path, {"scheduler.chunk_size": "-3"})
    with pytest.raises(ConfigError, match=r"scheduler\.chunk"):
        load_job(path, {"scheduler.chunk": "3"})
    with pytest.raises(ConfigError, match=r"unknown section \[sched\]"):
        load_job(path, {"sched.chunk_size": "3"})
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        parse_assignments(["chunk_size=3"])
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        parse_assignments(["scheduler.chunk_size"])
    assert parse_assignments(["a.b=x=y"]) == {"a.b": "x=y"}


def test_job_from_overrides_only(tmp_path: Path) -> None:
    job = load_job(None, {"input.path": "a.parquet", "output.path": "o"}, cwd=tmp_path)
    assert isinstance(job, JobConfig) and job.source is None
    assert job.input.path == str(tmp_path / "a.parquet")


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 10**6),
    unit=st.sampled_from(["", "B", "KB", "kib", "MiB", "GB", "GiB", "TiB"]),
)
def test_parse_bytes(n: int, unit: str) -> None:
    mult = {"": 1, "b": 1, "kb": 1000, "kib": 1024, "mib": 2**20, "gb": 10**9, "gib": 2**30}
    mult["tib"] = 2**40
    assert parse_bytes(f"{n}{unit}") == n * mult[unit.lower()]
    assert parse_bytes(f"{n} {unit}") == n * mult[unit.lower()]
    assert parse_bytes(n) == n


@pytest.mark.parametrize("name", ["demo.toml", "case1.toml"])
def test_shipped_job_files_load(name: str) -> None:
    jobs = Path(__file__).resolve().parents[2] / "jobs"
    job = load_job(jobs / name)
    root = jobs.parent
    assert Path(job.input.path).resolve().is_relative_to(root / "data")
    assert job.model.path is not None and job.model.path.resolve().parent == root / "models"
    assert job.output.path.resolve().is_relative_to(root / "out")


def test_input_path_of_another_type_names_the_key_and_type(tmp_path: Path) -> None:
    """``[input] path = 5`` was read as the file "5": exit 4, "matches no Parquet file"."""
    path = write(tmp_path, MINIMAL.replace('path = "in.parquet"', "path = 5"))
    with pytest.raises(ConfigError) as ei:
        load_job(path)
    msg = str(ei.value)
    assert "input.path" in msg and "not an integer" in msg and str(path) in msg
    assert ei.value.exit_code == 3
