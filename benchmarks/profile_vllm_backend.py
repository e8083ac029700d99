"""batchjob's vLLM backend against vLLM's own ``LLM.generate``, engine step by engine step.

    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv/bin/python benchmarks/profile_vllm_backend.py \\
        --workloads long-doc,micro-2000-200-s16 [--systems batchjob-vllm,vllm-sorted] \\
        [--scale 0.1] [--out benchmarks/results/NAME.txt]

Each system runs one workload in a fresh process, the way benchmarks/bench_peers.py runs it
(same model folder, token ids, KV budget, block 32, float32, one warm-up request, start-up
outside the timed part): ``batchjob-vllm`` / ``batchjob-vllm-order`` are
``VllmBackend.run`` in plan order with batchjob's scheduler class / vLLM's own (timed:
``build_plan`` + ``run``, as batchjob_vllm_peer.py), ``vllm-sorted`` / ``vllm-file`` are
``LLM.generate`` on the rows sorted / in file order (timed: ``generate``, as vllm_peer.py).

Timing: vLLM's methods are wrapped at run time in this script's processes only (nothing on
disk changes). vLLM spawns its engine-core and worker processes, which re-import this file
as ``__mp_main__``; with ``BJ_VLLM_PROBE_DIR`` set, the import wraps the same methods there,
and those processes leave their totals in that folder. Every wrapper adds its call's time to
one category, minus the time of wrapped calls inside it (exclusive time):

- model: the engine core's ``execute_model`` / ``sample_tokens`` calls on the executor and
  the wait for their result: the worker's forward and sampling plus the IPC both ways
  (``worker`` below: the worker's own time inside ``CPUWorker.execute_model`` /
  ``sample_tokens``);
- scheduling: vLLM's ``Scheduler`` (schedule, update_from_output, add_request,
  finish_requests, _free_request, grammar bitmask) and, apart, batchjob's scheduler subclass
  (``batchjob/backends/vllm/scheduler.py``: its own code, not the vLLM code it calls);
- everything else on the host: the engine core's step and add-request glue, vLLM's input
  processing (``LLMEngine.add_request``) and output processing, batchjob's request building
  (``plan_order``), output handling (``OutputTracker.update``), its loop in
  ``VllmBackend._execute`` and ``build_plan``; for ``LLM.generate``, the front end's wait
  for the engine-core process (its work overlaps the engine core's steps).

Per step: every ``EngineCore.step`` that scheduled tokens, with its tokens and sequences.
The first table is the split of the timed wall time as the engine core sees it (model,
scheduling, the rest); the second the seconds per category and the CPU seconds of each
process during the timed part (a process spinning while it waits shows up there).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

PROBE_ENV = "BJ_VLLM_PROBE_DIR"
CAPTURE_ENV = "BJ_VLLM_CAPTURE_DIR"  # --capture-steps: the worker's step batches go here
ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("batchjob-vllm", "batchjob-vllm-order", "vllm-sorted", "vllm-file")
POLICY = {"batchjob-vllm": "batchllm", "batchjob-vllm-order": "baseline"}

# category -> where it runs: the engine core (in batchjob's process, or vLLM's engine-core
# process behind LLM.generate), the front end (the process that submits and collects) or
# the worker (the model)
CORE = ("model", "sched_vllm", "sched_batchjob", "core_glue")
FRONT = ("submit", "front_step", "front_wait", "output_vllm", "bj_build", "bj_output", "bj_loop")
# the worker's categories: its execute_model / sample_tokens, and inside them the attention
# layers' kernel calls, KV writes and metadata builds, split by the step's kind (one with
# prompt tokens, or decode only)
WORKER = (
    "worker",
    "attn.prefill",
    "attn.decode",
    "kv_write.prefill",
    "kv_write.decode",
    "attn_meta.prefill",
    "attn_meta.decode",
)
LABELS = {
    "model": "model: execute + wait (worker + IPC)",
    "worker": "of which the worker's forward + sampling",
    "attn.prefill": "of which attention calls, steps with prefill tokens",
    "attn.decode": "of which attention calls, decode-only steps",
    "kv_write.prefill": "of which KV cache writes, steps with prefill tokens",
    "kv_write.decode": "of which KV cache writes, decode-only steps",
    "attn_meta.prefill": "of which attention metadata builds, steps with prefill tokens",
    "attn_meta.decode": "of which attention metadata builds, decode-only steps",
    "sched_vllm": "vLLM scheduler",
    "sched_batchjob": "batchjob scheduler subclass (own code)",
    "core_glue": "engine-core step / add-request glue",
    "submit": "vLLM input processing (LLMEngine.add_request)",
    "front_step": "front-end step glue (LLMEngine.step, LLM.generate)",
    "front_wait": "front end waits for the engine-core process",
    "output_vllm": "vLLM output processing",
    "bj_build": "batchjob request building (plan_order)",
    "bj_output": "batchjob output handling (OutputTracker)",
    "bj_loop": "batchjob loop (VllmBackend._execute)",
    "plan": "build_plan",
}


class Probe:
    """Exclusive seconds per category in this process (all threads), and the engine core's
    steps: (start, seconds, model seconds, tokens, sequences, decode-only, preempted)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[float, float, float, int, int, int, int]] = []
        self.local = threading.local()
        self.last_schedule: tuple[int, int, int, int] = (0, 0, 0, 0)
        self.dump_dir: Path | None = None  # set in vLLM's engine-core and worker processes
        self._worker_fd: int | None = None
        self.step_kind = "prefill"  # the worker's current step: "prefill" or "decode"

    def _stack(self) -> list[float]:
        st = getattr(self.local, "stack", None)
        if st is None:
            st = self.local.stack = []
        return st

    def timed(self, fn, cat: str, by_step: bool = False):
        """``fn`` timed into ``cat`` (``by_step``: ``cat.prefill`` / ``cat.decode``, the kind
        of the worker step it runs in)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            key = f"{cat}.{self.step_kind}" if by_step else cat
            st = self._stack()
            st.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = st.pop()
                self.totals[key] += dt - inner
                if st:
                    st[-1] += dt

        wrapper._bj_probe = True  # type: ignore[attr-defined]
        return wrapper

    def wrap(self, cls, name: str, cat: str, own_only: bool = False) -> None:
        """Wrap ``cls.name``; ``own_only``: only if ``cls`` defines it itself."""
        fn = cls.__dict__.get(name) if own_only else getattr(cls, name, None)
        if fn is None or getattr(fn, "_bj_probe", False):
            return
        setattr(cls, name, self.timed(fn, cat))

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)

    # --- engine-core and worker processes: totals to files ------------------------------
    def dump_core(self) -> None:
        if self.dump_dir is None:
            return
        path = self.dump_dir / f"core-{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        body = {"written_at": time.perf_counter(), "totals": self.totals, "steps": self.steps}
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)

    def dump_worker(self) -> None:
        if self.dump_dir is None:
            return
        if self._worker_fd is None:
            path = self.dump_dir / f"worker-{os.getpid()}.txt"
            self._worker_fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        vals = " ".join(f"{self.totals[c]:.6f}" for c in WORKER)
        line = f"{time.perf_counter():.6f} {vals}".ljust(255) + "\n"
        os.pwrite(self._worker_fd, line.encode(), 0)


PROBE = Probe()


def install(probe: Probe = PROBE) -> None:
    """Wrap vLLM's and batchjob's methods in this process (see the module docstring)."""
    from vllm.entrypoints.llm import LLM
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import SyncMPClient
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.executor.multiproc_executor import FutureWrapper, MultiprocExecutor

    from batchjob.backends.vllm import backend, requests
    from batchjob.backends.vllm import scheduler as bj_sched

    for name in ("execute_model", "sample_tokens"):
        probe.wrap(MultiprocExecutor, name, "model")
    probe.wrap(FutureWrapper, "result", "model")
    for name in (
        "update_from_output",
        "get_grammar_bitmask",
        "add_request",
        "finish_requests",
        "_free_request",
        "_update_after_schedule",
    ):
        probe.wrap(Scheduler, name, "sched_vllm")
    schedule = Scheduler.schedule
    if not getattr(schedule, "_bj_probe", False):

        def schedule_recorded(self, *args, **kwargs):
            out = schedule(self, *args, **kwargs)
            n = out.num_scheduled_tokens
            probe.last_schedule = (
                out.total_num_scheduled_tokens,
                len(n),
                int(all(v == 1 for v in n.values())),
                len(getattr(out, "preempted_req_ids", None) or ()),
            )
            return out

        Scheduler.schedule = probe.timed(schedule_recorded, "sched_vllm")
    for mixin in (bj_sched._RecordingMixin, bj_sched._BatchLLMMixin):
        for name in list(vars(mixin)):
            if callable(vars(mixin)[name]) and not name.startswith("__"):
                probe.wrap(mixin, name, f"sched_batchjob.{name}", own_only=True)
    for name in ("add_request", "preprocess_add_request"):
        probe.wrap(EngineCore, name, "core_glue")
    for name in ("step", "step_with_batch_queue"):
        _wrap_step(probe, EngineCore, name)
    probe.wrap(LLMEngine, "add_request", "submit")
    probe.wrap(LLMEngine, "step", "front_step")
    probe.wrap(LLM, "generate", "front_step")
    probe.wrap(SyncMPClient, "get_output", "front_wait")
    probe.wrap(OutputProcessor, "process_outputs", "output_vllm")
    probe.wrap(requests.OutputTracker, "update", "bj_output")
    probe.wrap(backend.VllmBackend, "_execute", "bj_loop")
    if not getattr(backend.plan_order, "_bj_probe", False):
        backend.plan_order = _timed_generator(probe, backend.plan_order, "bj_build")
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker
    except ImportError:  # a GPU build
        return
    for name in ("execute_model", "sample_tokens"):
        fn = getattr(CPUWorker, name)
        if getattr(fn, "_bj_probe", False):
            continue
        timed = probe.timed(fn, "worker")

        def in_worker(*args, _timed=timed, **kwargs):
            out = args[1] if len(args) > 1 else kwargs.get("scheduler_output")
            n = getattr(out, "num_scheduled_tokens", None)
            if n:  # execute_model; sample_tokens keeps its step's kind
                probe.step_kind = "decode" if all(v == 1 for v in n.values()) else "prefill"
            try:
                return _timed(*args, **kwargs)
            finally:
                probe.dump_worker()  # before the reply leaves: the caller reads it after

        in_worker._bj_probe = True  # type: ignore[attr-defined]
        setattr(CPUWorker, name, in_worker)
    _wrap_attention(probe)


def _wrap_attention(probe: Probe) -> None:
    """vLLM's CPU attention and batchjob's subclass of it: each class's own forward, KV
    write and metadata build (exclusive time: a subclass falling back to vLLM's counts once)."""
    from vllm.v1.attention.backends import cpu_attn

    from batchjob.backends.vllm import prefix_attention as pa

    for impl in (cpu_attn.CPUAttentionBackendImpl, pa.PrefixSharedImpl):
        for name, cat in (("forward", "attn"), ("do_kv_cache_update", "kv_write")):
            fn = impl.__dict__.get(name)
            if fn is not None and not getattr(fn, "_bj_probe", False):
                if name == "forward" and os.environ.get(CAPTURE_ENV):
                    fn = _capturing(fn, Path(os.environ[CAPTURE_ENV]))
                setattr(impl, name, probe.timed(fn, cat, by_step=True))
    for builder in (cpu_attn.CPUAttentionMetadataBuilder, pa.PrefixSharedMetadataBuilder):
        fn = builder.__dict__.get("build")
        if fn is not None and not getattr(fn, "_bj_probe", False):
            builder.build = probe.timed(fn, "attn_meta", by_step=True)


def _capturing(forward, folder: Path):
    """``forward`` that also saves the batch of every step its first layer sees (query start
    offsets, sequence lengths, block tables: what benchmarks/bench_vllm_attention.py
    --steps replays), one .npz a step, numbered in order."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    count = [0]

    @functools.wraps(forward)
    def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        name = getattr(layer, "layer_name", "")
        if attn_metadata is not None and ".0." in name and kv_cache.dim() == 4:
            r = len(attn_metadata.seq_lens)
            np.savez(
                folder / f"step-{count[0]:05d}.npz",
                query_start_loc=attn_metadata.query_start_loc[: r + 1].cpu().numpy(),
                seq_lens=attn_metadata.seq_lens.cpu().numpy(),
                block_table=attn_metadata.block_table[:r].cpu().numpy(),
                block_size=kv_cache.shape[2],
            )
            count[0] += 1
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    return wrapper


def _wrap_step(probe: Probe, cls, name: str) -> None:
    fn = getattr(cls, name, None)
    if fn is None or getattr(fn, "_bj_probe", False):
        return
    timed = probe.timed(fn, "core_glue")

    def step(self, *args, **kwargs):
        probe.last_schedule = (0, 0, 0, 0)
        model0 = probe.totals["model"]
        t0 = time.perf_counter()
        out = timed(self, *args, **kwargs)
        tokens, seqs, decode, preempted = probe.last_schedule
        if tokens:
            dt = time.perf_counter() - t0
            model = probe.totals["model"] - model0
            probe.steps.append((t0, dt, model, tokens, seqs, decode, preempted))
        if not self.scheduler.has_requests():
            probe.dump_core()  # idle: the run (or warm-up) is over
        return out

    step._bj_probe = True  # type: ignore[attr-defined]
    setattr(cls, name, step)


def _timed_generator(probe: Probe, gen_fn, cat: str):
    """A generator function whose every ``next`` counts towards ``cat``."""

    @functools.wraps(gen_fn)
    def wrapper(*args, **kwargs):
        it = probe.timed(gen_fn, cat)(*args, **kwargs)
        step = probe.timed(next, cat)
        while True:
            try:
                item = step(it)
            except StopIteration:
                return
            yield item

    wrapper._bj_probe = True  # type: ignore[attr-defined]
    return wrapper


if os.environ.get(PROBE_ENV):  # this process and vLLM's spawned ones (they import this file)
    PROBE.dump_dir = Path(os.environ[PROBE_ENV])
    install()


# --- one system in this process (--child) ---------------------------------------------------
def _read_core(probe_dir: Path) -> tuple[int | None, dict]:
    files = sorted(probe_dir.glob("core-*.json"))
    if not files:
        return None, {"totals": {}, "steps": []}
    f = files[-1]
    return int(f.stem.split("-")[1]), json.loads(f.read_text())


def _read_worker(probe_dir: Path) -> tuple[int | None, dict[str, float]]:
    files = sorted(probe_dir.glob("worker-*.txt"))
    if not files:
        return None, dict.fromkeys(WORKER, 0.0)
    f = files[-1]
    vals = [float(x) for x in f.read_text().split()[1:]]
    return int(f.stem.split("-")[1]), dict(zip(WORKER, vals, strict=True))


def _cpu_seconds(pids: dict[str, int | None]) -> dict[str, float]:
    import psutil

    out = {}
    for role, pid in pids.items():
        if pid is None:
            continue
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[role] = t.user + t.system
    return out


def run_child(args) -> dict:
    """Start the system's engine, warm it up, time ``args.repeats`` runs on it with the
    probes (the prefix cache reset before each); the result, one entry per run."""
    probe_dir = Path(os.environ[PROBE_ENV])
    PROBE.dump_dir = None  # this process's totals are read in place (batchjob: with the core)
    t_start = time.perf_counter()
    if args.system in POLICY:
        run, config = _batchjob_runner(args)
    else:
        run, config = _vllm_runner(args)
    startup_s = time.perf_counter() - t_start
    time.sleep(1.0)  # the warm-up's last dumps are written; the worker stops spinning
    worker_pid, worker0 = _read_worker(probe_dir)
    core_pid, core0 = _read_core(probe_dir)
    roles = {"front": os.getpid(), "core": core_pid, "worker": worker_pid}
    if core_pid is None:  # batchjob: the engine core runs in this process
        roles = {"front+core": os.getpid(), "worker": worker_pid}
    gate = Path(args.result).parent
    (gate / "ready").write_text(str(startup_s))
    runs = []
    for rep in range(args.repeats):
        while not (gate / f"go-{rep}").exists():  # the parent alternates the systems' runs
            time.sleep(0.02)
        cpu0 = _cpu_seconds(roles)
        mine0 = PROBE.snapshot()
        t0 = time.perf_counter()
        extra = run()  # the timed part
        t1 = time.perf_counter()
        cpu1 = _cpu_seconds(roles)
        mine1 = PROBE.snapshot()
        time.sleep(0.5)  # the engine-core process's idle dump after its last step
        _, worker1 = _read_worker(probe_dir)
        if core_pid is None:
            steps, core_d = PROBE.steps, {}
        else:
            _, core1 = _read_core(probe_dir)
            steps = core1["steps"]
            core_d = {  # the engine-core process's own categories
                k: v - core0["totals"].get(k, 0.0)
                for k, v in core1["totals"].items()
                if k.split(".")[0] in CORE
            }
            core0 = core1
        secs = {k: v - mine0.get(k, 0.0) for k, v in mine1.items()}
        for cat, v in core_d.items():
            secs[cat] = secs.get(cat, 0.0) + v
        for cat in WORKER:
            secs[cat] = worker1[cat] - worker0[cat]
        worker0 = worker1
        secs["plan"] = extra.pop("plan_s", 0.0)
        secs["sched_batchjob"] = sum(v for k, v in secs.items() if k.startswith("sched_batchjob."))
        window = [s for s in steps if t0 <= s[0] <= t1]
        runs.append(
            {
                "total_s": t1 - t0,
                "steps": len(window),
                "tokens": sum(s[3] for s in window),
                "seqs": sum(s[4] for s in window),
                "decode_only_steps": sum(s[5] for s in window),
                "step_s": sum(s[1] for s in window),
                "step_model_s": sum(s[2] for s in window),
                "preempted": sum(s[6] for s in window),
                # per step: tokens, sequences, decode-only, wall s, model s
                "step_records": [
                    [s[3], s[4], s[5], round(s[1], 6), round(s[2], 6)] for s in window
                ],
                "seconds": {k: v for k, v in secs.items() if abs(v) > 0},
                "cpu_s": {k: cpu1.get(k, 0.0) - v for k, v in cpu0.items()},
                "loadavg_1m": os.getloadavg()[0],
                **extra,
            }
        )
        _write_whole(gate / f"run-{rep}.json", json.dumps(runs[-1]))
    while not (gate / "stop").exists():  # no engine shuts down beside another system's run
        time.sleep(0.05)
    return {
        "system": args.system,
        "workload": args.workload,
        "startup_s": startup_s,
        "config": config,
        "runs": runs,
    }


def _engine_config(vllm_config) -> dict:
    sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
    return {
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_model_len": vllm_config.model_config.max_model_len,
        "block_size": cc.block_size,
        "num_kv_blocks": cc.num_gpu_blocks,
        "scheduler_cls": str(sc.scheduler_cls),
        "executor": str(vllm_config.parallel_config.distributed_executor_backend),
    }


def _stop_ids(args) -> list[int]:
    """--stop-ids N: the ids bench_peers.py stops rows at."""
    from lib.peers import stop_id_list

    return stop_id_list(args.stop_ids or 0)


def _batchjob_runner(args):
    from peers import batchjob_vllm_peer as peer

    from batchjob.backends.base import RunSink
    from batchjob.backends.vllm.backend import VllmBackend
    from batchjob.plan.build import build_plan
    from batchjob.runner.execute import backend_config
    from batchjob.tokenize.batched import load_prompts
    from batchjob.tokenize.prompts import TokenizedPrompts

    ns = argparse.Namespace(
        model=args.model,
        plan=str(Path(args.result).parent / "plan.json"),  # job_for: its folder only
        policy=POLICY[args.system],
        kv_bytes=int(args.kv_gib * (1 << 30)),
        chunk_size=args.chunk_size,
        kv_threshold=args.kv_threshold,
        max_model_len=4096,  # batchjob_vllm_peer.py's default, the model's own
        stop_ids=",".join(map(str, _stop_ids(args))),  # as batchjob_vllm_peer.py takes them
        dtype=args.dtype,
    )
    if args.batchllm_max_seqs is not None:
        from batchjob.backends.vllm import engine_args

        engine_args.BATCHLLM_MAX_SEQS = args.batchllm_max_seqs
    job = peer.job_for(ns, args.data)
    loaded, model = load_prompts(job.input, job.model, job.sampling, job.engine.backend)
    prompts = loaded.prompts
    backend = VllmBackend(backend_config(job), lambda ids: "", model)
    sched = job.scheduler  # started for this job's plan (the attention choice weighs its mix)
    backend.check_fits(prompts, build_plan(prompts, enlarge=sched.enlarge, order=sched.reorder))
    warm = TokenizedPrompts.from_lists([[5] * 40, [6] * 40], max_tokens=4)
    backend.run(warm, build_plan(warm), RunSink(lambda o: None))
    config = _engine_config(backend.engine.vllm_config)

    def run() -> dict:  # backend.run resets the prefix cache itself
        t0 = time.perf_counter()
        plan = build_plan(prompts, enlarge=job.scheduler.enlarge, order=job.scheduler.reorder)
        plan_s = time.perf_counter() - t0
        out: dict[int, list[int]] = {}
        info = backend.run(
            prompts,
            plan,
            RunSink(lambda o: out.__setitem__(int(o.row_id), [int(t) for t in o.token_ids])),
        )
        first_time = info.computed_prefill_tokens - info.recomputed_tokens
        return {
            "plan_s": plan_s,
            "requests": len(prompts),
            "prompt_tokens": int(prompts.lengths.sum()),
            "generated_tokens": sum(len(x) for x in out.values()),
            "output_ids": {str(k): v for k, v in out.items()},  # row id -> generated ids
            "saving_ratio": 1 - first_time / int(prompts.lengths.sum()),
            "preemptions": info.preemptions,
        }

    return run, config


def _vllm_runner(args):
    from peers import vllm_peer

    flags = ["--model", args.model, "--input", args.data, "--output-json", args.result]
    flags += ["--omp-bind", os.environ["VLLM_CPU_OMP_THREADS_BIND"], "--block-size", "32"]
    flags += ["--kv-gib", str(args.kv_gib), "--dtype", args.dtype, "--no-min-tokens", "--warmup"]
    if args.vllm_chunk:
        flags += ["--max-num-batched-tokens", str(args.vllm_chunk)]
    if args.vllm_max_seqs:
        flags += ["--max-num-seqs", str(args.vllm_max_seqs)]
    a = vllm_peer.parse_args(flags)
    vllm_peer.configure_env(a)
    work = vllm_peer.load_workload(a.input, sort_prompts=args.system == "vllm-sorted")
    llm, _ = vllm_peer.start_engine(a, vllm_peer.TreeSampler())
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=work.prompts[i]) for i in work.order]
    stop = _stop_ids(args)
    params = [
        SamplingParams(
            max_tokens=work.max_tokens[i],
            min_tokens=0,
            ignore_eos=not stop,
            stop_token_ids=stop or None,
            temperature=0.0,
            detokenize=False,
        )
        for i in work.order
    ]

    config = _engine_config(llm.llm_engine.vllm_config)

    def run() -> dict:
        if not llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache failed")
        outs = llm.generate(prompts, params, use_tqdm=False)
        cached = sum(int(o.num_cached_tokens or 0) for o in outs)
        prompt_tokens = sum(len(p) for p in work.prompts)
        return {
            "requests": len(outs),
            "prompt_tokens": prompt_tokens,
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "output_ids": {
                str(work.row_ids[i]): list(o.outputs[0].token_ids)
                for i, o in zip(work.order, outs, strict=True)
            },
            "saving_ratio": cached / prompt_tokens,
        }

    return run, config


# --- the tables ---------------------------------------------------------------------------
def median_run(r: dict) -> dict:
    """The system's run with the median timed wall time (the lower middle one of an even
    count), with its workload, system and every run's time."""
    runs = sorted(r["runs"], key=lambda x: x["total_s"])
    return {
        **runs[(len(runs) - 1) // 2],
        "workload": r["workload"],
        "system": r["system"],
        "all_s": [x["total_s"] for x in r["runs"]],
    }


def split_row(r: dict) -> dict:
    s, total = r["seconds"], r["total_s"]
    model = s.get("model", 0.0)
    sched = s.get("sched_vllm", 0.0) + s.get("sched_batchjob", 0.0)
    n = max(r["steps"], 1)
    return {
        "workload": r["workload"],
        "system": r["system"],
        "requests": r["requests"],
        "steps": r["steps"],
        "mean tokens/step": r["tokens"] / n,
        "mean seqs/step": r["seqs"] / n,
        "decode-only steps": r["decode_only_steps"],
        # tokens computed beyond the prompt tokens the prefix cache missed and the decode
        # steps: recomputation after preemption
        "recomputed tokens": round(
            r["tokens"]
            - r["prompt_tokens"] * (1 - r["saving_ratio"])
            - (r["generated_tokens"] - r["requests"])
        ),
        "preempted": r.get("preempted", "-"),
        "total s": total,
        "runs s": " ".join(f"{x:.2f}" for x in r["all_s"]),
        "req/s": r["requests"] / total,
        "ms/step": 1000 * r["step_s"] / n,
        "% model forward": 100 * model / total,
        "% scheduling": 100 * sched / total,
        "% other host": 100 * (total - model - sched) / total,
        "load 1m": r["loadavg_1m"],
    }


def equal_rows(a: dict, b: dict) -> str:
    """How many rows two runs generated the same token ids for: "equal/rows" ("-": a run
    without its tokens)."""
    ta, tb = a.get("output_ids"), b.get("output_ids")
    if not ta or not tb:
        return "-"
    return f"{sum(ta.get(k) == v for k, v in tb.items())}/{max(len(ta), len(tb))}"


def paired_rows(results: list[dict]) -> list[dict]:
    """Per workload and round, every system's time and each one's ratio to the first system
    (the runs of a round are adjacent in time, so the ratio is what drift disturbs least)."""
    import statistics

    rows = []
    for name in dict.fromkeys(r["workload"] for r in results):
        rs = [r for r in results if r["workload"] == name]
        base = rs[0]
        ratios: dict[str, list[float]] = defaultdict(list)
        for k in range(min(len(r["runs"]) for r in rs)):
            row = {"workload": name, "round": str(k)}
            for r in rs:
                row[f"{r['system']} s"] = r["runs"][k]["total_s"]
            for r in rs[1:]:
                x = r["runs"][k]["total_s"] / base["runs"][k]["total_s"]
                ratios[r["system"]].append(x)
                row[f"{r['system']} / {base['system']}"] = x
            for r in rs[1:]:
                row[f"rows {r['system']} = {base['system']}"] = equal_rows(
                    base["runs"][k], r["runs"][k]
                )
            rows.append(row)
        med = {"workload": name, "round": "median"}
        for r in rs:
            med[f"{r['system']} s"] = statistics.median(x["total_s"] for x in r["runs"])
        for system, xs in ratios.items():
            med[f"{system} / {base['system']}"] = statistics.median(xs)
        for r in rs[1:]:
            med[f"rows {r['system']} = {base['system']}"] = "-"
        rows.append(med)
    return rows


def decode_fit(r: dict) -> tuple[float, float, float]:
    """Decode-only steps' model time as a + b * sequences (least squares): (a ms, b ms,
    mean ms of the steps that carry prefill tokens)."""
    import numpy as np

    rec = np.asarray(r.get("step_records") or [[0, 0, 0, 0.0, 0.0]], dtype=float)
    dec, pre = rec[rec[:, 2] == 1], rec[rec[:, 2] == 0]
    a = b = float("nan")
    if len(dec) >= 3 and np.ptp(dec[:, 1]) > 0:
        (b, a), *_ = np.linalg.lstsq(np.c_[dec[:, 1], np.ones(len(dec))], dec[:, 4], rcond=None)
    pre_ms = 1000 * float(pre[:, 4].mean()) if len(pre) else float("nan")
    return 1000 * float(a), 1000 * float(b), pre_ms


def detail_rows(results: list[dict]) -> list[dict]:
    cats = [c for c in LABELS if any(c in r["seconds"] for r in results)]
    rows = []
    fits = [decode_fit(r) for r in results]
    for i, label in enumerate(
        (
            "decode-only step, model ms: fixed part (fit a + b * seqs)",
            "decode-only step, model ms per sequence (fit)",
            "steps with prefill tokens, model ms each (mean)",
        )
    ):
        row = {"measure": label}
        for r, f in zip(results, fits, strict=True):
            row[f"{r['workload']} {r['system']}"] = f[i]
        rows.append(row)
    methods = sorted({k for r in results for k in r["seconds"] if k.startswith("sched_batchjob.")})
    for c in cats:
        subs = [c] + (methods if c == "sched_batchjob" else [])
        for sub in subs:
            label = LABELS[c] if sub == c else f"of which {sub.split('.')[1]}"
            row = {"measure": "s, " + label}
            for r in results:
                row[f"{r['workload']} {r['system']}"] = r["seconds"].get(sub, 0.0)
            rows.append(row)
    roles = list(dict.fromkeys(k for r in results for k in r["cpu_s"]))
    for role in roles:
        row = {"measure": f"CPU s, {role} process"}
        for r in results:
            row[f"{r['workload']} {r['system']}"] = r["cpu_s"].get(role, float("nan"))
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            (f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}") if isinstance(v, float) else str(v)
            for v in r.values()
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="long-doc,micro-2000-200-s16")
    p.add_argument("--systems", default="batchjob-vllm,vllm-sorted")
    p.add_argument("--scale", type=float, default=None, help="override bench_peers' scale")
    p.add_argument("--len-scale", type=float, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128, help="models/bench-peer[-d<D>]")
    p.add_argument(
        "--kv-heads", type=int, default=8, help="KV heads of the 8 query heads (2: GQA, -kv2)"
    )
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--model-shape",
        default=None,
        help="a real checkpoint's shape (batchjob.testing.model_shapes) instead of bench-peer",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="the backend's token budget (default: its own, vLLM's default: 4096 on a CPU)",
    )
    p.add_argument(
        "--vllm-budget",
        action="store_true",
        help="give LLM.generate --chunk-size too (default: vLLM's own, 4096 on a CPU)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per engine (the tables show the median one)",
    )
    p.add_argument(
        "--batchllm-max-seqs",
        type=int,
        default=None,
        help="batchjob-vllm only: the engine's max_num_seqs (default: the backend's own, "
        "min(1024, chunk_size)); set in this script's process, batchjob's files unchanged",
    )
    p.add_argument(
        "--kv-threshold",
        type=float,
        default=None,
        help="batchjob-vllm only: scheduler.kv_threshold (default: the job's default, 1.0 "
        "on this backend: admission up to every block of vLLM's pool)",
    )
    p.add_argument(
        "--vllm-max-seqs",
        type=int,
        default=None,
        help="LLM.generate only: max_num_seqs (default: vLLM's own, 256 on a CPU)",
    )
    p.add_argument(
        "--capture-steps",
        action="store_true",
        help="save every step's batch (layer 0's metadata) to WORK/<workload>-<system>/steps "
        "for bench_vllm_attention.py --steps (warm-up included: use with --repeats 1)",
    )
    p.add_argument(
        "--stop-ids",
        type=int,
        default=None,
        help="rows stop at any of N token ids (100 ..), greedy; default: every row decodes "
        "max_tokens",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the tables here (.txt)")
    p.add_argument("--work", type=Path, default=ROOT / "out" / "profile_vllm_backend")
    # one system in this process (the parent runs each so)
    p.add_argument("--child", dest="system", default=None, help=argparse.SUPPRESS)
    for name in ("--workload", "--data", "--model", "--result"):
        p.add_argument(name, default=None, help=argparse.SUPPRESS)
    p.add_argument("--vllm-chunk", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="only print the tables of an earlier --out's .json (no runs)",
    )
    args = p.parse_args()
    if args.from_json is not None:
        print(tables(json.loads(args.from_json.read_text()), header=""))
        return
    if args.system is not None:
        result = run_child(args)
        _write_whole(Path(args.result), json.dumps(result))
        return
    parent(args)


def parent(args) -> None:
    import signal
    import subprocess
    import tempfile

    from lib import workloads

    from batchjob.model.host_cpu import host_cpu

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    if args.model_shape:
        from batchjob.testing.model_shapes import SHAPES, make_shaped_model

        shape = SHAPES[args.model_shape]
        model = make_shaped_model(ROOT / "models" / shape.name, shape)
        args.head_dim, args.kv_heads = shape.head_dim, shape.kv_heads
    else:
        model = workloads.build_model(
            workloads.model_dir(args.head_dim, args.kv_heads),
            smoke=False,
            head_dim=args.head_dim,
            kv_heads=args.kv_heads,
        )
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"--systems: {s!r} is not one of {', '.join(SYSTEMS)}")
    import vllm

    header = (
        f"CPU: {host_cpu().summary()}; {os.cpu_count()} CPUs; vLLM {vllm.__version__}; "
        f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}; "
        f"model {model.name} (head dim {args.head_dim}, {args.kv_heads} KV heads), {args.dtype}, "
        "block 32, KV "
        f"{args.kv_gib} GiB; backend chunk_size {args.chunk_size or 'its own'}, LLM.generate "
        f"max_num_batched_tokens {args.chunk_size if args.vllm_budget else 'vLLM default'}; "
        f"{args.repeats} runs per system, alternating"
    )
    for flag in ("batchllm_max_seqs", "kv_threshold", "vllm_max_seqs"):
        if getattr(args, flag) is not None:
            header += f"; {flag} {getattr(args, flag)}"
    print(header, flush=True)
    results = []
    for name in [w for w in args.workloads.split(",") if w]:
        sc, ls, mt = workloads.WORKLOADS[name]
        sc, ls, mt = args.scale or sc, args.len_scale or ls, args.max_tokens or mt
        data = args.work / "data" / f"{name}-{sc}-{ls}-{mt}-v{vocab}.parquet"
        t = workloads.write_workload(name, sc, ls, mt, vocab, data)
        print(f"{name}: {t.num_rows} requests, scale {sc}/{ls}/{mt}", flush=True)
        procs: dict[str, subprocess.Popen] = {}
        dirs: dict[str, Path] = {}
        with contextlib.ExitStack() as stack:
            for system in systems:  # every system's engine up at once, each in its process
                d = dirs[system] = args.work / f"{name}-{system}"
                d.mkdir(parents=True, exist_ok=True)
                for f in d.glob("*"):
                    if f.is_dir():
                        shutil.rmtree(f)
                    else:
                        f.unlink()
                probe_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bj-probe-"))
                cmd = [sys.executable, __file__, "--child", system, "--workload", name]
                cmd += ["--data", str(data), "--model", str(model)]
                cmd += ["--result", str(d / "result.json"), "--kv-gib", str(args.kv_gib)]
                cmd += ["--repeats", str(args.repeats), "--dtype", args.dtype]
                if args.chunk_size:
                    cmd += ["--chunk-size", str(args.chunk_size)]
                if args.vllm_budget and args.chunk_size:
                    cmd += ["--vllm-chunk", str(args.chunk_size)]
                for flag in ("batchllm_max_seqs", "kv_threshold", "vllm_max_seqs", "stop_ids"):
                    if getattr(args, flag) is not None:
                        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
                log = stack.enter_context(open(d / "log.txt", "w"))
                extra_env = {CAPTURE_ENV: str(d / "steps")} if args.capture_steps else {}
                procs[system] = subprocess.Popen(
                    cmd,
                    env={**env, PROBE_ENV: probe_dir, **extra_env},
                    stdout=log,
                    stderr=log,
                    cwd=ROOT,
                    start_new_session=True,  # its group: vLLM's processes go with it
                )
            stack.callback(_kill_all, procs, signal.SIGKILL)

            for system in systems:
                _wait_for(dirs[system] / "ready", procs[system], f"{name} {system}")
            for k in range(args.repeats):  # A B, B A, ...: drift reaches every system alike
                order = systems[k % len(systems) :] + systems[: k % len(systems)]
                for system in order:
                    time.sleep(1.5)  # the last run's worker stops spinning (vLLM: 1 s)
                    (dirs[system] / f"go-{k}").touch()
                    _wait_for(dirs[system] / f"run-{k}.json", procs[system], f"{name} {system}")
                    run = json.loads((dirs[system] / f"run-{k}.json").read_text())
                    print(f"  run {k} {system}: {run['total_s']:.2f} s", flush=True)
            for system in systems:
                (dirs[system] / "stop").touch()
            for system in systems:
                _wait_for(dirs[system] / "result.json", procs[system], f"{name} {system}")
                procs[system].wait()
                r = json.loads((dirs[system] / "result.json").read_text())
                results.append(r)
                print(f"  {system}: {r['config']}", flush=True)
    text = tables(results, header)
    print("\n" + text)
    if args.out is not None:
        args.out.write_text(text)
        (args.out.with_suffix(".json")).write_text(
            json.dumps({"header": header, "results": results})
        )
        print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


def tables(results: list[dict] | dict, header: str) -> str:
    """The three tables (split, paired runs, seconds per category) as Markdown."""
    if isinstance(results, dict):  # an --out .json
        header, results = header or results["header"], results["results"]
    medians = [median_run(r) for r in results]
    configs = [f"{r['workload']} {r['system']}: {r['config']}" for r in results]
    return "\n".join(
        [
            header,
            *configs,
            "",
            markdown([split_row(r) for r in medians]),
            "",
            markdown(paired_rows(results)),
            "",
            markdown(detail_rows(medians)),
            "",
        ]
    )


def _write_whole(path: Path, text: str) -> None:
    """Written under another name, then renamed: the parent polls for ``path`` and must not
    read it half-written (a run's JSON is larger than one write)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _wait_for(path: Path, proc, what: str) -> None:
    """Until ``path`` exists; a SystemExit with the log's tail if ``proc`` exits first."""
    while not path.exists():
        if proc.poll() is not None:
            tail = (path.parent / "log.txt").read_text()[-3000:]
            raise SystemExit(f"{what} exited ({proc.returncode}):\n{tail}")
        time.sleep(0.05)


def _kill_all(procs: dict, sig: int) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            proc.wait()


if __name__ == "__main__":
    main()
