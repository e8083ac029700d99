"""Run a planned job over the workers of a Ray cluster, surviving the loss of workers.

Work items are shards of the global plan (``batchjob.plan.shard``: groups whole, LPT by
cost), one per worker at the start. A worker that dies (its process killed, its node lost)
fails its pending call with ``RayActorError``; the rows of its item that are not in a part
file yet are planned again as a new item, which a replacement worker (up to
``cluster.max_restarts`` per worker) or the next worker to go idle takes. Rows a dead
worker wrote stay written and are not redone. When every worker is gone with work left, the
job stops with ``WorkersLostError`` (exit 1: retry; a rerun resumes from the parts).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from batchjob.config import ClusterConfig, JobConfig
from batchjob.errors import EXIT_RUNTIME, BatchJobError, ConfigError
from batchjob.outputs.naming import OutputLayout
from batchjob.outputs.results import ResultSink
from batchjob.outputs.score_columns import job_columns
from batchjob.plan.build import plan_job
from batchjob.plan.plan import Plan
from batchjob.plan.shard import shard_plan, split
from batchjob.runner.cluster.reaper import stop_watching, watch_descendants
from batchjob.runner.cluster.worker import DriverInfo, ShardWorker, workers_dir
from batchjob.runner.execute import Execution, merge, select_rows
from batchjob.runner.heartbeat import Heartbeat
from batchjob.tokenize.prompts import TokenizedPrompts

log = logging.getLogger(__name__)

W = TypeVar("W")  # a work item the driver queues

ACTOR_PREFIX = "batchjob-"  # actor names: batchjob-<run token>-<writer id>
# the driver's object-store settings and credentials go with its workers (a cluster's nodes
# may have none of their own; instance roles and ~/.aws on the nodes still apply)
FORWARDED_ENV = ("AWS_",)


class WorkersLostError(BatchJobError, exit_code=EXIT_RUNTIME):
    """Every worker of the cluster died with rows left; the written rows are kept."""


@dataclass
class _Work:
    what: str  # for the log: "shard 1", "12 rows left by w0"
    prompts: TokenizedPrompts
    plan: Plan


@dataclass
class _Slot:
    index: int
    restarts: int = 0
    actor: Any = None  # None: dead, no replacement left
    busy: bool = False

    @property
    def writer(self) -> str:
        return f"w{self.index}" + (f"r{self.restarts}" if self.restarts else "")


def _first_line(err: Exception) -> str:
    """The first line of a Ray error that says something (they start with boilerplate)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    useful = [ln for ln in lines if "Error" in ln and "The actor died" not in ln]
    return (useful[-1] if useful else lines[0] if lines else type(err).__name__)[:300]


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "cluster.address: running on a cluster needs Ray: pip install 'batchjob[ray]'"
        ) from None
    return ray


def connect(ray, cfg: ClusterConfig) -> bool:
    """Join (or start, for "local") the cluster; True when this call started Ray here."""
    if ray.is_initialized():
        return False
    if cfg.address == "local":  # Ray started here ends with this process, however it ends
        watch_descendants()
    try:
        ray.init(
            address=cfg.address,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise WorkersLostError(
            f"cluster.address: cannot reach the Ray cluster at {cfg.address!r}: {e}"
        ) from None
    return True


def disconnect(ray, started: bool) -> None:
    """Leave the cluster; a Ray that ``connect`` started here is shut down, leftovers reaped."""
    if started:
        ray.shutdown()
        stop_watching()


def runtime_options() -> dict[str, Any]:
    """Ray options that give a task or actor the driver's forwarded environment."""
    if env := {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}:
        return {"runtime_env": {"env_vars": env}}
    return {}


def run_on_cluster(
    job: JobConfig,
    layout: OutputLayout,
    manifest: dict,
    prompts: TokenizedPrompts,
    plan: Plan,
    text_prompts: bool,
    progress: bool = False,
    heartbeat_s: float | None = None,
    run_token: str = "",
) -> Execution:
    """Run ``plan`` over ``prompts`` on ``job.cluster.workers`` engine actors; every row ends
    in a part file of ``layout`` (or the call raises). The driver commits the parts after.
    ``run_token``: the run's (in the output's lock and every part name; default: a new one)."""
    if not len(prompts):  # every row written by an earlier run: nothing to start Ray for
        return merge([], plan, f"ray:{job.cluster.workers}xnone", 0.0)
    ray = _import_ray()
    started = connect(ray, job.cluster)
    try:
        driver = _Driver(ray, job, layout, manifest, text_prompts, run_token)
        driver.heartbeat = Heartbeat(len(prompts), heartbeat_s) if heartbeat_s else None
        return driver.run(prompts, plan)
    finally:
        disconnect(ray, started)


class _Driver:
    def __init__(
        self, ray, job: JobConfig, layout: OutputLayout, manifest: dict, text: bool, token: str = ""
    ):
        self.ray, self.job, self.layout, self.manifest, self.text = ray, job, layout, manifest, text
        self.actor_cls = ray.remote(ShardWorker)
        self.token = token or uuid.uuid4().hex[:8]
        self.driver = DriverInfo.here()  # workers on this host watch this process
        self.slots = [_Slot(i) for i in range(job.cluster.workers)]
        self.last_error = ""
        self.heartbeat: Heartbeat | None = None  # the operator's log: a line per interval

    def _start(self, slot: _Slot) -> None:
        cfg = self.job.cluster
        slot.actor = self.actor_cls.options(
            name=f"{ACTOR_PREFIX}{self.token}-{slot.writer}",
            num_cpus=cfg.num_cpus,
            num_gpus=cfg.num_gpus,
            max_restarts=0,  # a replacement is a new actor with a new writer id
            **runtime_options(),
        ).remote(*self._actor_args(slot))
        slot.busy = False

    def _actor_args(self, slot: _Slot) -> tuple:
        """The worker's constructor arguments."""
        return (
            self.job,
            self.layout,
            self.manifest,
            self.text,
            slot.writer,
            self.token,
            self.driver,
        )

    def _left_over(self, work: _Work) -> _Work | None:
        """The rows of ``work`` that no part file holds, planned again (None: all written)."""
        job = self.job
        columns = job_columns(job.sampling, job.input, job.output.reasoning_parser, job.model.task)
        done = ResultSink(self.layout, self.manifest, extra_columns=columns).done_keys()
        rest = select_rows(work.prompts, ~np.isin(work.prompts.keys, done))
        if not len(rest):
            return None
        return _Work(f"{len(rest)} rows left by {work.what}", rest, plan_job(rest, job.scheduler))

    def run(self, prompts: TokenizedPrompts, plan: Plan) -> Execution:
        cfg = self.job.cluster
        t0 = time.perf_counter()
        sharding = shard_plan(plan, prompts.lengths, cfg.workers)
        queue: deque[_Work] = deque()
        for s, (shard, shard_plan_) in enumerate(split(prompts, plan, sharding)):
            if len(shard):
                queue.append(_Work(f"shard {s}", shard, shard_plan_))
        log.info(
            "cluster: %d rows, %d groups over %d workers (cost spread %.2f%%)",
            len(prompts),
            plan.num_groups,
            cfg.workers,
            100 * sharding.spread,
        )
        results: list[Execution] = []

        def done(slot: _Slot, work: _Work, answer: Execution) -> None:
            results.append(answer)
            log.info("cluster: %s done on %s", work.what, slot.writer)

        self.dispatch(
            queue,
            submit=lambda slot, work: slot.actor.run.remote(work.prompts, work.plan),
            done=done,
            lost=lambda slot, work, err: self._lost(slot, work, queue, err),
            waiting=lambda running: self._beat(len(prompts), results, running),
            left=lambda: f"{sum(len(w.prompts) for w in queue)} rows",
        )
        return merge(results, plan, self._device(results), time.perf_counter() - t0)

    def dispatch(
        self,
        queue: deque[W],
        submit: Callable[[_Slot, W], Any],
        done: Callable[[_Slot, W, Any], None],
        lost: Callable[[_Slot, W, Exception], None],
        waiting: Callable[[dict], None],
        left: Callable[[], str],
    ) -> None:
        """Start the workers and hand each idle one the next item of ``queue`` (``submit``
        returns the call's ref) until none is queued or running. A worker's answer goes to
        ``done``; a dead worker is killed for sure, ``lost`` queues again what it left, then
        its slot gets a new actor while ``cluster.max_restarts`` allows. ``waiting`` is
        called at every heartbeat with nothing finished. A task that raised a
        ``BatchJobError`` re-raises it here; every worker is killed on the way out, the
        workers' folder removed when all is done."""
        ray, cfg = self.ray, self.job.cluster
        for slot in self.slots:
            self._start(slot)
        running: dict[Any, tuple[_Slot, W]] = {}
        try:
            while queue or running:
                for slot in self.slots:
                    if queue and slot.actor is not None and not slot.busy:
                        item = queue.popleft()
                        running[submit(slot, item)] = (slot, item)
                        slot.busy = True
                if not running:
                    raise WorkersLostError(
                        f"every cluster worker died ({cfg.workers} workers, "
                        f"cluster.max_restarts = {cfg.max_restarts}) with {left()} left; the "
                        f"rows written are kept: rerun the job to resume (last: "
                        f"{self.last_error})"
                    )
                every = self.heartbeat.every_s if self.heartbeat else None
                ready, _ = ray.wait(list(running), num_returns=1, timeout=every)
                if not ready:
                    waiting(running)
                    continue
                [ref] = ready
                slot, item = running.pop(ref)
                slot.busy = False
                try:
                    answer = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._retire(slot, e)
                    lost(slot, item, e)
                    self._replace(slot)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, BatchJobError):
                        raise cause from None  # bad config/model: its own exit code
                    raise
                else:
                    done(slot, item, answer)
        finally:
            for slot in self.slots:
                if slot.actor is not None:
                    ray.kill(slot.actor, no_restart=True)
        if isinstance(info := workers_dir(self.layout), Path):  # (on a store: left, tiny)
            shutil.rmtree(info, ignore_errors=True)

    def _retire(self, slot: _Slot, err: Exception) -> None:
        """Make sure a worker whose call failed is gone (an unreachable actor is not always
        a dead one) before its unwritten rows go to another: two writers of a row would be
        a duplicate."""
        self.ray.kill(slot.actor, no_restart=True)
        self.last_error = f"{slot.writer}: {_first_line(err)}"
        slot.actor = None

    def _replace(self, slot: _Slot) -> None:
        """A new actor for a retired slot, while ``cluster.max_restarts`` allows."""
        if slot.restarts < self.job.cluster.max_restarts:
            slot.restarts += 1
            self._start(slot)

    def _lost(self, slot: _Slot, work: _Work, queue: deque[_Work], err: Exception) -> None:
        rest = self._left_over(work)
        log.warning(
            "cluster: worker %s died (%s); %s",
            slot.writer,
            _first_line(err),
            f"{rest.what} run again" if rest else f"{work.what} was fully written",
        )
        if rest is not None:
            queue.appendleft(rest)

    def _beat(self, total: int, results: list[Execution], running: dict) -> None:
        if self.heartbeat:
            done = sum(e.requests_run + e.over_budget for e in results)
            lost = sum(s.restarts + (s.actor is None) for s in self.slots)
            self.heartbeat.say(
                f"cluster: {len(results)} shards done ({done} of {total} rows), "
                f"{len(running)} workers busy, {lost} workers lost so far"
            )

    def _device(self, results: list[Execution]) -> str:
        devices = sorted({e.device for e in results})
        return f"ray:{self.job.cluster.workers}x{'+'.join(devices) or 'none'}"
