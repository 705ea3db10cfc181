"""Starting jobs with mpiexec from tests: which mpiexec, running a script of tests/mpi/scripts, and
reading its ``RESULT {json}`` lines."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "mpi" / "scripts"


def mpiexec():
    """The mpiexec beside this Python (the venv's MPICH), else one on PATH, else None."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def run_mpi(n: int, script: str, *args: str, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """Run a script of tests/mpi/scripts on ``n`` ranks; fails the test (not hangs) past ``timeout`` s."""
    full_env = {**os.environ, **(env or {})}
    cmd = [mpiexec(), "-n", str(n), sys.executable, str(SCRIPTS / script), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=SCRIPTS)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} on {n} ranks did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")


def results(proc: subprocess.CompletedProcess):
    import json

    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
