"""The CPU kernel's build writes its library atomically: whole file or none, mode per umask."""

from __future__ import annotations

import os
import shutil

import pytest

from batchjob.kernels.cpu import build as cpu_build

needs_cc = pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHJOB_KERNEL_CACHE", str(tmp_path / "k"))
    return tmp_path / "k"


@needs_cc
def test_build_leaves_one_library_with_the_umask_mode(cache):
    old = os.umask(0o027)
    try:
        path = cpu_build.build("generic")
    finally:
        os.umask(old)
    assert path.parent == cache and sorted(os.listdir(cache)) == [path.name]
    assert os.stat(path).st_mode & 0o777 == 0o750  # the linker's 0777, less the umask
    assert cpu_build.build("generic") == path  # cached: not built again
    assert sorted(os.listdir(cache)) == [path.name]


def fake_compiler(folder, code: int) -> str:
    """Writes half a library to its -o path, then exits with ``code``."""
    cc = folder / f"cc{code}"
    cc.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo half > "$2"; shift; done\n'
        f"exit {code}\n"
    )
    cc.chmod(0o755)
    return str(cc)


def test_failed_build_leaves_nothing(cache, tmp_path):
    with pytest.raises(RuntimeError, match="failed"):
        cpu_build.build("generic", compiler=fake_compiler(tmp_path, 1))
    assert os.listdir(cache) == []


def test_interrupted_build_leaves_nothing(cache, tmp_path, monkeypatch):
    def interrupted(src, dst):  # fault injection: Ctrl-C arrives at the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(cpu_build.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cpu_build.build("generic", compiler=fake_compiler(tmp_path, 0))
    assert os.listdir(cache) == []
