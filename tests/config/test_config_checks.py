"""Every value a lower layer would refuse is refused by ``load_job`` (exit 3, the key named).

The native engine, scheduler and sampler take the job's sections as they are, so their checks
are the config's: a bad value fails before any data is read or any model is loaded. And each
setting is declared (with its default) once, in batchjob/config/sections.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchjob import config
from batchjob.backends.names import ATTENTION_BACKENDS, BACKENDS, SCHEDULING_POLICIES
from batchjob.cli import main
from batchjob.config import EngineConfig, SchedulerConfig, load_job
from batchjob.errors import EXIT_CONFIG, ConfigError
from batchjob.runner.execute import backend_config

ROOT = Path(__file__).resolve().parents[2]
BASE = {"input.path": "in.parquet", "output.path": "out"}

# (overrides, the key the error must name): each was accepted by the config, or refused only
# by a lower layer (sampler, scheduler, KV pool, attention registry, backend factory)
BAD = [
    ({"sampling.stop": '[""]'}, "sampling.stop"),  # sampler: ValueError after model load
    ({"sampling.stop": '["ok", ""]'}, "sampling.stop"),
    ({"sampling.top_k": "-2"}, "sampling.top_k"),  # -1 is vLLM's "off", taken as 0
    ({"sampling.temperature": "-0.5"}, "sampling.temperature"),
    ({"sampling.top_p": "0"}, "sampling.top_p"),
    ({"sampling.max_tokens": "0"}, "sampling.max_tokens"),
    ({"sampling.seed": "-1"}, "sampling.seed"),
    ({"sampling.stop_token_ids": "[3, -1]"}, "sampling.stop_token_ids"),
    ({"sampling.stop_token_ids": '["a"]'}, "sampling.stop_token_ids"),
    ({"sampling.presence_penalty": "2.5"}, "sampling.presence_penalty"),  # vLLM: [-2, 2]
    ({"sampling.frequency_penalty": "-3"}, "sampling.frequency_penalty"),
    ({"sampling.repetition_penalty": "0"}, "sampling.repetition_penalty"),  # vLLM: > 0
    ({"sampling.repetition_penalty": "inf"}, "sampling.repetition_penalty"),
    ({"sampling.min_p": "1.5"}, "sampling.min_p"),
    ({"sampling.min_tokens": "-1"}, "sampling.min_tokens"),
    ({"sampling.logit_bias": "{a = 1.0}"}, "sampling.logit_bias"),
    ({"sampling.logit_bias": "{5 = nan}"}, "sampling.logit_bias"),
    ({"sampling.logit_bias": "[1, 2]"}, "sampling.logit_bias"),
    ({"sampling.allowed_token_ids": "[-1]"}, "sampling.allowed_token_ids"),
    ({"sampling.regex": "'(a'"}, "sampling.regex"),  # xgrammar refuses it
    ({"sampling.choice": '["a", "a"]'}, "sampling.choice"),
    ({"sampling.choice": '["a", ""]'}, "sampling.choice"),
    ({"sampling.regex": "a", "sampling.choice": '["a"]'}, "sampling.choice"),  # one guide
    ({"sampling.regex": "a", "sampling.labels": '[" a"]'}, "sampling.regex"),
    ({"sampling.min_p": "0.1", "sampling.labels": '[" a"]'}, "sampling.min_p"),
    ({"input.regex_column": "r", "sampling.labels": '[" a"]'}, "input.regex_column"),
    ({"input.min_tokens_column": "m", "input.labels_column": "l"}, "input.min_tokens_column"),
    ({"scheduler.policy": "fifo"}, "scheduler.policy"),  # scheduler registry
    ({"scheduler.chunk_size": "0"}, "scheduler.chunk_size"),  # SchedulerSettings
    ({"scheduler.kv_threshold": "0"}, "scheduler.kv_threshold"),
    ({"scheduler.kv_threshold": "1.01"}, "scheduler.kv_threshold"),
    ({"scheduler.max_num_seqs": "0"}, "scheduler.max_num_seqs"),
    ({"engine.block_size": "0"}, "engine.block_size"),  # block pool, kernels' PAGE
    ({"engine.kv_cache_bytes": "0"}, "engine.kv_cache_bytes"),
    ({"engine.gpu_memory_fraction": "0"}, "engine.gpu_memory_fraction"),
    ({"engine.threads": "0"}, "engine.threads"),  # torch.set_num_threads
    ({"engine.backend": "sglang"}, "engine.backend"),  # open_backend
    ({"engine.attention": "flash"}, "engine.attention"),  # attention registry
    ({"engine.attention": "cpu", "model.device": "cuda"}, "engine.attention"),
    ({"engine.attention": "cpu", "model.device": "cuda:1"}, "engine.attention"),
    ({"engine.attention": "triton", "model.device": "cpu"}, "engine.attention"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[" ".join(o) + "=" for o, _ in BAD])
def test_lower_layer_refusals_fail_at_load_time(
    overrides: dict[str, str], key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError) as ei:
        load_job(None, {**BASE, **overrides}, cwd=tmp_path)
    assert str(ei.value).startswith(key + ":"), str(ei.value)
    assert "command line" in str(ei.value)  # where the value came from


def test_device_checks_pass_what_can_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ok = [
        {"engine.attention": "cpu", "model.device": "cpu"},
        {"engine.attention": "cpu", "model.device": "auto"},  # decided at backend open
        {"engine.attention": "triton", "model.device": "cuda"},
        {"engine.attention": "cpu", "model.device": "cuda", "engine.backend": "vllm"},
        {"sampling.top_k": "0", "sampling.stop": '["\\n"]'},
    ]
    for overrides in ok:
        load_job(None, {**BASE, **overrides}, cwd=tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's CPU interpreter
    job = load_job(None, {**BASE, "engine.attention": "triton", "model.device": "cpu"})
    assert job.engine.attention == "triton"


def test_unavailable_cuda_device_is_a_config_error_at_backend_open(tiny_model_dir) -> None:
    """What needs the machine is checked when the backend opens, before the model loads."""
    import torch

    from batchjob.backends.native.backend import NativeBackend

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    job = load_job(None, {**BASE, "model.path": str(tiny_model_dir), "model.device": f"cuda:{n}"})
    with pytest.raises(ConfigError, match=rf"^model\.device: 'cuda:{n}' is not available"):
        NativeBackend(backend_config(job), lambda ids: "")


def test_names_come_from_one_registry_list() -> None:
    """Validation, its message and dispatch use the tuples of batchjob/backends/names.py."""
    from batchjob.backends.native.kv_cache import KVLayout
    from batchjob.backends.native.scheduler.registry import make_scheduler
    from batchjob.tokenize.prompts import TokenizedPrompts

    prompts = TokenizedPrompts.from_lists([[1, 2, 3]], max_tokens=2)
    for policy in SCHEDULING_POLICIES:
        s = make_scheduler(SchedulerConfig(policy=policy), KVLayout(4, 2), prompts, None)
        assert s.has_unfinished()
    for name in BACKENDS:
        assert EngineConfig(backend=name).backend == name
    for name in ATTENTION_BACKENDS:
        assert EngineConfig(attention=name).attention == name
    for section, key, names in (
        ("scheduler", "policy", SCHEDULING_POLICIES),
        ("engine", "backend", BACKENDS),
        ("engine", "attention", ATTENTION_BACKENDS),
    ):
        with pytest.raises(ConfigError, match=re.escape(", ".join(names))):
            load_job(None, {**BASE, f"{section}.{key}": "nope"})


def test_run_refuses_a_bad_value_before_reading_anything(tmp_path: Path, tiny_model_dir) -> None:
    """`batchjob run ... --set 'sampling.stop=[""]'`: exit 3, key on stderr, no traceback."""
    data = tmp_path / "in.parquet"
    data.write_bytes(b"not parquet")  # reading it would fail with another exit code
    out = tmp_path / "out"
    job = tmp_path / "job.toml"
    job.write_text(
        f'[input]\npath = "{data}"\n[model]\npath = "{tiny_model_dir}"\ndevice = "cpu"\n'
        f'[output]\npath = "{out}"\n'
    )
    runner = CliRunner()
    bad = runner.invoke(main, ["run", str(job), "--set", 'sampling.stop=[""]'])
    assert bad.exit_code == EXIT_CONFIG, bad.output
    assert "sampling.stop" in bad.stderr and "Traceback" not in bad.output
    assert not bad.stdout and not out.exists() and not out.with_name("out.meta").exists()
    # the same job without the bad value gets as far as the data, and fails there
    control = runner.invoke(main, ["run", str(job)])
    assert control.exit_code not in (0, EXIT_CONFIG), control.output
    assert "in.parquet" in control.stderr


# --- one declaration per setting --------------------------------------------------------

# same name, another meaning: not a copy of the job setting
NOT_THE_SETTING = {
    ("batchjob/testing/workloads.py", "seed"): "the workload generator's RNG seed",
    ("batchjob/testing/tiny_model.py", "seed"): "the random weights' / tokenizer corpus seed",
    ("batchjob/testing/tiny_model.py", "dtype"): "the dtype the test checkpoint is written in",
    ("batchjob/testing/model_shapes.py", "seed"): "the benchmark checkpoint's random weights",
    ("batchjob/testing/chain_model.py", "seed"): "the test model's random weights",
    ("batchjob/testing/lora_adapter.py", "seed"): "the test adapter's random weights",
}
# copies in library functions of other areas, still to be removed by their owners (a new
# copy anywhere else fails this test; remove an entry when its copy is gone)
PENDING = {
    ("batchjob/model/info.py", "dtype"),
    ("batchjob/model/info.py", "device"),
    ("batchjob/model/info.py", "max_model_len"),
    ("batchjob/tokenize/batched.py", "prompt_column"),
    ("batchjob/outputs/results.py", "rows_per_file"),
    ("batchjob/outputs/results.py", "flush_rows"),
}


# where the sections are declared: config/sections.py, and [storage] beside its user
SECTION_FILES = ("batchjob/config/sections.py", "batchjob/storage/settings.py")


def declarations() -> dict[str, list[tuple[str, int]]]:
    """Setting -> every ``<setting>: <its config type> = <value>`` line under batchjob/ (class
    fields and parameters alike), except ``= <Section>.<setting>``: a use of the one default."""
    found: dict[str, list[tuple[str, int]]] = {}
    files = sorted((ROOT / "batchjob").rglob("*.py"))
    for cls in config.SECTIONS.values():
        for name, ann in cls.__annotations__.items():
            if name == "path":  # three sections, three meanings: checked by hand
                continue
            pat = re.compile(rf"\b{re.escape(name)}: {re.escape(ann)} = (?!{cls.__name__}\.)")
            found[name] = [
                (str(p.relative_to(ROOT)), i + 1)
                for p in files
                for i, line in enumerate(p.read_text().splitlines())
                if pat.search(line)
            ]
    return found


def test_each_setting_is_declared_once() -> None:
    decls = declarations()
    # the settings the native engine, scheduler and sampler used to copy: config/sections.py alone
    for name in (
        *("max_tokens", "temperature", "top_k", "top_p", "stop_token_ids", "stop"),
        *("policy", "chunk_size", "kv_threshold", "max_num_seqs"),
        *("kv_cache_bytes", "gpu_memory_fraction", "block_size", "attention", "ignore_eos"),
    ):
        assert [f for f, _ in decls[name]] == ["batchjob/config/sections.py"], (name, decls[name])
    problems = []
    for name, where in decls.items():
        in_config = [w for w in where if w[0] in SECTION_FILES]
        others = [w for w in where if w[0] not in SECTION_FILES]
        if len(in_config) != 1:
            problems.append(f"{name}: declared {len(in_config)} times in the sections")
        for file, line in others:
            if (file, name) not in NOT_THE_SETTING and (file, name) not in PENDING:
                problems.append(f"{name}: another default at {file}:{line}")
    assert not problems, "\n".join(problems)
