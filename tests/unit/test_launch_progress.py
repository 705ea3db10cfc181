"""The launcher's view of progress outside training (launch.supervisor.Progress): a process that computes
makes progress, one that sleeps does not, one that sleeps but calls hetpipe.heartbeat() does; and the
rank's phase marks (job.rundir) that say where it is. Real processes, read through /proc."""

import os
import subprocess
import sys
import time

import pytest

from hetpipe.job.procs import cpu_ticks
from hetpipe.job.rundir import RUN_DIR_ENV, mark_phase, phases
from hetpipe.launch.supervisor import Progress

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")

PROGRAMS = {
    "computes": "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass\n",
    "sleeps": "import time\ntime.sleep(30)\n",
    "beats": "import time, hetpipe\nfor _ in range(300):\n    time.sleep(0.1)\n    hetpipe.heartbeat()\n",
}


def test_progress_is_cpu_time_or_a_heartbeat(tmp_path):
    env = {**os.environ, RUN_DIR_ENV: str(tmp_path)}
    procs = {name: subprocess.Popen([sys.executable, "-c", code], env=env) for name, code in PROGRAMS.items()}
    try:
        time.sleep(1.0)                                   # imports done; the sleeper is asleep
        progress = Progress()
        pids = {p.pid: name for name, p in procs.items()}
        progress.idle(pids, str(tmp_path), 0.0)
        time.sleep(1.5)
        idle = {pids[pid]: s for pid, s in progress.idle(pids, str(tmp_path), 1.5).items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert idle == {"computes": 0.0, "sleeps": 1.5, "beats": 0.0}, idle
    assert cpu_ticks(procs["computes"].pid) is None              # gone: no reading


def test_a_rank_marks_its_phase_where_the_launcher_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    mark_phase("start-up: planning")
    mark_phase("training")
    assert phases(str(tmp_path)) == {os.getpid(): "training"}
    assert not list(tmp_path.glob(".phase-*"))           # replaced atomically, no temporary left
