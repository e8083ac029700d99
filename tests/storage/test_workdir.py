"""Work folders: a SIGKILLed owner's is removed at the next start, a live owner's is kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from batchjob.storage.workdir import GRACE_S, OWNER, clean_abandoned, owned_workdir
from tests.e2e.jobkit import ROOT

KILLED = """
import os, signal, sys
from pathlib import Path
from batchjob.storage.workdir import owned_workdir
with owned_workdir(Path(sys.argv[1]), ".plan-spill-") as d:
    (d / "p00000.tok").write_bytes(b"x" * 64)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_owners_folder_goes_a_live_ones_stays(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], env=env, timeout=60)
    assert r.returncode == -9
    (dead,) = tmp_path.glob(".plan-spill-*")
    assert (dead / "p00000.tok").exists()
    with owned_workdir(tmp_path, ".plan-spill-") as live:  # cleans the dead one first
        assert not dead.exists()
        assert clean_abandoned(tmp_path, ".plan-spill-") == []  # held: kept
        assert live.is_dir()
    assert not live.exists()  # removed on exit


def test_a_folder_without_its_owner_file_is_kept_for_a_grace_period(tmp_path: Path) -> None:
    young = tmp_path / ".plan-spill-young"
    old = tmp_path / ".plan-spill-old"
    young.mkdir()
    old.mkdir()
    past = time.time() - GRACE_S - 5
    os.utime(old, (past, past))
    assert clean_abandoned(tmp_path, ".plan-spill-") == [old]
    assert young.is_dir() and not (young / OWNER).exists()
