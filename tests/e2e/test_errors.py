"""Every documented error is its exit code with a one-line message and no
traceback; context length caps generation; a job that can run no row fails.

``test_every_documented_error`` walks the README's exit-code table: each case is a real bad
input (file, folder, flag) run through the CLI in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob import errors
from batchjob.config import load_job
from batchjob.outputs.naming import OutputLayout
from batchjob.storage.lock import output_lock
from tests.e2e.jobkit import ROOT, cli, read_results, write_job


def _one_line_error(res, code: int) -> str:
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    lines = [x for x in res.stderr.strip().splitlines() if not x.startswith("batchjob: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def bad(tmp_path_factory, run_model) -> dict[str, Path]:
    """Bad inputs and model folders, each made the way a user would make it."""
    d = tmp_path_factory.mktemp("bad")
    out: dict[str, Path] = {}
    (d / "mixed").mkdir()
    pq.write_table(pa.table({"prompt": ["a b", "c"], "x": [1, 2]}), d / "mixed" / "a.parquet")
    pq.write_table(pa.table({"prompt": ["a b", "c"], "x": ["s", "t"]}), d / "mixed" / "b.parquet")
    out["mixed"] = d / "mixed"
    out["nocol"] = d / "nocol.parquet"
    pq.write_table(pa.table({"text": ["a b"]}), out["nocol"])
    out["corrupt"] = d / "corrupt.parquet"
    out["corrupt"].write_bytes(b"PAR1 this is not parquet")
    words = [f"row {i} alpha beta gamma" for i in range(40)]
    plain = d / "plain.parquet"  # uncompressed: the text's bytes lie in the file as they are
    pq.write_table(pa.table({"prompt": words}), plain, compression="none", use_dictionary=False)
    data = plain.read_bytes()
    at = data.index(b"row 17 alpha")
    out["bad_utf8"] = d / "bad-utf8.parquet"  # a corrupt page that still decodes
    out["bad_utf8"].write_bytes(data[:at] + b"\xff\xfe" + data[at + 2 :])
    page = pq.read_metadata(plain).row_group(0).column(0).data_page_offset
    out["bad_page"] = d / "bad-page.parquet"  # a page header pyarrow cannot parse
    out["bad_page"].write_bytes(data[:page] + b"\xff" * 16 + data[page + 16 :])
    out["empty"] = d / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), out["empty"])
    out["ids"] = d / "ids.parquet"
    pq.write_table(
        pa.table({"prompt": pa.array([[5, 6, 7], [8, 9]], pa.list_(pa.int32()))}), out["ids"]
    )
    out["oov"] = d / "oov.parquet"  # every id outside the model's vocabulary
    pq.write_table(
        pa.table({"prompt": pa.array([[99999, 5], [70000]], pa.list_(pa.int32()))}), out["oov"]
    )
    out["text"] = d / "text.parquet"
    pq.write_table(pa.table({"prompt": ["alpha beta", "gamma"]}), out["text"])
    trunc = d / "trunc-model"
    trunc.mkdir()
    for f in run_model.iterdir():
        data = f.read_bytes()
        (trunc / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    out["trunc_model"] = trunc
    (d / "afile").write_text("not a folder")
    out["afile"] = d / "afile"
    return out


def _cases(bad: dict[str, Path], model: Path, tmp: Path):
    o = str(tmp / "o.parquet")

    def run(data: Path, *rest: str) -> list[str]:
        return ["run", "--input", str(data), "--output", o, *rest]

    def on_cpu(model_dir: Path) -> list[str]:
        return ["--model", str(model_dir), "--set", "model.device=cpu"]

    m = on_cpu(model)
    E = errors
    return {
        "bad command line": (["run", "--no-such-flag"], E.EXIT_USAGE, "no-such-flag"),
        "job file missing": (["run", str(tmp / "nope.toml")], E.EXIT_CONFIG, "not found"),
        "unknown key": (
            run(bad["text"], "--set", "sampling.tempreature=1"),
            E.EXIT_CONFIG,
            "sampling.tempreature",
        ),
        "output is the input": (
            ["run", "--input", str(bad["text"]), "--output", str(bad["text"]), *m],
            E.EXIT_CONFIG,
            "output.path",
        ),
        "output under a file": (
            ["run", "--input", str(bad["text"]), "--output", str(bad["afile"] / "r.parquet"), *m],
            E.EXIT_CONFIG,
            "output.path",
        ),
        "cuda without a GPU": (
            run(bad["text"], "--model", str(model), "--set", "model.device=cuda"),
            E.EXIT_CONFIG,
            "model.device",
        ),
        "files type a column differently": (run(bad["mixed"], *m), E.EXIT_INPUT, "'x'"),
        "missing prompt column": (run(bad["nocol"], *m), E.EXIT_INPUT, "'prompt'"),
        "misspelled max_tokens_column": (
            run(bad["text"], *m, "--set", "input.max_tokens_column=mt"),
            E.EXIT_INPUT,
            "input.max_tokens_column",
        ),
        "corrupt parquet": (run(bad["corrupt"], *m), E.EXIT_INPUT, "corrupt.parquet"),
        "corrupt page header": (
            run(bad["bad_page"], *m),
            E.EXIT_INPUT,
            "bad-page.parquet: cannot read Parquet data near row 0: Couldn't deserialize",
        ),
        "text that is not UTF-8": (
            run(bad["bad_utf8"], *m),
            E.EXIT_INPUT,
            "row 17 (file bad-utf8.parquet, row 17): column 'prompt' holds bytes that are not",
        ),
        "empty dataset": (run(bad["empty"], *m), E.EXIT_INPUT, "0 rows"),
        "model folder missing": (
            run(bad["text"], *on_cpu(tmp / "nomodel")),
            E.EXIT_MODEL,
            "nomodel",
        ),
        "truncated safetensors": (
            run(bad["text"], *on_cpu(bad["trunc_model"])),
            E.EXIT_MODEL,
            "safetensors",
        ),
        "token ids, model.path none": (
            run(bad["ids"], "--set", "model.path=none"),
            E.EXIT_MODEL,
            "model.path",
        ),
        "every row rejected": (run(bad["oov"], *m), E.EXIT_ALL_REJECTED, "invalid_tokens: 2"),
    }


CASES = [
    "bad command line", "job file missing", "unknown key", "output is the input",
    "output under a file", "cuda without a GPU", "files type a column differently",
    "missing prompt column", "misspelled max_tokens_column", "corrupt parquet",
    "corrupt page header", "text that is not UTF-8", "empty dataset",
    "model folder missing", "truncated safetensors", "token ids, model.path none",
    "every row rejected",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_every_documented_error(case, bad, run_model, tmp_path):
    args, code, words = _cases(bad, run_model, tmp_path)[case]
    if code == errors.EXIT_USAGE:  # click's own usage error: not an 'error: ' line of ours
        res = cli(*args)
        assert res.exit_code == code and "Traceback" not in res.output and words in res.output
        return
    line = _one_line_error(cli(*args), code)
    assert words in line
    assert not (tmp_path / "o.parquet").exists()  # nothing pretends to be results


def test_locked_output_exits_75_without_work(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    layout = OutputLayout.of(load_job(job).output)
    layout.prepare()
    with output_lock(layout.lock_file, layout.output):  # as another run would hold it
        line = _one_line_error(cli("run", job), errors.EXIT_LOCKED)
    assert "another batchjob run" in line and str(os.getpid()) in line
    assert not layout.parts.exists() and not layout.output.exists()


def test_disk_full_is_one_line_exit_1_and_resumes(tmp_path, run_model, run_data, monkeypatch):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet", flush_rows="4")
    monkeypatch.setenv("BATCHJOB_FAULT_POINT", "part:3:ENOSPC")  # the 3rd part write fails
    line = _one_line_error(cli("run", job), errors.EXIT_RUNTIME)
    assert "No space left on device" in line and "rerun" in line
    monkeypatch.delenv("BATCHJOB_FAULT_POINT")
    res = cli("run", job)
    assert res.exit_code == 0, res.output
    n = pq.read_metadata(run_data).num_rows
    assert read_results(tmp_path / "out" / "results.parquet")["row_id"].to_pylist() == list(
        range(n)
    )


@pytest.mark.parametrize("nth", [1, 4])
def test_disk_full_names_the_file_it_could_not_write(
    tmp_path, run_model, run_data, monkeypatch, nth
):
    """A full disk raises inside pyarrow's write, which names no file: the line names it."""
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet", flush_rows="4")
    monkeypatch.setenv("BATCHJOB_FAULT_POINT", f"write:{nth}:ENOSPC")
    line = _one_line_error(cli("run", job), errors.EXIT_RUNTIME)
    assert "No space left on device: " in line, line
    named = Path(line.split("No space left on device: ", 1)[1].split("'")[1])
    assert named.is_relative_to(tmp_path / "out") and named.parent.is_dir(), line
    assert not list(tmp_path.rglob("*.tmp"))  # the temp file went with the error
    monkeypatch.delenv("BATCHJOB_FAULT_POINT")
    assert cli("run", job).exit_code == 0


def test_generation_stops_at_the_model_context(tmp_path, run_model, run_data):
    first = write_job(tmp_path, run_model, run_data, "full/r.parquet")
    assert cli("run", first, "--set", "sampling.ignore_eos=true").exit_code == 0
    full = read_results(tmp_path / "full" / "r.parquet")
    lengths = sorted(full["num_prompt_tokens"].to_pylist())
    ctx = lengths[len(lengths) // 2] + 3  # half the rows have room for < 6 new tokens
    job = write_job(tmp_path, run_model, run_data, "ctx/r.parquet")
    res = cli(
        "run", job, "--set", f"model.max_model_len={ctx}", "--set", "sampling.ignore_eos=true"
    )
    assert res.exit_code == 0, res.output
    out = [
        r for r in read_results(tmp_path / "ctx" / "r.parquet").to_pylist() if r["status"] == "ok"
    ]
    assert out and all(r["num_prompt_tokens"] + r["num_output_tokens"] <= ctx for r in out)
    cut = [r for r in out if r["num_prompt_tokens"] + 6 > ctx]
    assert cut and all(r["finish_reason"] == "length" for r in cut)
    assert all(r["num_output_tokens"] == ctx - r["num_prompt_tokens"] for r in cut)


def test_run_json_when_already_complete(tmp_path, run_model, run_data):
    import json

    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    assert cli("run", job).exit_code == 0
    res = cli("run", job, "--json")
    assert res.exit_code == 0
    got = json.loads(res.stdout)
    assert got["already_complete"] is True and got["results"].endswith("results.parquet")


def test_row_over_the_kv_budget_gets_a_status_and_the_rest_runs(tmp_path, run_model):
    from batchjob.testing.workloads import WORDS

    short = [" ".join(WORDS[i : i + 5]) for i in range(0, 30, 5)]
    long = [" ".join(WORDS[i : i + 300]) for i in (100, 500)]
    data = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"prompt": short[:3] + long[:1] + short[3:] + long[1:]}), data)
    job = write_job(tmp_path, run_model, data, "out/results.parquet")
    # 80000 bytes: 8 blocks of 16 tokens here; a 300-word prompt needs more even alone
    res = cli("run", job, "--set", "engine.kv_cache_bytes=80000")
    assert res.exit_code == 0, res.output
    out = read_results(tmp_path / "out" / "results.parquet").to_pylist()
    assert [r["row_id"] for r in out] == list(range(8))
    assert [r["status"] for r in out] == ["ok"] * 3 + ["kv_budget_exceeded"] + ["ok"] * 3 + [
        "kv_budget_exceeded"
    ]
    assert all("engine.kv_cache_bytes" in r["message"] for r in out if r["message"])
    assert all(r["num_output_tokens"] == 6 or r["finish_reason"] == "stop" for r in out[:3])


def test_readme_exit_code_table_is_complete_and_tested(tmp_path, bad, run_model):
    """Every code in the README's table is in errors.py and exercised by a test here (0: the
    runs above, 1: disk full, 75: locked, 130: test_pipeline_run's interrupt)."""
    import re

    from tests.e2e.jobkit import ROOT

    readme = (ROOT / "README.md").read_text()
    table = {int(c) for c in re.findall(r"^  \| (\d+) \|", readme, flags=re.M)}
    defined = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    assert table == defined, (table, defined)
    tested = {code for _, code, _ in _cases(bad, run_model, tmp_path).values()}
    tested |= {errors.EXIT_OK, errors.EXIT_RUNTIME, errors.EXIT_LOCKED, errors.EXIT_INTERRUPTED}
    assert table <= tested


# ---------------------------------------------------------------------------------------
# settings and data that used to end in a traceback, or in the wrong exit code


@pytest.mark.parametrize("value", ["99999999999999999999", "9223372036854775807", "2147483648"])
def test_max_tokens_out_of_range_is_a_setting_error(value, bad, run_model, tmp_path):
    """Beyond int64 was an OverflowError (exit 1); beyond int32 was "every row rejected"
    (exit 6, fix the data) where the setting is what is wrong (exit 3)."""
    args = ["run", "--input", str(bad["text"]), "--output", str(tmp_path / "o.parquet")]
    args += ["--model", str(run_model), "--set", "model.device=cpu"]
    line = _one_line_error(cli(*args, "--set", f"sampling.max_tokens={value}"), errors.EXIT_CONFIG)
    assert "sampling.max_tokens" in line and "2147483647" in line


def test_two_columns_of_one_name_are_bad_data(run_model, tmp_path):
    data = tmp_path / "dup.parquet"
    t = pa.table([pa.array(["a b", "c"]), pa.array(["x", "y"])], names=["prompt", "prompt"])
    pq.write_table(t, data)
    args = ["run", "--input", str(data), "--output", str(tmp_path / "o.parquet")]
    line = _one_line_error(cli(*args, "--model", str(run_model)), errors.EXIT_INPUT)
    assert "dup.parquet" in line and "'prompt'" in line


def test_a_dangling_link_in_the_input_folder_is_bad_data(run_model, run_data, tmp_path):
    """Its rows went missing without a word."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.parquet").write_bytes(run_data.read_bytes())
    (folder / "b.parquet").symlink_to(tmp_path / "gone.parquet")
    args = ["run", "--input", str(folder), "--output", str(tmp_path / "o.parquet")]
    line = _one_line_error(cli(*args, "--model", str(run_model)), errors.EXIT_INPUT)
    assert "b.parquet" in line and "gone.parquet" in line


def test_a_set_value_holding_more_toml_is_refused(bad, run_model, tmp_path):
    """The extra table was parsed and silently ignored."""
    args = ["run", "--input", str(bad["text"]), "--output", str(tmp_path / "o.parquet")]
    args += ["--model", str(run_model), "--set", "sampling.max_tokens=3\n[evil]\nx=1"]
    line = _one_line_error(cli(*args), errors.EXIT_CONFIG)
    assert "sampling.max_tokens" in line


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_still_exits_130(sig, run_model, run_data, tmp_path):
    """Signals keep coming while the run stops (an impatient user, a supervisor that repeats
    SIGTERM): the exit is 130 whenever the second one lands (it was -2 or -15 when it landed
    during the interpreter's shutdown), and the rows written are whole."""
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet", flush_rows="1")
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(job), "--no-progress"]
    cmd += ["--set", "scheduler.chunk_size=8"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    parts = OutputLayout.of(load_job(job).output).parts
    deadline = time.monotonic() + 120
    while proc.poll() is None and not list(parts.glob("part-*.parquet")):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    while proc.poll() is None:  # the first signal, then one every 20 ms until it is gone
        proc.send_signal(sig)
        time.sleep(0.02)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == errors.EXIT_INTERRUPTED, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    for p in parts.glob("part-*.parquet"):
        assert pq.read_metadata(p).num_rows == 1
    res = cli("run", job)
    assert res.exit_code == 0, res.output
