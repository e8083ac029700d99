"""Every system on every workload and repeat of one benchmark model, in the order chosen.

Default order: the batchjob/baseline/hf runs first (per workload, per repeat, batchjob first:
its outputs are the match reference); then every vLLM run of the model through ONE
``vllm_peer.py --plan`` process; then each batchjob-vllm system's runs through one
``batchjob_vllm_peer.py --plan`` process. ``interleave``: every run a fresh process with its
own engine, in ``interleaved_schedule``'s order, so a drift of the machine's speed reaches both
sides of a ratio. ``Runs`` is the runs table (OUT/peers_runs.parquet), rewritten after every
run, so ``--resume`` keeps what an interrupted call finished.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.storage.atomic import write_parquet_atomic

from . import peers
from .peers import RunResult, outputs_by_row, recheck
from .workloads import write_workload

Outputs = dict[int, list[int]] | None  # batchjob's output ids by row (the match reference)


@dataclass(frozen=True)
class Settings:
    """What every run of one benchmark call shares."""

    out: Path  # absolute: job files and peers get absolute paths
    systems: list[str]  # the systems that run (after --with-vllm/--with-hf and availability)
    scales: dict[str, tuple[float, float, int]]  # workload -> (scale, len_scale, max_tokens)
    repeats: int
    kv_gib: float
    chunk_size: int
    vllm_chunk: int | None  # the vLLM peer's step budget (None: vLLM's own)
    backend_chunk: int | None  # scheduler.chunk_size of the batchjob-vllm systems
    max_model_len: int | None
    dtype: str
    interleave: bool
    warmup: bool = False  # --interleave: one untimed run of each system first

    @property
    def kv_bytes(self) -> int:
        return int(self.kv_gib * (1 << 30))


@dataclass(frozen=True)
class Variant:
    """One benchmark model every system runs on."""

    label: str  # bench-peer, or a --model-shapes name
    head_dim: int
    kv_heads: int
    model: Path

    @property
    def key(self) -> tuple[int, str]:
        return self.head_dim, self.label


class Runs:
    """The runs so far (with ``resume``, those OUT/peers_runs.parquet holds), each recorded
    with its model and machine and the table rewritten at once."""

    def __init__(self, path: Path, resume: bool, cpu_model: str, cpu_flags: str) -> None:
        self.path, self.cpu_model, self.cpu_flags = path, cpu_model, cpu_flags
        self.items: list[RunResult] = []
        if resume and path.exists():  # keep runs an earlier call finished
            self.items = [RunResult(**r) for r in pq.read_table(path).to_pylist()]
        self.done = {(r.workload, r.system, r.repeat, r.head_dim, r.model) for r in self.items}

    def finished(self, name: str, system: str, rep: int, v: Variant) -> bool:
        """Run by an earlier call (--resume): reused, its match fraction re-checked."""
        return (name, system, rep, *v.key) in self.done

    def record(self, r: RunResult, v: Variant) -> None:
        r = replace(
            r,
            head_dim=v.head_dim,
            kv_heads=v.kv_heads,
            model=v.label,
            cpu_model=self.cpu_model,
            cpu_flags=self.cpu_flags,
        )
        self.items.append(r)
        print(
            f"  d{v.head_dim} {r.workload} rep {r.repeat} {r.system}: run {r.run_s:.1f} s "
            f"({r.requests_per_s:.2f} req/s), end-to-end {r.end_to_end_s:.1f} s, "
            f"saving {r.saving_ratio:.3f}, mem {r.peak_mem_mib:.0f} MiB, "
            f"match {r.match_frac:.2f}, load {r.loadavg_1m:.1f}",
            flush=True,
        )
        rows = [asdict(x) for x in self.items]
        write_parquet_atomic(pa.table({k: [x[k] for x in rows] for k in rows[0]}), self.path)

    def recheck_where(self, runs_dir: Path, ours: Outputs, **fields: object) -> None:
        """Re-check against ``ours`` the match fraction of the runs with these field values."""
        self.items = [
            recheck(r, runs_dir, ours) if all(getattr(r, k) == x for k, x in fields.items()) else r
            for r in self.items
        ]


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


def run_variant(s: Settings, v: Variant, runs: Runs) -> None:
    """Every chosen system on every workload and repeat of ``v``'s model."""
    runs_dir = s.out / "runs" / (f"d{v.head_dim}" if v.label == "bench-peer" else v.label)
    vocab = json.loads((v.model / "config.json").read_text())["vocab_size"]
    datas: dict[str, Path] = {}
    for name, (sc, ls, mt) in s.scales.items():
        data = datas[name] = s.out / "data" / f"{name}-{sc}-{ls}-{mt}-v{vocab}.parquet"
        t = write_workload(name, sc, ls, mt, vocab, data)
        print(
            f"d{v.head_dim} {name}: {t.num_rows} requests, "
            f"{sum(map(len, t['prompt'].to_pylist()))} prompt tokens, {mt} out each; "
            f"systems {s.systems}",
            flush=True,
        )
    (_interleaved if s.interleave else _grouped)(s, v, runs, runs_dir, datas)


def _batchjob_outputs(runs_dir: Path, name: str, rep: int) -> Outputs:
    return outputs_by_row(runs_dir / f"{name}-batchllm-{rep}" / "results.parquet")


def _interleaved(s: Settings, v: Variant, runs: Runs, runs_dir: Path, datas: dict) -> None:
    """Every run a fresh process, the systems alternating (see the module doc)."""
    hd = v.head_dim
    sched = interleaved_schedule(list(s.scales), s.systems, s.repeats)
    if s.warmup and not all(runs.finished(n, sy, r, v) for n, r, sy in sched):
        _warm_up(s, v, runs_dir, datas, sched[0][0])
    print(f"d{hd}: {len(sched)} runs interleaved, each in a fresh process", flush=True)
    for (name, rep), block in itertools.groupby(sched, key=lambda x: x[:2]):
        ours, fresh = None, []
        for _, _, system in block:
            if runs.finished(name, system, rep, v):  # --resume: reuse, re-check below
                if system == "batchjob":
                    ours = _batchjob_outputs(runs_dir, name, rep)
                continue
            print(f"  d{hd} {name} rep {rep}: {system} ...", flush=True)
            r, outs = _run_fresh(s, v, system, name, rep, datas[name], runs_dir)
            ours = outs if system == "batchjob" else ours
            fresh.append(r)
        # match fractions against this repeat's batchjob outputs, whenever it ran
        runs.recheck_where(
            runs_dir, ours, workload=name, repeat=rep, head_dim=v.head_dim, model=v.label
        )
        for r in fresh:
            runs.record(recheck(r, runs_dir, ours), v)


def _warm_up(s: Settings, v: Variant, runs_dir: Path, datas: dict, name: str) -> None:
    """One run of each system on ``name``, not recorded: what a first run on this model
    pays once (vLLM's compile cache, the native engine's calibration, page cache) is paid
    here, outside every timed run."""
    for system in s.systems:
        print(f"  d{v.head_dim} {name} warm-up: {system} ...", flush=True)
        _run_fresh(s, v, system, name, 0, datas[name], runs_dir / "warmup")


def _run_fresh(
    s: Settings, v: Variant, system: str, name: str, rep: int, data: Path, work: Path
) -> tuple[RunResult, Outputs]:
    """``peers.run_fresh`` with this benchmark's settings, run folders under ``work``."""
    return peers.run_fresh(
        system, name, rep, data, s.scales[name][2], model=v.model, work=work, kv_gib=s.kv_gib,
        chunk_size=s.chunk_size, vllm_chunk=s.vllm_chunk, max_model_len=s.max_model_len,
        dtype=s.dtype, backend_chunk=s.backend_chunk,
    )  # fmt: skip


def _grouped(s: Settings, v: Variant, runs: Runs, runs_dir: Path, datas: dict) -> None:
    """batchjob/baseline/hf runs first, then each vLLM-family system's in one process."""
    hd, chosen = v.head_dim, s.systems
    ours_by: dict[tuple[str, int], Outputs] = {}
    # per repeat, each workload in file order then sorted: slow drift spreads over all
    pending = [
        (name, system, rep, datas[name])
        for rep in range(s.repeats)
        for name in s.scales
        for system in ("vllm-file", "vllm-sorted")
        if system in chosen and not runs.finished(name, system, rep, v)
    ]
    for name, (_, _, mt) in s.scales.items():
        data = datas[name]
        for rep in range(s.repeats):
            ours = None
            for system in sorted(chosen, key=lambda x: x != "batchjob"):  # batchjob first
                if runs.finished(name, system, rep, v):  # --resume: reuse, re-check
                    if system == "batchjob":
                        ours = _batchjob_outputs(runs_dir, name, rep)
                    runs.recheck_where(
                        runs_dir, ours, system=system, workload=name, repeat=rep,
                        head_dim=v.head_dim, model=v.label,
                    )  # fmt: skip
                    continue
                if "vllm" in system:
                    continue  # all vLLM runs: one process per system, below
                if system in ("batchjob", "baseline"):
                    policy = "batchllm" if system == "batchjob" else "baseline"
                    r, outs = peers.run_batchjob(
                        name, policy, rep, data, v.model, runs_dir, mt, s.kv_bytes,
                        s.chunk_size, ours, s.dtype,
                    )  # fmt: skip
                    ours = outs if system == "batchjob" else ours
                else:
                    r = peers.run_hf(name, rep, data, v.model, runs_dir, ours)
                runs.record(r, v)
            ours_by[(name, rep)] = ours
    if pending:
        print(f"d{hd} vLLM: {len(pending)} runs in one vllm_peer.py --plan process", flush=True)
        plan_args = (v.model, runs_dir, s.kv_gib, s.vllm_chunk, s.max_model_len, s.dtype)
        finished, err = peers.run_vllm_plan(pending, ours_by, *plan_args)
        for r in finished:
            runs.record(r, v)
        if err is not None:
            raise err
    for system in peers.BACKEND_POLICY:
        todo = [
            (name, rep, datas[name])
            for rep in range(s.repeats)
            for name in s.scales
            if system in chosen and not runs.finished(name, system, rep, v)
        ]
        if todo:
            print(f"d{hd} {system}: {len(todo)} runs in one batchjob_vllm_peer.py process")
            for r in peers.run_backend_plan(
                system, todo, v.model, runs_dir, s.kv_bytes, s.backend_chunk, ours_by,
                s.max_model_len, dtype=s.dtype,
            ):  # fmt: skip
                runs.record(r, v)
