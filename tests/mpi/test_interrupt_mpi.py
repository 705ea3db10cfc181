"""Ctrl-C of a real run: one line for the job, no traceback from any rank, exit status 130.

A terminal's Ctrl-C sends SIGINT to the foreground process group: with ``hetpipe launch`` that is the
launcher alone (mpiexec runs in a session of its own), which ends the ranks and says where the run got
to and its last complete checkpoint; with a plain ``mpiexec`` it is mpiexec, which hands the SIGINT to
every rank, and rank 0 says it for the job. Before, each rank printed a KeyboardInterrupt traceback.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hetpipe.job.procs import environment_marker, processes_with, send
from mpirun import JOB_ENV, SCRIPTS, mpiexec

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

START_TIMEOUT_S = 240.0     # three ranks importing torch on a loaded 2-core host
EXIT_GUARD_S = 120.0        # a hang guard after the SIGINT, not a bound under test
WAVES = 2                   # waves trained before the interrupt


def _default_sigint() -> None:
    """In the child: SIGINT's default action, whatever the test runner's shell left it at (a background
    job's SIGINT is ignored, and an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(cmd, metrics: Path, group: bool):
    """Start ``cmd`` in a session of its own, SIGINT it (its process group with ``group``, as a terminal
    does, else its first process) once VW 0 trained ``WAVES`` waves; (exit status, stderr)."""
    job = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}, JOB_ENV: job}
    marker = environment_marker(JOB_ENV, job)
    proc = subprocess.Popen(cmd, cwd=SCRIPTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (metrics.exists() and metrics.read_text().count("\n") >= WAVES):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=EXIT_GUARD_S)
            time.sleep(0.1)
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=EXIT_GUARD_S)
        gone = time.monotonic() + 10.0      # the ranks mpiexec ended may take a moment to go
        while (left := processes_with(marker, exclude=[os.getpid()])) and time.monotonic() < gone:
            time.sleep(0.1)
    finally:
        for pid in processes_with(marker, exclude=[os.getpid()]):
            send(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err, left


def _hetpipe_lines(err: str):
    """The lines hetpipe wrote, less the start-up's note on the update rule."""
    return [line for line in err.splitlines() if line.startswith("hetpipe:") and "update rule" not in line]


def test_ctrl_c_of_a_launched_run_is_one_line_naming_the_checkpoint(tmp_path):
    metrics, ckpt, run_dir = tmp_path / "metrics.jsonl", tmp_path / "ckpt", tmp_path / "run"
    rc, err, left = _interrupt([sys.executable, "-m", "hetpipe", "launch", "-n", "3", "--run-dir", str(run_dir),
                                "--checkpoint-dir", str(ckpt), "endless.py", str(metrics)], metrics, group=True)
    assert rc == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = _hetpipe_lines(err)
    assert len(lines) == 1, err                 # not one line per rank (their SIGTERM checkpoints included)
    assert lines[0].startswith("hetpipe: interrupted by SIGINT at wave "), err
    assert f"; last complete checkpoint: {ckpt}{os.sep}clock-" in lines[0], err
    assert not left, f"processes of the run still alive: {left}"


def test_ctrl_c_of_a_plain_mpiexec_run_is_one_line_from_rank_0(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rc, err, left = _interrupt([mpiexec(), "-n", "3", sys.executable, str(SCRIPTS / "endless.py"), str(metrics)],
                               metrics, group=False)
    assert rc == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "failed" not in err, err
    lines = _hetpipe_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("hetpipe: interrupted (SIGINT) at wave ") and \
        lines[0].endswith("; the run writes no checkpoints"), err
    assert not left, f"processes of the run still alive: {left}"
