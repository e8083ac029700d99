"""The processes a ``cluster.address = "local"`` driver starts die with it, however it dies.

``ray.init`` starts Ray's processes as the driver's children (they follow it when it dies),
but the raylet starts ``DashboardAgent`` and ``RuntimeEnvAgent`` itself, and those watch only
the raylet: after a SIGKILL of the driver they stayed behind. ``watch_descendants()`` (called
before ``ray.init``) starts a small reaper process that notes every descendant of the driver
twice a second (Ray's processes only) and, the moment the driver's end of a pipe closes (it
exited or was killed), sends each one still alive (same pid, same start time) SIGTERM, then
SIGKILL after a grace.

Linux only (``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

POLL_S = 0.5  # how often the reaper notes the driver's descendants
GRACE_S = 2.0  # SIGTERM, then SIGKILL this much later

_watcher: subprocess.Popen | None = None  # held: its pipe closing is the driver's end


def watch_descendants() -> None:
    """Start the reaper for this process (once; a no-op without /proc)."""
    global _watcher
    if _watcher is not None or not os.path.isdir("/proc/self/task"):
        return
    run = f"from batchjob.runner.cluster.reaper import main; main({os.getpid()})"
    _watcher = subprocess.Popen(
        [sys.executable, "-c", run],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a Ctrl-C of the driver's terminal does not stop it first
    )


def stop_watching() -> None:
    """A normal end: the reaper takes what is left (nothing, after ``ray.shutdown``)."""
    global _watcher
    if _watcher is not None:
        assert _watcher.stdin is not None
        _watcher.stdin.close()
        _watcher.wait(timeout=GRACE_S + 5)
        _watcher = None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process; None: gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


def _is_ray(pid: int) -> bool:
    """Ray's own processes: its binaries and scripts (``.../ray/...``), its ``ray::`` workers
    and agents. Nothing else the driver's process started (a notebook's) is touched."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return cmd.startswith(b"ray::") or b"/ray/" in cmd


def _descendants(root: int, known: dict[int, int]) -> dict[int, int]:
    """{pid: start time} of every live Ray process below ``root`` or below a ``known`` one."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p)))}
    below: dict[int, int] = {}
    frontier = {root, *(p for p, t in known.items() if stats.get(p, (0, -1))[1] == t)}
    while frontier:
        children = {p for p, (ppid, _) in stats.items() if ppid in frontier and p not in below}
        below |= {p: stats[p][1] for p in children}
        frontier = children
    return {p: t for p, t in below.items() if p != os.getpid() and _is_ray(p)}


def _signal(procs: dict[int, int], sig: int) -> dict[int, int]:
    """Send ``sig`` to each process still the one noted; -> those it was sent to."""
    sent = {}
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[1] == start:
            try:
                os.kill(pid, sig)
                sent[pid] = start
            except OSError:
                pass
    return sent


def main(driver: int) -> None:
    """The reaper: watch ``driver``'s descendants until stdin closes, then end them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    known: dict[int, int] = {}
    while True:
        known |= _descendants(driver, known)
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 1):  # EOF: the driver is gone
            break
    known |= _descendants(driver, known)
    left = _signal(known, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p: t for p, t in left.items() if (s := _stat(p)) is not None and s[1] == t}
    _signal(left, signal.SIGKILL)
