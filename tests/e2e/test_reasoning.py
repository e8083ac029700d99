"""output.reasoning_parser: the <think> part to reasoning_text, the answer to output_text, the
grammar of a constrained row after the reasoning, on a forced-token model (its greedy output
is known: batchjob.testing.chain_model) run by the native engine.

The split's cases are vLLM 0.32's parsers' answers (tests/backends/vllm/test_vllm_reasoning.py
asks vLLM's parsers the same cases and compares)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

import batchjob
from batchjob.backends.reasoning import reasoning_markers, split_reasoning
from batchjob.errors import ConfigError
from batchjob.testing.chain_model import make_chain_model
from tests.e2e.jobkit import ROOT, cli, read_results, write_job

# (prompt tail, greedy output) of the forced-token model; the second chain does not reason
REASONS = (" ornu unra di.", "<think> vana vunale nebulu</think> doda kovodo")
PLAIN = (" vulu de", " tiri")
PROMPTS = ["Lomiru nesa ornu unra di.", "Sama ornu unra di.", "Luku vulu de"]

# (text, deepseek_r1's split, qwen3's split) as vLLM's parsers answer
SPLIT_CASES = [
    ("<think>abc</think>def", ("abc", "def"), ("abc", "def")),
    ("abc</think>def", ("abc", "def"), ("abc", "def")),
    ("<think>abc", ("abc", None), ("abc", None)),
    ("abc", ("abc", None), ("abc", None)),
    ("", ("", None), (None, None)),
    ("</think>", ("", None), (None, None)),
    ("<think>abc</think>", ("abc", None), ("abc", None)),
    ("x<think>abc</think>def</think>g", ("abc", "def</think>g"), ("xabc", "defg")),
    ("<think>a<think>b</think>c", ("a<think>b", "c"), ("ab", "c")),
    ("<think>a</think>b<think>c</think>d", ("a", "b<think>c</think>d"), ("a", "b<think>cd")),
    ("<think>a<tool_call>b</think>c", ("a<tool_call>b", "c"), ("a", "<tool_call>bc")),
    ("a<think>", ("", None), ("a", None)),
    ("<think>a</think", ("a</think", None), ("a</think", None)),
    (" <think>\nr\n</think>\n\nans", ("\nr\n", "\n\nans"), (" \nr\n", "\n\nans")),
]


@pytest.mark.parametrize(("text", "deepseek", "qwen3"), SPLIT_CASES)
def test_split_as_vllm_parsers(text, deepseek, qwen3) -> None:
    assert split_reasoning("deepseek_r1", text) == deepseek
    assert split_reasoning("qwen3", text) == qwen3


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory):
    return make_chain_model(tmp_path_factory.mktemp("chain") / "m", [REASONS, PLAIN])


def _tok(chain) -> Tokenizer:
    return Tokenizer.from_file(str(chain.path / "tokenizer.json"))


def test_prompt_markers_decide_where_the_grammar_starts(chain) -> None:
    """A prompt whose last marker is </think> has ended its reasoning (vLLM's
    is_reasoning_end); qwen3's scan stops at a chat turn boundary."""
    tok = _tok(chain)
    prompts = ["a b", "a <think> b", "<think> a </think> b", "</think> x <think>", "</think>"]
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    offsets = np.cumsum([0, *map(len, ids)])
    flat = np.concatenate([np.asarray(i, dtype=np.int32) for i in ids])
    for parser in ("deepseek_r1", "qwen3"):
        m = reasoning_markers(parser, tok)
        assert m.open_after(flat, offsets).tolist() == [True, True, False, True, False]


def test_tokenizer_without_markers_is_refused(tmp_path: Path) -> None:
    plain = make_chain_model(tmp_path / "plain", [PLAIN], added_tokens=())
    with pytest.raises(ValueError, match="no <think> token"):
        reasoning_markers("deepseek_r1", _tok(plain))
    with pytest.raises(ConfigError, match=r"output\.reasoning_parser: .*no <think> token"):
        batchjob.generate(
            PROMPTS,
            model={"path": str(plain.path), "device": "cpu"},
            output={"reasoning_parser": "qwen3"},
        )
    with pytest.raises(ConfigError, match=r"output\.reasoning_parser: must be one of"):
        batchjob.generate(PROMPTS, model=str(plain.path), output={"reasoning_parser": "r1"})


def _generate(chain, parser: str | None, **sampling):
    return batchjob.generate(
        PROMPTS,
        model={"path": str(chain.path), "device": "cpu"},
        sampling={"max_tokens": 16, **sampling},
        engine={"threads": 1},
        **({"output": {"reasoning_parser": parser}} if parser else {}),
    ).to_pylist()


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_split_into_its_column(chain, parser: str) -> None:
    rows = _generate(chain, parser)
    whole = _generate(chain, None)
    assert whole[0]["output_text"] == REASONS[1]  # the forced output, unsplit
    assert "reasoning_text" not in whole[0]
    for r, w in zip(rows, whole, strict=True):
        assert (r["reasoning_text"], r["output_text"]) == split_reasoning(parser, w["output_text"])
        assert r["output_token_ids"] == w["output_token_ids"]  # the tokens stay whole
    assert rows[0]["reasoning_text"] == " vana vunale nebulu"
    assert rows[0]["output_text"] == " doda kovodo"
    # the row that does not reason: deepseek_r1 calls it all reasoning, as vLLM does
    assert split_reasoning(parser, " tiri") == (" tiri", None)
    assert (rows[2]["reasoning_text"], rows[2]["output_text"]) == (" tiri", None)


def test_max_tokens_counts_reasoning_and_answer(chain) -> None:
    rows = _generate(chain, "deepseek_r1", max_tokens=3)
    assert rows[0]["num_output_tokens"] == 3 and rows[0]["finish_reason"] == "length"
    assert rows[0]["reasoning_text"] == " vana vunale" and rows[0]["output_text"] is None


@pytest.mark.parametrize(
    ("guide", "answer"),
    [
        ({"choice": ["yes", "no"]}, {"yes", "no"}),
        (
            {
                "json_schema": '{"type":"object","properties":{"a":{"enum":["x"]}},'
                '"required":["a"],"additionalProperties":false}'
            },
            {'{"a":"x"}'},
        ),
    ],
)
def test_grammar_applies_after_the_reasoning(chain, guide, answer) -> None:
    """The reasoning runs free (its words match no guide), then the guide holds the answer;
    a row that never ends its reasoning within max_tokens is incomplete."""
    rows = _generate(chain, "deepseek_r1", **guide)
    for r in rows[:2]:
        assert r["status"] == "ok", r["message"]
        assert r["reasoning_text"] == " vana vunale nebulu"
        assert r["output_text"] in answer
    # the plain row ends at once (EOS, free while reasoning): no answer for its guide
    assert rows[2]["status"].endswith("_incomplete")
    assert "the reasoning did not end" in rows[2]["message"]
    short = _generate(chain, "deepseek_r1", max_tokens=4, **guide)
    assert short[0]["status"].endswith("_incomplete") and short[0]["finish_reason"] == "length"


def test_job_writes_reasoning_text_and_openai_reasoning_content(chain, tmp_path: Path) -> None:
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), data)
    out = tmp_path / "out.parquet"
    job = write_job(
        tmp_path, chain.path, data, out, reasoning_parser='"qwen3"', format='"openai-jsonl"'
    )
    r = cli("run", job)
    assert r.exit_code == 0, r.output
    res = read_results(out)
    assert res.column_names[:3] == ["row_id", "reasoning_text", "output_text"]
    assert res["reasoning_text"][0].as_py() == " vana vunale nebulu"  # max_tokens = 6
    assert res["output_text"][0].as_py() == " doda"
    lines = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    assert lines[0]["response"]["body"]["choices"][0]["reasoning_content"] == " vana vunale nebulu"
    # the parser is part of the job's identity: another one is another job's output
    job2 = write_job(tmp_path, chain.path, data, out, reasoning_parser='"deepseek_r1"')
    r2 = cli("run", job2)
    assert r2.exit_code == 3 and "output.reasoning_parser" in r2.output


def test_reasoning_example_job(chain, tmp_path: Path) -> None:
    """jobs/reasoning.toml on the forced-token model in place of Qwen3 (its questions end as
    the model's chain starts: "."), the chat template off."""
    data = tmp_path / "questions.parquet"
    questions = ["Ornu unra di.", "Vana di."]
    pq.write_table(pa.table({"question_id": [7, 9], "question": questions}), data)
    out = tmp_path / "reasoning.parquet"
    sets = [f"model.path={chain.path}", "model.chat_template=none", f"input.path={data}"]
    sets += [f"output.path={out}", "engine.kv_cache_bytes=8MiB", "engine.threads=1"]
    r = cli("run", ROOT / "jobs" / "reasoning.toml", *[a for s in sets for a in ("--set", s)])
    assert r.exit_code == 0, r.output
    for row in read_results(out).to_pylist():
        assert row["status"] == "ok", row["message"]
        assert row["reasoning_text"] == " vana vunale nebulu"
        assert row["output_text"] in ("yes", "no")
