"""The sampling settings users bring from vLLM, on ``engine.backend = "vllm"`` against the
native engine: presence / frequency / repetition penalties, logit bias, allowed token ids,
min_tokens (with stop ids and with stop strings) and min_p, job-wide and per row; guided
choice and regex, job-wide and per row.

Greedy rows must equal the native engine's token for token with each setting on, chosen so
that it changes the output (the native run against a plain greedy run shows it). min_p is
checked as ``min_p = 1`` with ``temperature = 1``: only the most likely token survives, so the
sampled rows equal the greedy ones on both backends (the distribution itself is compared with
vLLM's own functions in tests/backends/native/test_sampling_processors.py). One vLLM engine
serves the whole module (its job names every per-row column, so structured outputs are on);
each case swaps the backend's sampling section or prompts.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.backends.base import RunSink
from batchjob.config import load_job
from batchjob.plan.build import build_plan
from batchjob.runner.execute import backend_config
from batchjob.runner.pipeline import cap_to_context
from batchjob.runner.pipeline import run as run_job
from batchjob.tokenize.batched import load_prompts
from batchjob.tokenize.tokenizer import detokenize, load_tokenizer
from tests.backends.vllm.vllm_kit import job_for, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]

REGEX = "(yes|no)[.!]"
CHOICES = ["zivo", "pute gimi", "lone"]
KINDS = ("presence", "frequency", "repetition", "bias", "allowed", "min_tokens", "min_p")
KINDS += ("regex", "choice", "none")
COLUMNS = {
    "input.presence_penalty_column": "pp",
    "input.frequency_penalty_column": "fp",
    "input.repetition_penalty_column": "rp",
    "input.logit_bias_column": "lb",
    "input.allowed_token_ids_column": "allowed",
    "input.min_tokens_column": "mt",
    "input.stop_column": "st",
    "input.min_p_column": "minp",
    "input.temperature_column": "temp",
    "input.regex_column": "rx",
    "input.choice_column": "ch",
}
# bad per-row values (appended rows) and the status each gets
BAD = [
    ("pp", 2.5, "invalid_presence_penalty"),
    ("fp", -3.0, "invalid_frequency_penalty"),
    ("rp", 0.0, "invalid_repetition_penalty"),
    ("minp", 1.5, "invalid_min_p"),
    ("mt", -1, "invalid_min_tokens"),
    ("lb", [(99999, 1.0)], "invalid_logit_bias"),
    ("allowed", [], "invalid_allowed_token_ids"),
    ("rx", "(yes", "invalid_regex"),
    ("ch", [], "invalid_choice"),
]


def _native(model, data, out, **sets) -> dict[int, dict]:
    res = run_job(job_for(model, data, out, "native", **sets), progress=False)
    return {r["row_id"]: r for r in pq.read_table(res.results_path).to_pylist()}


@pytest.fixture(scope="module")
def plain(dataset, tmp_path_factory):
    """The shared rows, each with room for 16 tokens."""
    t = pq.read_table(dataset)
    t = t.set_column(
        t.schema.get_field_index("max_tokens"),
        "max_tokens",
        pa.array([16] * t.num_rows, pa.int32()),
    )
    path = tmp_path_factory.mktemp("settings") / "plain.parquet"
    pq.write_table(t, path)
    return path


@pytest.fixture(scope="module")
def base(model_dir, plain, tmp_path_factory):
    return _native(model_dir, plain, tmp_path_factory.mktemp("base") / "r.parquet")


@pytest.fixture(scope="module")
def stop_id(base):
    """A token the greedy rows emit early: as a stop id it ends them, min_tokens defers it."""
    early = Counter(t for r in base.values() for t in r["output_token_ids"][1:6])
    return early.most_common(1)[0][0]


def _repeats(tokens: list[int]) -> int:
    return max(Counter(tokens).values())


@pytest.fixture(scope="module")
def per_row(plain, base, tmp_path_factory):
    """The rows with one setting each (kinds cycled; the penalties on the rows whose greedy
    output repeats a token most; min_tokens with a stop string found in the row's first
    token), then rows with bad values."""
    t = pq.read_table(plain)
    n = t.num_rows
    order = sorted(range(n), key=lambda i: -_repeats(base[i]["output_token_ids"]))
    kind = {}
    for j, i in enumerate(order):
        kind[i] = KINDS[j % len(KINDS)]
    vocab = sorted({t for r in base.values() for t in r["output_token_ids"]})
    cols: dict[str, list] = {c: [None] * n for c in COLUMNS.values()}
    for i in range(n):
        first = base[i]["output_token_ids"][0]
        k = kind[i]
        if k == "presence":
            cols["pp"][i] = 2.0
        elif k == "frequency":
            cols["fp"][i] = 2.0
        elif k == "repetition":
            cols["rp"][i] = 2.0
        elif k == "bias":
            cols["lb"][i] = [(first, -8.0), (vocab[3], 2.5)]
        elif k == "allowed":
            cols["allowed"][i] = [v for v in vocab if v != first]
        elif k == "min_tokens":
            cols["mt"][i], cols["st"][i] = 6, [base[i]["output_text"][1:4]]
        elif k == "min_p":
            cols["minp"][i], cols["temp"][i] = 1.0, 1.0
        elif k == "regex":
            cols["rx"][i] = REGEX
        elif k == "choice":
            cols["ch"][i] = CHOICES
    bad = t.take([0] * (len(BAD) + 1))
    t = pa.concat_tables([t, bad])
    for j, (col, value, _) in enumerate(BAD):
        cols[col].append(None)
        for other in cols:
            if other != col:
                cols[other].append(None)
        cols[col][n + j] = value
    for c in cols.values():  # the last row sets two constraints
        c.append(None)
    cols["rx"][-1], cols["ch"][-1] = REGEX, CHOICES
    types = {
        "lb": pa.map_(pa.int64(), pa.float64()),
        "allowed": pa.list_(pa.int64()),
        "mt": pa.int64(),
        "st": pa.list_(pa.string()),
        "rx": pa.string(),
        "ch": pa.list_(pa.string()),
    }
    for c, values in cols.items():
        t = t.append_column(c, pa.array(values, types.get(c, pa.float64())))
    path = plain.parent / "per_row.parquet"
    pq.write_table(t, path)
    return path, kind


class Engine:
    """One started VllmBackend (its job names every per-row column) and a way to run prompts
    on it with another [sampling] section."""

    def __init__(self, model, data, out, **sets):
        from batchjob.backends.vllm.backend import VllmBackend

        self.job = job_for(model, data, out, "vllm", **sets)
        self.tok = load_tokenizer(model)
        self.model = model
        prompts, plan, self.info, self.rejected = self.load(self.job)
        self.backend = VllmBackend(
            backend_config(self.job), lambda ids: detokenize(self.tok, [ids])[0], self.info
        )
        self.backend.check_fits(prompts, plan)

    def load(self, job):
        loaded, info = load_prompts(job.input, job.model, job.sampling, "vllm", self.tok)
        prompts = cap_to_context(loaded.prompts, info.max_model_len)
        return prompts, build_plan(prompts), info, loaded.rejected

    def run(self, job) -> dict[int, object]:
        prompts, plan, _, _ = self.load(job)
        b = self.backend
        cfg = b.cfg
        b.cfg = dataclasses.replace(cfg, sampling=job.sampling)
        done: dict[int, object] = {}
        try:
            b.run(prompts, plan, RunSink(lambda o: done.setdefault(o.row_id, o)))
        finally:
            b.cfg = cfg
        return done


@pytest.fixture(scope="module")
def engine(model_dir, per_row, tmp_path_factory):
    path, _ = per_row
    out = tmp_path_factory.mktemp("vllm") / "r.parquet"
    e = Engine(model_dir, path, out, **COLUMNS)
    yield e
    e.backend.close()


def _tokens(done) -> dict[int, list[int]]:
    return {r: o.token_ids.tolist() for r, o in done.items()}


def test_job_wide_settings_equal_native_and_change_the_output(
    engine, model_dir, plain, base, stop_id, tmp_path
):
    first = base[0]["output_token_ids"][0]
    vocab = sorted({t for r in base.values() for t in r["output_token_ids"]})
    text = base[0]["output_text"]
    cut = text[2:5]
    cases = {
        "presence": {"sampling.presence_penalty": "1.5"},
        "frequency": {"sampling.frequency_penalty": "1.5"},
        "repetition": {"sampling.repetition_penalty": "1.8"},
        "bias": {"sampling.logit_bias": f"{{{first} = -8.0, {vocab[3]} = 2.5}}"},
        "allowed": {"sampling.allowed_token_ids": str([v for v in vocab if v != first])},
        "min_tokens": {"sampling.min_tokens": "10", "sampling.stop_token_ids": f"[{stop_id}]"},
        "min_tokens_stop": {"sampling.min_tokens": "4", "sampling.stop": json.dumps([cut])},
        "min_p": {"sampling.min_p": "1.0", "sampling.temperature": "1.0", "sampling.seed": "3"},
    }
    stop_id_only = {"sampling.stop_token_ids": f"[{stop_id}]"}
    stopped = _native(model_dir, plain, tmp_path / "s.parquet", **stop_id_only)
    stop_only = {"sampling.stop": json.dumps([cut])}
    stop_text = _native(model_dir, plain, tmp_path / "st.parquet", **stop_only)
    for name, sets in cases.items():
        native = _native(model_dir, plain, tmp_path / f"{name}.parquet", **sets)
        done = engine.run(job_for(model_dir, plain, tmp_path / "v.parquet", "vllm", **sets))
        got = _tokens(done)
        assert got == {r: n["output_token_ids"] for r, n in native.items()}, name
        assert {r: o.finish_reason for r, o in done.items()} == {
            r: n["finish_reason"] for r, n in native.items()
        }, name
        reference = {"min_tokens": stopped, "min_tokens_stop": stop_text}.get(name, base)
        changed = [r for r in got if got[r] != reference[r]["output_token_ids"]]
        if name == "min_p":  # only the top token survives: the greedy outputs
            assert not changed
        else:
            assert changed, f"{name} changed no output"
        if name == "min_tokens_stop":
            texts = {r: o.text for r, o in done.items() if o.text is not None}
            assert texts == {r: n["output_text"] for r, n in native.items() if r in texts}


def test_per_row_settings_equal_native_and_bad_values_get_their_status(
    engine, model_dir, per_row, tmp_path
):
    path, kind = per_row
    native = _native(model_dir, path, tmp_path / "n.parquet", **COLUMNS)
    done = engine.run(engine.job)
    n = len(kind)
    statuses = {r["row_id"]: r["status"] for r in native.values() if r["row_id"] >= n}
    assert statuses == {n + j: status for j, (_, _, status) in enumerate(BAD)} | {
        n + len(BAD): "invalid_choice"
    }
    assert {int(r) for r in engine.rejected.row_ids} == set(statuses)  # the same on vLLM
    assert list(engine.rejected.status) == [statuses[int(r)] for r in engine.rejected.row_ids]
    # the reference: the same rows with their stop strings alone
    stopped = _native(model_dir, path, tmp_path / "s.parquet", **{"input.stop_column": "st"})
    changed: Counter[str] = Counter()
    for r in range(n):
        k, ours, theirs = kind[r], native[r], done[r]
        if k in ("regex", "choice"):  # every ok row matches, on both backends
            for text, status in (
                (ours["output_text"], ours["status"]),
                (theirs_text(engine, theirs), theirs.status or "ok"),
            ):
                want = matches(k, text) if status == "ok" else status == f"{k}_incomplete"
                assert want, (r, k, text, status, ours["output_token_ids"], theirs.token_ids)
            continue
        assert theirs.token_ids.tolist() == ours["output_token_ids"], (r, k)
        assert theirs.finish_reason == ours["finish_reason"], (r, k)
        if theirs.text is not None:  # a stop string cut it (past min_tokens)
            assert theirs.text == ours["output_text"], (r, k)
        if ours["output_token_ids"] != stopped[r]["output_token_ids"]:
            changed[k] += 1
    assert set(changed) == set(KINDS[:6]), changed  # each setting changed some row; min_p none


def theirs_text(engine, out) -> str:
    if out.text is not None:
        return out.text
    stops = {*engine.info.eos_token_ids, *engine.job.sampling.stop_token_ids}
    return detokenize(engine.tok, [[t for t in out.token_ids.tolist() if t not in stops]])[0]


def matches(kind: str, text: str) -> bool:
    return re.fullmatch(REGEX, text) is not None if kind == "regex" else text in CHOICES


def test_job_wide_choice_and_regex_every_ok_row_matches(engine, model_dir, plain, tmp_path):
    for kind, sets in (
        ("choice", {"sampling.choice": json.dumps(CHOICES)}),
        ("regex", {"sampling.regex": json.dumps(REGEX)}),
    ):
        done = engine.run(job_for(model_dir, plain, tmp_path / "g.parquet", "vllm", **sets))
        ok = [o for o in done.values() if o.status is None]
        assert len(ok) >= len(done) // 2, [
            (o.status, theirs_text(engine, o)) for o in done.values()
        ]
        for o in done.values():
            text = theirs_text(engine, o)
            assert matches(kind, text) if o.status is None else o.status == f"{kind}_incomplete"
        native = _native(model_dir, plain, tmp_path / f"n-{kind}.parquet", **sets)
        for r in native.values():
            if r["status"] == "ok":
                assert matches(kind, r["output_text"]), r["output_text"]


def test_settings_vllm_cannot_honour_are_exit_3(model_dir, plain, tmp_path):
    from batchjob.errors import ConfigError

    spec = '{speculative_config = {method = "ngram", num_speculative_tokens = 2}}'
    job = {"input.path": str(plain), "output.path": str(tmp_path / "o")}
    job |= {"engine.backend": "vllm", "engine.vllm": spec}
    for key, value in (
        ("sampling.min_p", "0.1"),
        ("sampling.logit_bias", "{5 = 1.0}"),
        ("input.min_p_column", "minp"),
    ):
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_job(None, job | {key: value})
    load_job(None, job | {"sampling.presence_penalty": "1.0"})  # the others it takes
