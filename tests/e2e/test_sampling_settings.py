"""The vLLM sampling surface on the native engine through ``batchjob run``: penalties, logit
bias, allowed token ids, min_tokens and min_p job-wide and per row (a bad per-row value
rejects its row with its documented status), token ids outside the vocabulary (exit 3), and
guided ``choice`` / ``regex`` (every ok row matches; a bad regex is exit 3 job-wide and
``invalid_regex`` per row). Equality with vLLM: tests/backends/vllm/test_vllm_sampling_settings.py
and tests/backends/native/test_sampling_processors.py."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchjob.errors import EXIT_CONFIG
from tests.e2e.jobkit import cli, read_results, write_job

REGEX = r"(yes|no)[.!]"
CHOICES = ["zivo", "pute gimi", "lone"]


def run(tmp: Path, model: Path, data: Path, name: str, *lines: str, code: int = 0):
    job = write_job(tmp, model, data, name)
    text = job.read_text()
    for line in lines:  # "[section] key = value": replaces the file's own key
        section, _, kv = line.partition("] ")
        key = kv.split(" = ")[0]
        text = re.sub(rf"(?m)^{key} = .*\n", "", text)
        text = text.replace(f"{section}]\n", f"{section}]\n{kv}\n", 1)
    job.write_text(text)
    r = cli("run", job, "--no-progress")
    assert r.exit_code == code, r.output + (r.stderr or "")
    return read_results(tmp / name).to_pylist() if code == 0 else r


def test_job_wide_settings_change_greedy_outputs(tmp_path, run_model, run_data):
    base = run(tmp_path, run_model, run_data, "base.parquet")
    first = base[0]["output_token_ids"][0]
    for i, line in enumerate(
        [
            "[sampling] presence_penalty = 2.0",
            "[sampling] frequency_penalty = 2.0",
            "[sampling] repetition_penalty = 2.0",
            f"[sampling] logit_bias = {{{first} = -20}}",
            f"[sampling] allowed_token_ids = [{first + 1}, {first + 2}, 7]",
        ]
    ):
        rows = run(tmp_path, run_model, run_data, f"s{i}.parquet", line)
        assert all(r["status"] == "ok" for r in rows)
        changed = [
            r
            for r, b in zip(rows, base, strict=True)
            if r["output_token_ids"] != b["output_token_ids"]
        ]
        assert changed, line
        if "logit_bias" in line:
            assert rows[0]["output_token_ids"][0] != first
        if "allowed" in line:
            assert all(set(r["output_token_ids"]) <= {first + 1, first + 2, 7} for r in rows)
    # min_p = 1 keeps only the top token: sampled rows are the greedy ones
    rows = run(
        tmp_path,
        run_model,
        run_data,
        "mp.parquet",
        "[sampling] min_p = 1.0",
        "[sampling] temperature = 1.0",
    )
    assert [r["output_token_ids"] for r in rows] == [b["output_token_ids"] for b in base]
    # min_tokens: a stop id the greedy rows emit early waits until 5 tokens are out
    stop = base[0]["output_token_ids"][1]
    stopped = run(
        tmp_path, run_model, run_data, "st.parquet", f"[sampling] stop_token_ids = [{stop}]"
    )
    held = run(
        tmp_path,
        run_model,
        run_data,
        "mt.parquet",
        f"[sampling] stop_token_ids = [{stop}]",
        "[sampling] min_tokens = 5",
    )
    assert len(stopped[0]["output_token_ids"]) == 2 and stopped[0]["finish_reason"] == "stop"
    assert all(len(r["output_token_ids"]) >= 5 for r in held)
    assert all(stop not in r["output_token_ids"][:4] for r in held)


def test_per_row_settings_and_their_statuses(tmp_path, run_model, run_data):
    data = pq.read_table(run_data)
    n = data.num_rows
    base = run(tmp_path, run_model, run_data, "base.parquet")
    cols = {  # name: (values, type, setting column, a bad value)
        "pp": ([None] * n, pa.float64(), "presence_penalty_column", 3.0),
        "fp": ([None] * n, pa.float64(), "frequency_penalty_column", -2.5),
        "rp": ([None] * n, pa.float64(), "repetition_penalty_column", -1.0),
        "minp": ([None] * n, pa.float64(), "min_p_column", 2.0),
        "mt": ([None] * n, pa.int64(), "min_tokens_column", -3),
        "lb": ([None] * n, pa.map_(pa.int32(), pa.float32()), "logit_bias_column", [(5000, 1.0)]),
        "al": ([None] * n, pa.list_(pa.int32()), "allowed_token_ids_column", [2500]),
        "rx": ([None] * n, pa.string(), "regex_column", "[a-"),
        "ch": ([None] * n, pa.list_(pa.string()), "choice_column", ["a", ""]),
    }
    first = [b["output_token_ids"][0] for b in base]
    cols["pp"][0][0] = 2.0
    cols["rp"][0][1] = 2.0
    cols["lb"][0][2] = [(first[2], -30.0)]
    cols["al"][0][3] = [first[3] + 1, 9]
    cols["rx"][0][4] = REGEX
    cols["ch"][0][5] = CHOICES
    bad_rows = {}
    for j, (values, _, key, bad) in enumerate(cols.values()):
        values[6 + j] = bad
        bad_rows[6 + j] = "invalid_" + key.removesuffix("_column")  # its documented status
    cols["rx"][0][6 + len(cols)] = REGEX  # two constraints in one row: the second is refused
    cols["ch"][0][6 + len(cols)] = CHOICES
    bad_rows[6 + len(cols)] = "invalid_choice"
    for name, (values, typ, _, _) in cols.items():
        data = data.append_column(name, pa.array(values, typ))
    path = tmp_path / "in-rows.parquet"
    pq.write_table(data, path)
    lines = [f'[input] {key} = "{name}"' for name, (_, _, key, _) in cols.items()]
    rows = run(tmp_path, run_model, path, "rows.parquet", *lines)
    for i, status in bad_rows.items():
        assert rows[i]["status"] == status, rows[i]
        assert f"row {i}" in rows[i]["message"] and "input." in rows[i]["message"]
    assert rows[2]["output_token_ids"][0] != first[2]
    assert set(rows[3]["output_token_ids"]) <= {first[3] + 1, 9}
    for i, kind in ((4, "regex"), (5, "choice")):
        if rows[i]["status"] == "ok":
            text = rows[i]["output_text"]
            assert re.fullmatch(REGEX, text) if kind == "regex" else text in CHOICES
        else:
            assert rows[i]["status"] == f"{kind}_incomplete"
    untouched = [i for i in range(n) if i > 6 + len(cols)]
    assert untouched and all(rows[i]["status"] == "ok" for i in untouched)


def test_choice_and_regex_every_ok_row_matches(tmp_path, run_model, run_data):
    data = tmp_path / "free.parquet"  # no max_tokens column: sampling.max_tokens = 16
    pq.write_table(pq.read_table(run_data).drop_columns(["max_tokens"]), data)
    for kind, line in (
        ("choice", '[sampling] choice = ["zivo", "pute gimi", "lone"]'),
        ("regex", "[sampling] regex = '(yes|no)[.!]'"),
    ):
        rows = run(tmp_path, run_model, data, f"{kind}.parquet", line, "[sampling] max_tokens = 16")
        ok = [r for r in rows if r["status"] == "ok"]
        assert len(ok) >= len(rows) // 2
        for r in rows:
            if r["status"] != "ok":
                assert r["status"] == f"{kind}_incomplete" and r["finish_reason"] == "length"
                continue
            text = r["output_text"]
            assert re.fullmatch(REGEX, text) if kind == "regex" else text in CHOICES
    short = run(
        tmp_path,
        run_model,
        data,
        "short.parquet",
        '[sampling] choice = ["pute gimi zivo lone"]',
        "[sampling] max_tokens = 2",
    )
    assert {(r["status"], r["finish_reason"]) for r in short} == {("choice_incomplete", "length")}


def test_bad_job_wide_values_are_exit_3(tmp_path, run_model, run_data):
    for line, key in (
        ("[sampling] regex = '(yes'", "sampling.regex"),
        ("[sampling] logit_bias = {99999 = 1.0}", "sampling.logit_bias"),
        ("[sampling] allowed_token_ids = [1, 2500]", "sampling.allowed_token_ids"),
        ("[sampling] min_tokens = -1", "sampling.min_tokens"),
    ):
        r = run(tmp_path, run_model, run_data, "bad.parquet", line, code=EXIT_CONFIG)
        assert key in r.output, r.output


def test_stop_strings_cannot_end_within_min_tokens():
    from batchjob.backends.native.sampling import truncate_at_stop

    assert truncate_at_stop("ab xy ab", ["ab"]) == ("", True)
    assert truncate_at_stop("ab xy ab", ["ab"], min_end=2) == ("ab xy ", True)
    assert truncate_at_stop("ab xy ab", ["ab"], min_end=1) == ("", True)  # ends past char 1
    assert truncate_at_stop("ab xy", ["ab"], min_end=2) == ("ab xy", False)


def test_min_tokens_leaves_a_grammar_row_its_stop_token():
    """A grammar that allows only EOS, before min_tokens: vLLM gives the row its EOS back
    rather than leave it no token (MinTokensLogitsProcessor's restore)."""
    from batchjob.backends.native.logits_processors import DecodeState
    from batchjob.backends.native.sampling import RowParams, sample_batch
    from batchjob.config import SamplingConfig

    c = SamplingConfig(min_tokens=4)
    table = RowParams.build([c], np.zeros(2, np.int64), (2,))
    logits = torch.full((2, 8), float("-inf"))
    logits[:, 2] = 1.0  # only EOS left by the grammar
    logits[1, 5] = 0.5  # row 1 is free: EOS masked, 5 wins
    state = DecodeState(
        table.procs, np.zeros(2, np.int32), np.arange(3), np.array([True, False]), False
    )
    got = sample_batch(
        logits,
        table,
        np.zeros(2, np.int64),
        np.arange(2),
        np.zeros(2, np.int64),
        np.arange(2),
        state,
    )
    assert got.tolist() == [2, 5]
