from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from batchjob.config import InputConfig, SamplingConfig, load_job
from batchjob.errors import ModelError
from batchjob.inputs.parquet import open_dataset
from batchjob.status import (
    STATUS_EMPTY_PROMPT,
    STATUS_INVALID_MAX_TOKENS,
    STATUS_INVALID_TOKENS,
    STATUS_PROMPT_TOO_LONG,
)
from batchjob.testing.workloads import WORDS
from batchjob.tokenize.batched import load_prompts, tokenize_dataset
from batchjob.tokenize.tokenizer import detokenize, load_tokenizer
from tests.conftest import TINY_MAX_LEN, TINY_VOCAB, write_model_folder, write_parquet

TEXTS = [
    "hello world",
    " ".join(WORDS[:30]),
    "Document: tiny fox.\nQuery: what?",
    "héllo wörld — ünïcode ✓",
    "<s> literal special token text",
]


def hf_ids(model_dir: Path, texts: list[str]) -> list[list[int]]:
    """What transformers feeds the model for `tokenizer(text)` (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(texts)["input_ids"]


@pytest.mark.parametrize(
    "post_processor,tokenizer_config",
    [
        (True, {}),
        (True, {"add_bos_token": False}),  # ignored when tokenizer.json exists (transformers 5)
        (False, {"add_bos_token": True, "add_eos_token": True}),
    ],
    ids=["bos", "bos-flag-ignored", "no-post-processor"],
)
def test_text_matches_transformers(
    tmp_path: Path, tiny_tokenizer: Tokenizer, post_processor: bool, tokenizer_config: dict
) -> None:
    tk = Tokenizer.from_str(tiny_tokenizer.to_str())
    if not post_processor:
        tk.post_processor = None
    model = write_model_folder(tmp_path / "m", tk, tokenizer_config)
    tok = load_tokenizer(model)
    tokens, lengths = tok.encode(TEXTS)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    got = [tokens[a:b].tolist() for a, b in pairwise(offsets)]
    assert got == hf_ids(model, TEXTS)
    assert (got[0][0] == tok.bos_token_id == 1) == post_processor
    assert got[0][-1] != tok.eos_token_id


def test_dataset_text_to_tokenized_prompts(tmp_path: Path, tiny_model_dir: Path) -> None:
    t = pa.table({"prompt": TEXTS * 3, "max_tokens": pa.array([5, None, 7] * 5, pa.int64())})
    p = write_parquet(t, tmp_path / "t.parquet")
    ds = open_dataset(InputConfig(path=str(p), batch_rows=4))
    res = tokenize_dataset(
        ds,
        load_tokenizer(tiny_model_dir),
        default_max_tokens=11,
        max_model_len=TINY_MAX_LEN,
        vocab_size=TINY_VOCAB,
    )
    pr = res.prompts
    assert len(pr) == 15 and len(res.rejected) == 0 and res.num_rows == 15
    assert pr.row_ids.tolist() == list(range(15))
    assert pr.tokens.dtype == np.int32 and pr.offsets.dtype == np.int64
    assert pr.max_tokens.tolist() == [5, 11, 7] * 5
    want = hf_ids(tiny_model_dir, TEXTS * 3)
    assert [pr.row(i).tolist() for i in range(15)] == want
    assert res.tokenize.tokens == sum(map(len, want)) and res.tokenize.tokens_per_s > 0
    assert res.read.rows == 15 and res.passthrough.num_rows == 15


def test_detokenize_round_trip(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    tokens, lengths = tok.encode(TEXTS)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    seqs = [tokens[a:b] for a, b in pairwise(offsets)]
    # skip_special_tokens drops the BOS (and the literal "<s>" typed in the last text)
    out = detokenize(tok, seqs)
    assert out[:4] == TEXTS[:4] and out[4] == " literal special token text"
    assert detokenize(
        tok.tokenizer, [s.tolist() for s in seqs], SamplingConfig(skip_special_tokens=False)
    )[0] == ("<s>" + TEXTS[0])


def test_per_row_rejects_text(tmp_path: Path, tiny_model_dir: Path) -> None:
    long_text = " ".join(WORDS[:200])
    t = pa.table(
        {
            "prompt": ["ok one", None, "", long_text, "ok two", "ok three"],
            "max_tokens": pa.array([1, 1, 1, 1, 0, -3], pa.int32()),
        }
    )
    p = write_parquet(t, tmp_path / "r.parquet")
    ds = open_dataset(InputConfig(path=str(p), batch_rows=4))
    res = tokenize_dataset(
        ds, load_tokenizer(tiny_model_dir), default_max_tokens=9, max_model_len=50, vocab_size=None
    )
    assert res.prompts.row_ids.tolist() == [0]
    rj = res.rejected
    assert rj.row_ids.tolist() == [1, 2, 3, 4, 5]
    assert rj.status == (
        STATUS_EMPTY_PROMPT,
        STATUS_EMPTY_PROMPT,
        STATUS_PROMPT_TOO_LONG,
        STATUS_INVALID_MAX_TOKENS,
        STATUS_INVALID_MAX_TOKENS,
    )
    assert rj.message[0].startswith("row 1 (file r.parquet, row 1)") and "'prompt'" in rj.message[0]
    assert "exceeds max_model_len - 1 = 49" in rj.message[2]
    assert rj.message[4].startswith("row 5 (file r.parquet, row 5)")  # second batch
    assert "max_tokens -3" in rj.message[4]
    assert res.passthrough.num_rows == 6  # rejected rows still pass their columns through


def test_per_row_rejects_ids(tmp_path: Path) -> None:
    prompts = pa.array(
        [[5, 6, 7], None, [], [1, 99], [3, None], [-1, 4], list(range(10, 20)), [8]],
        pa.list_(pa.int64()),
    )
    p = write_parquet(pa.table({"prompt": prompts}), tmp_path / "ids.parquet")
    ds = open_dataset(InputConfig(path=str(p), batch_rows=3))
    res = tokenize_dataset(
        ds, None, default_max_tokens=4, max_model_len=10, vocab_size=50
    )  # prompt limit 9 tokens
    assert res.prompts.row_ids.tolist() == [0, 7]
    assert [res.prompts.row(i).tolist() for i in range(2)] == [[5, 6, 7], [8]]
    assert res.prompts.max_tokens.tolist() == [4, 4]
    assert dict(zip(res.rejected.row_ids.tolist(), res.rejected.status, strict=True)) == {
        1: STATUS_EMPTY_PROMPT,
        2: STATUS_EMPTY_PROMPT,
        3: STATUS_INVALID_TOKENS,
        4: STATUS_INVALID_TOKENS,
        5: STATUS_INVALID_TOKENS,
        6: STATUS_PROMPT_TOO_LONG,
    }
    assert "outside [0, 50)" in res.rejected.message[2]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12), min_size=1),
    batch_rows=st.integers(1, 7),
    itype=st.sampled_from([pa.int32(), pa.int64(), pa.uint32()]),
)
def test_id_column_is_copied_exactly(
    tmp_path_factory: pytest.TempPathFactory, rows: list[list[int]], batch_rows: int, itype
) -> None:
    p = write_parquet(
        pa.table({"prompt": pa.array(rows, pa.list_(itype))}),
        tmp_path_factory.mktemp("h") / "x.parquet",
    )
    ds = open_dataset(InputConfig(path=str(p), batch_rows=batch_rows))
    res = tokenize_dataset(ds, None, default_max_tokens=3, max_model_len=None, vocab_size=None)
    assert [res.prompts.row(i).tolist() for i in range(len(rows))] == rows
    assert res.prompts.row_ids.tolist() == list(range(len(rows)))


def test_load_prompts_from_job(tmp_path: Path, tiny_model_dir: Path) -> None:
    p = write_parquet(pa.table({"prompt": ["a b c", "d"]}), tmp_path / "in.parquet")
    job_keys = {
        "input.path": str(p),
        "output.path": str(tmp_path / "o"),
        "model.path": str(tiny_model_dir),
    }
    job = load_job(None, job_keys)
    res, info = load_prompts(job.input, job.model, job.sampling, "native")
    assert len(res.prompts) == 2 and info is not None and info.vocab_size == TINY_VOCAB
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K+V, layers, kv heads, dim, fp32
    assert info.max_model_len == TINY_MAX_LEN and info.dtype == "float32"
    bf16 = load_job(None, {**job_keys, "model.dtype": "bfloat16", "model.max_model_len": "9"})
    res16, info16 = load_prompts(
        bf16.input, bf16.model, bf16.sampling, "native", load_tokenizer(tiny_model_dir)
    )
    assert info16.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2 and info16.max_model_len == 9
    assert res16.prompts.row_ids.tolist() == res.prompts.row_ids.tolist()
    no_model = load_job(None, {"input.path": str(p), "output.path": str(tmp_path / "o")})
    with pytest.raises(ModelError, match=r"model\.path"):
        load_prompts(no_model.input, no_model.model, no_model.sampling, "native")


def test_model_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"tokenizer\.json"):
        load_tokenizer(write_model_folder(tmp_path / "m", None))
    with pytest.raises(ModelError, match=r"model\.path: required"):
        load_tokenizer(None)
    # the model folder itself: tests/model/test_model_info.py
