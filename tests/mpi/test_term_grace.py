"""`hetpipe launch --term-grace`: when the launcher is interrupted, ranks whose SIGTERM handler is slow
(a checkpoint being written) get that long before SIGKILL; after it they are killed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import SCRIPTS

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 120.0
HANDLER_S = 1.5                     # rank r takes (1 + r) x this: rank 1 outlasts the 2 s of a fault teardown
# How long the test waits for the launcher after SIGINT: a hang guard, well under LONG_GRACE_S, so that a
# launcher waiting out the grace instead of the ranks fails the test.
EXIT_GUARD_S = 120.0
LONG_GRACE_S = 3600.0


def _interrupted_run(tmp_path: Path, grace_s: float):
    """Launch two slow-SIGTERM ranks, SIGINT the launcher once both are ready; (completed run, output
    folder, seconds from SIGINT to the launcher's exit)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}
    proc = subprocess.Popen([sys.executable, "-m", "hetpipe.cli", "launch", "-n", "2", "--term-grace", str(grace_s),
                             "--run-dir", str(tmp_path / "run"), str(SCRIPTS / "slow_sigterm.py"), str(out),
                             str(HANDLER_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env, cwd=SCRIPTS)
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(list(out.glob("ready-*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    interrupted = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=min(grace_s, EXIT_GUARD_S) + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the launcher did not exit within {min(grace_s, EXIT_GUARD_S) + 30:.0f} s of SIGINT "
                    f"(--term-grace {grace_s:g}):\n{stderr}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out, time.monotonic() - interrupted


def test_ranks_finish_a_slow_sigterm_handler_within_the_grace(tmp_path):
    # The grace is far longer than the test waits: the launcher exits because the ranks did.
    run, out, took = _interrupted_run(tmp_path, grace_s=LONG_GRACE_S)
    assert run.returncode == 128 + signal.SIGINT and "interrupted by SIGINT" in run.stderr, run.stderr
    assert sorted(p.name for p in out.glob("done-*")) == ["done-0", "done-1"], run.stderr
    assert took >= 2 * HANDLER_S, took             # it waited for rank 1's handler (a lower bound)


def test_ranks_past_the_grace_are_killed(tmp_path):
    run, out, _ = _interrupted_run(tmp_path, grace_s=0.5)
    assert run.returncode == 128 + signal.SIGINT, run.stderr
    assert not list(out.glob("done-*")), "a rank outlived --term-grace"


def test_term_grace_must_be_positive(tmp_path):
    run = subprocess.run([sys.executable, "-m", "hetpipe.cli", "launch", "-n", "1", "--term-grace", "0",
                          str(SCRIPTS / "slow_sigterm.py"), str(tmp_path), "0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "HETPIPE_TERM_GRACE (--term-grace) must be > 0 seconds" in run.stderr, run.stderr
