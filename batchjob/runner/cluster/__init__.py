"""The plan split over the workers of a Ray cluster (``[cluster]`` in the job file).

The driver (``pipeline.run``) has the input read and tokenized by Ray tasks over its row
groups (``batchjob.runner.cluster.read``; one process for an input that cannot be split), then
plans the whole job as on one machine;
``run_on_cluster`` splits the plan into one shard per worker (``batchjob.plan.shard``:
groups whole, balanced by cost), runs each shard on an engine actor that writes its own
atomic part files into the job's parts folder, reruns the unfinished rows of a worker that
dies, and returns; the driver then commits every part as a single-machine run does (same
manifest, same exactly-once check, same resume). Ray is imported only when this runs.
"""

from __future__ import annotations

from batchjob.runner.cluster.driver import WorkersLostError, run_on_cluster
from batchjob.runner.cluster.read import load_prompts_on_cluster

__all__ = ["WorkersLostError", "load_prompts_on_cluster", "run_on_cluster"]
