"""``pytest --cpu-hog N`` (``make stress``): the session runs beside N busy-loop processes, which end with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PROBE = """
import os
from pathlib import Path


def test_probe(cpu_hogs):
    assert len(cpu_hogs) == int(os.environ["HOGS"])
    for h in cpu_hogs:  # alive, running the busy loop, children of this session
        assert h.poll() is None
        assert b"while os.getppid() == parent" in Path(f"/proc/{h.pid}/cmdline").read_bytes()
        assert int(Path(f"/proc/{h.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()
    Path(os.environ["PIDS"]).write_text(" ".join(str(h.pid) for h in cpu_hogs))
"""


def _session(tmp_path: Path, *args: str, hogs: int = 0) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "HOGS": str(hogs), "PIDS": str(tmp_path / "pids")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", *args, "test_probe.py"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_cpu_hog_runs_busy_processes_for_the_session_and_stops_them(tmp_path):
    r = _session(tmp_path, "--cpu-hog", "2", hogs=2)
    assert r.returncode == 0, r.stdout + r.stderr
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    for pid in pids:  # killed and reaped when the session ended
        assert (
            not Path(f"/proc/{pid}").exists() or b"while os.getppid()" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        )


def test_without_the_option_there_is_no_hog_and_a_negative_count_is_refused(tmp_path):
    assert _session(tmp_path).returncode == 0
    r = _session(tmp_path, "--cpu-hog", "-1")
    assert r.returncode != 0 and "--cpu-hog -1: give a number of processes >= 0" in r.stderr
