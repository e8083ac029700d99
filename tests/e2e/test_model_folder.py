"""One model reader: `batchjob plan` and `batchjob run` see the same model folder.

Both report the same KV bytes per token for a bf16 checkpoint on CPU (dtype auto runs it in
float32 there), and both refuse the same broken folders with exit 5 and a one-line message.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.backends import open_backend
from batchjob.backends.native.engine import NATIVE_BLOCK_SIZE
from batchjob.cli import build_job, main
from batchjob.errors import EXIT_MODEL
from batchjob.model.info import DTYPE_BYTES, auto_cpu_dtype
from batchjob.runner.execute import backend_config
from batchjob.runner.pipeline import run
from batchjob.testing.tiny_model import make_tiny_model
from batchjob.testing.workloads import WORDS

pytest.importorskip("transformers")

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # make_tiny_model's defaults: hidden 64, 4 heads, 2 kv


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = [" ".join(WORDS[i : i + 16]) for i in range(0, len(WORDS), 16)]
    folder = tmp_path_factory.mktemp("bf16") / "tiny"
    return make_tiny_model(folder, vocab_size=600, corpus=corpus, dtype="bfloat16")


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sharded") / "tiny"
    return make_tiny_model(folder, vocab_size=300, max_shard_size="60KB")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    doc = " ".join(WORDS[:40])
    texts = [f"{doc} {' '.join(WORDS[100 + 5 * q : 105 + 5 * q])}" for q in range(6)]
    path = tmp_path_factory.mktemp("data") / "prompts.parquet"
    pq.write_table(pa.table({"prompt": texts}), path)
    return path


def job_file(tmp: Path, model: Path, data: Path, dtype: str = "auto") -> Path:
    job = tmp / f"job-{dtype}.toml"
    job.write_text(
        f'[input]\npath = "{data}"\n'
        f'[model]\npath = "{model}"\ndtype = "{dtype}"\ndevice = "cpu"\n'
        "[sampling]\nmax_tokens = 4\n"
        '[engine]\nkv_cache_bytes = "4MiB"\nthreads = 1\n'
        f'[output]\npath = "{tmp / "out" / "results.parquet"}"\n'
    )
    return job


def invoke(*args: str | Path):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# auto on CPU: this bf16 checkpoint runs in bf16 where the CPU has bf16 hardware, else float32
@pytest.mark.parametrize(
    "dtype,itemsize", [("auto", DTYPE_BYTES[auto_cpu_dtype("bfloat16")]), ("bfloat16", 2)]
)
def test_plan_and_run_report_the_same_kv_bytes_per_token(
    tmp_path: Path, bf16_model: Path, prompts: Path, dtype: str, itemsize: int
) -> None:
    assert json.loads((bf16_model / "config.json").read_text())["dtype"] == "bfloat16"
    want = 2 * LAYERS * KV_HEADS * HEAD_DIM * itemsize  # plan, engine and report agree
    job = job_file(tmp_path, bf16_model, prompts, dtype)

    r = invoke("plan", job, "--json")
    assert r.exit_code == 0, r.output
    kv = json.loads(r.stdout)["kv"]
    assert kv["bytes_per_token"] == want
    assert kv["dtype"] == ("float32" if itemsize == 4 else "bfloat16") and kv["device"] == "cpu"

    # the engine's own number and the cache it really allocated
    backend = open_backend(backend_config(build_job(str(job))), lambda ids: "")
    try:
        engine = backend.engine
        assert engine.info.kv_bytes_per_token == want
        cache = engine.kv_cache  # [L, 2, blocks, block_size, Hkv, D]
        assert cache.element_size() == itemsize
        assert cache.numel() * cache.element_size() // (cache.shape[2] * cache.shape[3]) == want
    finally:
        backend.close()

    # the run report: KV bytes in use per iteration over the tokens those blocks hold
    res = run(build_job(str(job)), progress=False)
    iters = pq.read_table(res.report_paths["iterations"]).to_pylist()
    used = [it for it in iters if it["kv_blocks_used"] > 0]
    assert used
    block_size = build_job(str(job)).engine.block_size or NATIVE_BLOCK_SIZE  # unset: native's
    for it in used:
        assert it["kv_bytes_used"] == it["kv_blocks_used"] * block_size * want


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _unknown_architecture(m: Path) -> str:
    cfg = json.loads((m / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (m / "config.json").write_text(json.dumps(cfg))
    return "unsupported architecture ['GPT2LMHeadModel']"


def _missing_weights(m: Path) -> str:
    (m / "model.safetensors").unlink()
    return "no model.safetensors"


def _truncated_weights(m: Path) -> str:
    w = m / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])  # an interrupted download
    return "model.safetensors: truncated"


def _garbage_header(m: Path) -> str:
    w = m / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[8:16] = b"\xff" * 8  # the JSON header no longer parses
    w.write_bytes(bytes(data))
    return "safetensors header does not parse"


def _empty_weights(m: Path) -> str:
    (m / "model.safetensors").write_bytes(b"")
    return "truncated safetensors file (0 bytes)"


def _config_edit(key: str, value: object, needle: str):
    """config.json against its weights (issue 49: exit 3 blaming engine.kv_cache_bytes for
    -1 layers, exit 6 blaming the data for a small vocab_size, a run for dtype float33)."""

    def edit(m: Path) -> str:
        cfg = json.loads((m / "config.json").read_text())
        cfg.pop("dtype", None) if key == "torch_dtype" else None
        (m / "config.json").write_text(json.dumps({**cfg, key: value}))
        return needle

    return edit


BROKEN = {
    "negative-layers": _config_edit("num_hidden_layers", -1, "num_hidden_layers is -1"),
    "small-vocab": _config_edit("vocab_size", 100, "vocab_size 100 is smaller than the"),
    "unknown-dtype": _config_edit("torch_dtype", "float33", "'float33' is not a dtype"),
    "zero-heads": _config_edit("num_attention_heads", 0, "num_attention_heads is 0"),
    "unknown-architecture": _unknown_architecture,
    "missing-weights": _missing_weights,
    "truncated-weights": _truncated_weights,
    "garbage-header": _garbage_header,
    "empty-weights": _empty_weights,
}


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case", list(BROKEN))
def test_plan_refuses_what_run_refuses(
    tmp_path: Path, bf16_model: Path, prompts: Path, command: str, case: str
) -> None:
    model = _copy(bf16_model, tmp_path / "m")
    needle = BROKEN[case](model)
    r = invoke(command, job_file(tmp_path, model, prompts))
    assert r.exit_code == EXIT_MODEL, r.output
    assert r.stderr.startswith("error: ") and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert r.stdout == ""


@pytest.mark.parametrize("command", ["plan", "run"])
def test_sharded_checkpoint_with_a_missing_or_truncated_shard(
    tmp_path: Path, sharded_model: Path, prompts: Path, command: str
) -> None:
    model = _copy(sharded_model, tmp_path / "m")
    shards = sorted(model.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    ok = invoke("plan", job_file(tmp_path, model, prompts))
    assert ok.exit_code == 0, ok.output
    shards[0].write_bytes(shards[0].read_bytes()[:-100])
    shards[-1].unlink()
    for needle in (f"lists shard {shards[-1].name}, which is missing", "truncated"):
        r = invoke(command, job_file(tmp_path, model, prompts))
        assert r.exit_code == EXIT_MODEL, r.output
        assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
        shards[-1].write_bytes(b"")  # next round: present but empty -> truncated
