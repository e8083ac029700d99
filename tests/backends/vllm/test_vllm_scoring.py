"""Scoring mode on the vLLM backend: ``label_logprobs`` and ``label`` equal the
native engine's within 1e-3 and the sum of HF transformers' log-softmax over each label's
tokens (teacher-forced after the prompt), for single- and multi-token labels (shared first
token included) and per-row labels; the rows of a group share their prompt through vLLM's
prefix cache (achieved saving > 0)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchjob.runner.pipeline import run as run_job
from batchjob.testing.workloads import WORDS
from batchjob.tokenize.tokenizer import load_tokenizer
from tests.backends.vllm.vllm_kit import job_for, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]

transformers = pytest.importorskip("transformers")

SINGLE = [f" {WORDS[3]}", f" {WORDS[7]}", f" {WORDS[40]}"]
MULTI = [f" {WORDS[3]} {WORDS[9]}", f" {WORDS[3]} {WORDS[11]}", f" {WORDS[7]}", f" {WORDS[40]}"]


def scored(model, data, out, backend, **sets):
    res = run_job(job_for(model, data, out, backend, **sets), progress=False)
    rows = pq.read_table(res.results_path).sort_by("row_id").to_pylist()
    return rows, res.summary


def hf_label_logprobs(hf, prompt: list[int], labels: list[list[int]]) -> list[float]:
    out = []
    for lab in labels:
        with torch.no_grad():
            logits = hf(torch.tensor(prompt + lab)[None]).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        out.append(sum(float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(lab)))
    return out


def test_vllm_scoring_equals_native_and_hf(model_dir, dataset, tmp_path):
    """Multi-token labels sharing a first token, beside single-token ones (one vLLM start:
    single-token-only rows are in test_vllm_per_row_labels)."""
    labels = MULTI
    sets = {"sampling.labels": json.dumps(labels)}
    native, _ = scored(model_dir, dataset, tmp_path / "n.parquet", "native", **sets)
    vllm, summary = scored(model_dir, dataset, tmp_path / "v.parquet", "vllm", **sets)
    tok = load_tokenizer(model_dir)
    label_ids = [tok.tokenizer.encode(s, add_special_tokens=False).ids for s in labels]
    assert len(label_ids[0]) > 1 and label_ids[0][0] == label_ids[1][0]
    assert len(label_ids[2]) == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = pq.read_table(dataset).column("prompt").to_pylist()
    assert len(native) == len(vllm) == len(prompts)
    for a, b in zip(native, vllm, strict=True):
        assert b["status"] == "ok" and b["finish_reason"] == "score"
        np.testing.assert_allclose(b["label_logprobs"], a["label_logprobs"], atol=1e-3)
        assert b["label"] == a["label"] == labels[int(np.argmax(b["label_logprobs"]))]
    for b in vllm[:6]:  # the reference itself, on a few rows
        ids = tok.tokenizer.encode(prompts[b["row_id"]]).ids
        np.testing.assert_allclose(
            b["label_logprobs"], hf_label_logprobs(hf, ids, label_ids), atol=1e-3
        )
    assert summary.saving_ratio_achieved > 0.2  # prompts shared through the prefix cache


def test_vllm_per_row_labels(model_dir, dataset, tmp_path):
    data = pq.read_table(dataset)
    own = [MULTI if i % 3 == 0 else None for i in range(data.num_rows)]
    path = tmp_path / "labels.parquet"
    pq.write_table(data.append_column("labs", pa.array(own, pa.list_(pa.string()))), path)
    sets = {"input.labels_column": "labs", "sampling.labels": json.dumps(SINGLE)}
    native, _ = scored(model_dir, path, tmp_path / "n.parquet", "native", **sets)
    vllm, _ = scored(model_dir, path, tmp_path / "v.parquet", "vllm", **sets)
    for i, (a, b) in enumerate(zip(native, vllm, strict=True)):
        assert len(b["label_logprobs"]) == len(MULTI if i % 3 == 0 else SINGLE)
        np.testing.assert_allclose(b["label_logprobs"], a["label_logprobs"], atol=1e-3)
        assert b["label"] == a["label"]
