"""The launcher's death watcher names the first rank process to vanish without a mark, whatever
order the others die in afterwards (mpiexec kills them and may report any)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hetpipe.job.rundir import RUN_DIR_ENV, mark_aborted, marked, ranks_by_pid, register_rank
from hetpipe.launch.deaths import DeathWatcher

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux >= 5.3)")


def _ranks(run_dir, n):
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(n)]
    for r, p in enumerate(procs):
        (run_dir / f"rank-{r}.txt").write_text(f"{p.pid}\nrank {r} (vw 0 stage {r})\n")
    return procs


def _wait_seen(watcher, procs):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(ranks_by_pid(watcher.run_dir)) < len(procs):
        time.sleep(0.01)
    time.sleep(0.1)     # the watcher has opened every pidfd


def test_first_killed_rank_is_named_not_the_ones_killed_after(tmp_path):
    procs = _ranks(tmp_path, 4)
    watcher = DeathWatcher(str(tmp_path), 4).start()
    try:
        _wait_seen(watcher, procs)
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait()
        time.sleep(0.05)
        for p in (procs[3], procs[0], procs[1]):   # the teardown, in an order that names another rank
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
        time.sleep(0.1)
    finally:
        watcher.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert watcher.supported
    assert watcher.vanished[0] == procs[2].pid and sorted(watcher.vanished) == sorted(p.pid for p in procs)
    assert watcher.first_unmarked() == procs[2].pid


def test_ranks_that_exited_normally_are_skipped(tmp_path):
    procs = _ranks(tmp_path, 2)
    watcher = DeathWatcher(str(tmp_path), 2).start()
    try:
        _wait_seen(watcher, procs)
        (tmp_path / f"exited-{procs[0].pid}").touch()
        procs[0].terminate()
        procs[0].wait()
        time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        time.sleep(0.1)
    finally:
        watcher.stop()
    assert watcher.vanished == [procs[0].pid, procs[1].pid]
    assert watcher.first_unmarked() == procs[1].pid


def test_rank_records_and_marks(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    code = ("from hetpipe.job.rundir import register_rank, mark_aborted; import sys; "
            "register_rank(3, 'rank 3 (PS shard 0)'); sys.exit(0)")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, RUN_DIR_ENV: str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (pid, role), = ranks_by_pid(str(tmp_path)).items()
    assert role == "rank 3 (PS shard 0)" and marked(str(tmp_path), "exited") == {pid}
    mark_aborted()
    assert marked(str(tmp_path), "aborted") == {os.getpid()}


def test_without_a_run_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    register_rank(0, "rank 0")
    mark_aborted()
    assert list(tmp_path.iterdir()) == []


def test_run_processes_are_found_by_environment_and_stopped_ones_seen(tmp_path):
    from hetpipe.job.procs import environment_marker, processes_with, running, state, stopped

    env = {**os.environ, RUN_DIR_ENV: str(tmp_path)}
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**env, RUN_DIR_ENV: str(tmp_path) + "-other"})
    try:
        assert processes_with(environment_marker(RUN_DIR_ENV, str(tmp_path))) == [mine.pid]
        mine.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not stopped(mine.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state(mine.pid) == "T" and not stopped(other.pid)
        mine.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while running(mine.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state(mine.pid) == "Z" and not running(mine.pid)      # a zombie until reaped
        assert processes_with(environment_marker(RUN_DIR_ENV, str(tmp_path))) == []
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()
    assert state(mine.pid) is None
