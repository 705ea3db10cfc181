"""Starting jobs with mpiexec from tests: which mpiexec, running a script of tests/mpi/scripts, and
reading its ``RESULT {json}`` lines."""

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hetpipe.job.procs import environment_marker, processes_with, send

JOB_ENV = "HETPIPE_TEST_JOB"

SCRIPTS = Path(__file__).parent / "mpi" / "scripts"


def mpiexec():
    """The mpiexec beside this Python (the venv's MPICH), else one on PATH, else None."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def run_mpi(n: int, script: str, *args: str, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """Run a script of tests/mpi/scripts on ``n`` ranks; fails the test (not hangs) past ``timeout`` s.

    Past the timeout every process of the job is killed, found by a marker in its environment: MPICH
    gives each rank a session of its own, so killing mpiexec alone would leave the ranks running."""
    job = uuid.uuid4().hex
    full_env = {**os.environ, **(env or {}), JOB_ENV: job}
    cmd = [mpiexec(), "-n", str(n), sys.executable, str(SCRIPTS / script), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=SCRIPTS)
    except subprocess.TimeoutExpired as e:
        for pid in processes_with(environment_marker(JOB_ENV, job), exclude=[os.getpid()]):
            send(pid, signal.SIGKILL)
        pytest.fail(f"{script} on {n} ranks did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")


def results(proc: subprocess.CompletedProcess):
    import json

    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
