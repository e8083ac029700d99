"""Timing: a child process run and reaped with its wall time, max RSS and CPU time; repeats
in whole cycles; the time split of a cProfile dump of `batchjob run`."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


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


def median(runs: list[Any], field: str) -> float:
    """The median of ``field`` over ``runs`` (attributes or properties)."""
    return statistics.median(getattr(r, field) for r in runs)


def whole_cycles(calls: int, layers: int) -> int:
    """At least ``calls`` calls, in whole cycles over ``layers`` caches."""
    return layers * -(-calls // layers)


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
