"""A run on a terminal: the start line and a progress bar, also on a pseudo-terminal that
reports no size (``script -qc``, ``docker run -t``), where tqdm drew nothing before; start
and end lines counting the same result rows; values in messages printed plainly."""

from __future__ import annotations

import io
import os
import pty
import re
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.cli import main
from batchjob.runner.progress import progress_bar, terminal_size
from tests.e2e.jobkit import cli, write_job


def _on_a_pty(monkeypatch, args: list[str]) -> str:
    """``batchjob ARGS`` in this process with stderr on a fresh pty (0 x 0, as ``script``
    makes it); what the terminal received."""
    master, slave = pty.openpty()
    assert os.get_terminal_size(slave).columns == 0  # the case tqdm drew nothing for
    received = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    term = open(slave, "w", buffering=1, closefd=False)  # noqa: SIM115
    monkeypatch.setattr(sys, "stderr", term)
    try:
        main.main(args, standalone_mode=False)
    finally:
        term.flush()
        seen = -1
        while seen != len(received):  # drained: nothing new for 0.2 s
            seen = len(received)
            time.sleep(0.2)
        os.close(slave)
        reader.join(timeout=5)
        os.close(master)
    return received.decode(errors="replace")


def test_bar_and_start_line_on_a_sizeless_pty(tmp_path, monkeypatch, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    rows = pq.read_metadata(run_data).num_rows
    shown = _on_a_pty(monkeypatch, ["run", str(job)])
    assert f"batchjob: {rows} rows: {rows} to run, 0 done earlier, 0 rejected" in shown
    assert re.search(rf"batchjob: 100%\|[^|]*\| {rows}/{rows} ", shown), shown


def test_fallback_size_only_where_the_terminal_says_none():
    master, slave = pty.openpty()
    try:
        with open(slave, "w", closefd=False) as term:
            assert terminal_size(term) == (80, 24)
            os.set_blocking(master, False)
            import fcntl
            import struct
            import termios

            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 132, 0, 0))
            assert terminal_size(term) == (None, None)  # tqdm's own reading
        assert terminal_size(io.StringIO()) == (80, 24)
        assert progress_bar(3, enabled=False).disable
    finally:
        os.close(slave)
        os.close(master)


def test_start_and_end_lines_count_the_same_results(tmp_path, monkeypatch, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    rows = pq.read_metadata(run_data).num_rows
    shown = _on_a_pty(monkeypatch, ["run", str(job), "--set", "sampling.n=2"])
    assert f"batchjob: {2 * rows} results of {rows} rows: {2 * rows} to run" in shown
    res = cli("run", job, "--set", "sampling.n=2", "--set", "output.overwrite=true")
    assert res.exit_code == 0, res.output
    assert f"{2 * rows} results of {rows} rows: {2 * rows} ok, 0 rejected" in res.output


def test_row_values_in_messages_are_plain_numbers(tmp_path, run_model):
    data = tmp_path / "p.parquet"
    pq.write_table(
        pa.table({"prompt": ["one two", "three four"], "temp": pa.array([0.5, -1.0])}), data
    )
    job = write_job(tmp_path, run_model, data, "out/results.parquet")
    res = cli("run", job, "--set", "input.temperature_column=temp")
    assert res.exit_code == 0, res.output
    out = pq.read_table(tmp_path / "out/results.parquet").sort_by("row_id")
    message = out.column("message").to_pylist()[1]
    assert "= -1.0: must be in [0, " in message and "np." not in message, message
