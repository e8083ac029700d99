"""output.reasoning_parser against vLLM: batchjob's split equals vLLM's own reasoning parsers
(``vllm.reasoning``, the same names) on the unit cases, on random marker soups and on the
outputs of a run; the vLLM backend with a reasoning parser and a guide (vLLM's
``structured_outputs_config.reasoning_parser``) writes what the native engine writes."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.backends.reasoning import REASONING_PARSERS, split_reasoning
from batchjob.runner.pipeline import run as run_job
from batchjob.testing.chain_model import make_chain_model
from tests.backends.vllm.vllm_kit import job_for, needs_vllm
from tests.e2e.test_reasoning import PLAIN, PROMPTS, REASONS, SPLIT_CASES

pytestmark = [needs_vllm, pytest.mark.slow]
COLUMNS = ["row_id", "reasoning_text", "output_text", "output_token_ids", "status"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return make_chain_model(tmp_path_factory.mktemp("chain") / "m", [REASONS, PLAIN], heads=2)


def _vllm_parser(name: str, model_path):
    from transformers import AutoTokenizer
    from vllm.reasoning import ReasoningParserManager

    tok = AutoTokenizer.from_pretrained(str(model_path))
    return ReasoningParserManager.get_reasoning_parser(name)(tok)


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_split_equals_vllm_parser(chain, name: str) -> None:
    parser = _vllm_parser(name, chain.path)
    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", "a", " b", "\n", "<", ">"]
    pieces += ["</", "think", "<function=f>", "<|im_end|>", "é", " "]
    rng = random.Random(0)
    texts = [c[0] for c in SPLIT_CASES]
    texts += ["".join(rng.choices(pieces, k=rng.randint(0, 10))) for _ in range(2000)]
    for text in texts:
        assert split_reasoning(name, text) == parser.extract_reasoning(text, None), text


def _run(chain, tmp_path, backend: str, name: str, **sets: str) -> list[dict]:
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), data)
    out = tmp_path / f"{backend}-{name}.parquet"
    job = job_for(chain.path, data, out, backend, **{"sampling.max_tokens": "16", **sets})
    res = run_job(job, progress=False)
    return pq.read_table(res.results_path).sort_by("row_id").to_pylist()


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_vllm_backend_reasoning_with_a_guide(chain, tmp_path, name: str) -> None:
    """The reasoning is free and the choice holds the answer on vLLM as on the native engine;
    the columns are vLLM's parser's split of the whole output's text."""
    from transformers import AutoTokenizer

    sets = {"output.reasoning_parser": name, "sampling.choice": '["yes", "no"]'}
    got = _run(chain, tmp_path, "vllm", name, **sets)
    want = _run(chain, tmp_path, "native", name, **sets)
    assert [{k: r[k] for k in COLUMNS} for r in got] == [{k: r[k] for k in COLUMNS} for r in want]
    assert got[0]["reasoning_text"] == " vana vunale nebulu"
    assert got[0]["output_text"] in {"yes", "no"}
    tok = AutoTokenizer.from_pretrained(str(chain.path))
    parser = _vllm_parser(name, chain.path)
    for r in got:
        whole = tok.decode(r["output_token_ids"], skip_special_tokens=True)
        assert (r["reasoning_text"], r["output_text"]) == parser.extract_reasoning(whole, None)
