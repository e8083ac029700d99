"""Shared fixtures: a tiny tokenizer/model folder built locally, and small Parquet datasets.

Nothing is downloaded: the tokenizer is a ByteLevel BPE trained here with ``tokenizers`` on
text made of the workload generator's word list, so most words are single tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from batchjob.config import load_job
from batchjob.testing.tiny_model import write_random_weights
from batchjob.testing.workloads import WORDS
from batchjob.tokenize.batched import TokenizedInput, load_prompts

# Two xdist workers on two cores: one torch thread each, or tiny matmuls oversubscribe.
torch.set_num_threads(1)

TINY_VOCAB = 3000
TINY_MAX_LEN = 4096
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2


def train_tiny_tokenizer(vocab_size: int = TINY_VOCAB, seed: int = 0) -> Tokenizer:
    """ByteLevel BPE (Llama-3/Qwen style) whose post-processor prepends <s>."""
    rng = np.random.default_rng(seed)
    words = np.asarray(WORDS, dtype=object)
    corpus = [" ".join(words[rng.integers(0, len(words), 64)]) for _ in range(400)]
    corpus += [" ".join(WORDS[i : i + 64]) for i in range(0, len(WORDS), 64)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def write_model_folder(
    folder: Path,
    tokenizer: Tokenizer | None,
    tokenizer_config: dict | None = None,
    max_len: int = TINY_MAX_LEN,
) -> Path:
    """A HF-style folder: config.json (tiny Llama numbers), random weights, tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_len,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    write_random_weights(folder, config)  # plan checks the weights as run does
    if tokenizer is not None:
        tokenizer.save(str(folder / "tokenizer.json"))
        tc = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            **(tokenizer_config or {}),
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return train_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Tokenizer) -> Path:
    """Model folder: config.json (vocab 3000, context 4096, 2 layers, 2 KV heads of 16 dims,
    float32), random weights + tokenizer.json (BOS prepended) + tokenizer_config.json."""
    return write_model_folder(tmp_path_factory.mktemp("tiny-model"), tiny_tokenizer)


def write_parquet(table: pa.Table, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def load_rows(tmp: Path, data: Path, model: Path, **sets: str) -> TokenizedInput:
    """What ``load_prompts`` (native backend) reads from ``data`` for ``model``: a job with
    its output under ``tmp`` and ``sets`` (job keys) on top."""
    over = {"input.path": str(data), "model.path": str(model), "output.path": str(tmp / "o")}
    job = load_job(None, {**over, **sets})
    return load_prompts(job.input, job.model, job.sampling, "native")[0]


@pytest.fixture
def text_table() -> pa.Table:
    """12 rows of text: 3 documents x 4 questions, with ids and a max_tokens column."""
    rows = []
    for d in range(3):
        doc = " ".join(WORDS[d * 50 : d * 50 + 40])
        for q in range(4):
            rows.append((d * 4 + q, doc + " " + " ".join(WORDS[1000 + q * 7 : 1000 + q * 7 + 5])))
    return pa.table(
        {
            "id": pa.array([r[0] for r in rows], pa.int64()),
            "prompt": pa.array([r[1] for r in rows], pa.string()),
            "max_tokens": pa.array([8] * len(rows), pa.int32()),
        }
    )
