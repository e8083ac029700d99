"""vLLM's output-text settings on the vLLM backend, equal to the native engine's
(tests/e2e/test_text_settings.py): ``skip_special_tokens`` and ``include_stop_str_in_output``
in one job (a row whose EOS is forced, rows cut by a stop string), ``bad_words`` (the token
ids vLLM's SamplingParams makes, the same outputs); and
``scheduler.max_num_seqs`` reaching vLLM under the batchllm policy (it was dropped)."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.backends.vllm.engine_args import BATCHLLM_MAX_SEQS, engine_settings
from batchjob.runner.execute import backend_config
from batchjob.runner.pipeline import run as run_job
from batchjob.testing.workloads import WORDS
from batchjob.tokenize.bad_words import bad_words_token_ids
from batchjob.tokenize.tokenizer import load_tokenizer
from tests.backends.vllm.vllm_kit import both_results, job_for, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]


def test_max_num_seqs_reaches_vllm_under_batchllm(tmp_path, model_dir, dataset):
    job = job_for(model_dir, dataset, tmp_path / "o.parquet", "vllm")
    cfg = backend_config(job)
    seqs = engine_settings(cfg, "float32", 64).kwargs["max_num_seqs"]
    assert seqs == min(BATCHLLM_MAX_SEQS, 256)  # chunk_size: vLLM wants slots <= it
    capped = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, max_num_seqs=3))
    assert engine_settings(capped, "float32", 64).kwargs["max_num_seqs"] == 3


def test_text_settings_equal_native(tmp_path, model_dir):
    eos = load_tokenizer(model_dir).eos_token_id
    prompts = [" ".join(WORDS[i : i + 6]) for i in range(0, 30, 6)]
    bias = [[(eos, 100.0)]] + [None] * (len(prompts) - 1)  # row 0: EOS at once
    data = tmp_path / "p.parquet"
    table = pa.table({"prompt": prompts, "bias": pa.array(bias, pa.map_(pa.int32(), pa.float64()))})
    pq.write_table(table, data)
    free = run_job(job_for(model_dir, data, tmp_path / "free.parquet", "native"), progress=False)
    texts = pq.read_table(free.results_path).column("output_text").to_pylist()
    stop = " " + texts[1].split()[1]  # cuts row 1 (and any row with it)
    sets = {
        "input.logit_bias_column": "bias",
        "sampling.stop": f'["{stop}"]',
        "sampling.include_stop_str_in_output": "true",
        "sampling.skip_special_tokens": "false",
    }
    out = both_results(model_dir, data, tmp_path, **sets)
    assert out["vllm"] == out["native"]
    rows = out["vllm"]
    assert rows[0]["output_token_ids"] == [eos] and rows[0]["output_text"] == "</s>"
    assert rows[1]["output_text"] == texts[1][: texts[1].find(stop) + len(stop)]


def test_bad_words_token_ids_are_vllms(model_dir):
    """The sequences batchjob bans are the ones vLLM's SamplingParams makes from the words
    with the model's tokenizer (vLLM's backend runs without one: batchjob gives them)."""
    from vllm import SamplingParams
    from vllm.tokenizers.registry import get_tokenizer

    hf = get_tokenizer(str(model_dir))  # what vLLM's engine loads for the model
    words = [WORDS[3], " " + WORDS[40], WORDS[7] + " " + WORDS[8]]
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(hf)
    ours = bad_words_token_ids(load_tokenizer(model_dir), words)
    assert [list(w) for w in ours] == params.bad_words_token_ids


def test_bad_words_equal_native(tmp_path, model_dir, dataset):
    free = run_job(job_for(model_dir, dataset, tmp_path / "free.parquet", "native"), progress=False)
    tok = load_tokenizer(model_dir)
    ids = pq.read_table(free.results_path).column("output_token_ids").to_pylist()
    words = {tok.tokenizer.decode(r[i : i + 2]) for r in ids for i in range(len(r) - 1)}
    words = sorted(w for w in words if w.isalpha())[:3]  # spans the free run generated
    assert words
    sets = {"sampling.bad_words": "[" + ", ".join(f'"{w}"' for w in words) + "]"}
    out = both_results(model_dir, dataset, tmp_path, "bw-", **sets)
    assert out["vllm"] == out["native"]
    assert [r["output_token_ids"] for r in out["native"]] != ids
