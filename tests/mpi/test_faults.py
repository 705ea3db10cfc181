"""Fault suite: real `hetpipe launch` runs under mpiexec, faults injected at seeded random times after
training started; the run ends by itself with no process left, and the failed rank is named. How long
the teardown took is printed (the peer timeout plus a few seconds on an idle host), not asserted: a
loaded host stretches it, and the outcome's cause already says which mechanism ended the run.

The reference for "no process survives" is the kernel's, read here independently of the launcher:
every pid the run directory records (ranks, launcher, mpiexec) and every process whose environment
carries the run's HETPIPE_RUN_DIR (proxies and all) must be gone or a zombie by the deadline.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import SCRIPTS

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux >= 5.3)")]

PEER_TIMEOUT_S = 4.0
GONE_GUARD_S = 120.0                    # a hang guard for the teardown, not a bound under test
START_TIMEOUT_S = 180.0                 # start-up on a loaded 2-core machine
ROLES = {0: "rank 0 (vw 0 stage 0)", 1: "rank 1 (vw 0 stage 1)", 2: "rank 2 (ps shard 0)"}


def _alive(pid: int, run_dir: Path) -> bool:
    """Whether ``pid`` runs (not a zombie) and still belongs to this run (its environment says so)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZXx" and f"HETPIPE_RUN_DIR={run_dir}\0".encode() in env


def _run_processes(run_dir: Path) -> set:
    """Every pid recorded in the run directory, and every process carrying the run's environment."""
    pids = {int(f.read_text().split()[0]) for f in run_dir.glob("*.pid")}
    pids |= {int(f.read_text().split()[0]) for f in run_dir.glob("rank-*.txt")}
    pids |= {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    return {pid for pid in pids if pid != os.getpid() and _alive(pid, run_dir)}


def _rank_pid(run_dir: Path, rank: int) -> int:
    return int((run_dir / f"rank-{rank}.txt").read_text().split()[0])


class Run:
    """One `hetpipe launch -n 3 endless.py` (or ``script``) in a session of its own, like a job started
    from a shell."""

    def __init__(self, tmp_path: Path, *script: str) -> None:
        self.run_dir = tmp_path / "run"
        self.metrics = tmp_path / "metrics.jsonl"
        self.err = tmp_path / "launcher.err"
        cmd = [sys.executable, "-m", "hetpipe.cli", "launch", "-n", "3", "--timeout", str(PEER_TIMEOUT_S),
               "--run-dir", str(self.run_dir), *(script or ("endless.py", str(self.metrics)))]
        env = {k: v for k, v in os.environ.items() if k != "HETPIPE_TIMEOUT"}
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=SCRIPTS, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)

    def wait_training(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.metrics.exists() and self.metrics.read_text().count("\n") >= 1 and \
                    len(list(self.run_dir.glob("rank-*.txt"))) == 3:
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended before training started:\n{self.err.read_text()}")
            time.sleep(0.1)
        pytest.fail(f"training did not start within {START_TIMEOUT_S} s:\n{self.err.read_text()}")

    def pid_of(self, target: str) -> int:
        if target.startswith("rank"):
            return _rank_pid(self.run_dir, int(target[4:]))
        return int((self.run_dir / f"{target}.pid").read_text())

    def wait_gone(self, since: float) -> float:
        """Seconds from ``since`` until no process of the run (launcher included) is left; fails past the
        hang guard."""
        while True:
            self.proc.poll()        # reap the launcher, our child
            left = _run_processes(self.run_dir)
            if self.proc.returncode is not None and not left:
                return time.monotonic() - since
            if time.monotonic() - since > GONE_GUARD_S:
                pytest.fail(f"{len(left)} process(es) of the run still alive {GONE_GUARD_S} s after the fault: "
                            f"{sorted(left)}\n{self.err.read_text()}")
            time.sleep(0.05)

    def clean_up(self) -> None:
        for pid in _run_processes(self.run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def outcome(self) -> dict:
        return json.loads((self.run_dir / "outcome.json").read_text())


# (fault, whom, signal, expected cause, expected culprit rank or None)
FAULTS = [
    ("stage-kill", "rank1", signal.SIGKILL, "died", 1),
    ("stage-term", "rank0", signal.SIGTERM, "terminated", 0),
    ("stage-stop", "rank1", signal.SIGSTOP, "stopped", 1),
    ("ps-kill", "rank2", signal.SIGKILL, "died", 2),
    ("ps-term", "rank2", signal.SIGTERM, "terminated", 2),
    ("ps-stop", "rank2", signal.SIGSTOP, "stopped", 2),
    ("ctrl-c", "launcher-group", signal.SIGINT, "signal", None),
    ("launcher-term", "launcher", signal.SIGTERM, "signal", None),
    ("mpiexec-kill", "mpiexec", signal.SIGKILL, "mpiexec", None),
    ("mpiexec-stop", "mpiexec", signal.SIGSTOP, "stopped", None),
    ("mpiexec-term", "mpiexec", signal.SIGTERM, "signal", None),
    ("mpiexec-int", "mpiexec", signal.SIGINT, "signal", None),
    ("launcher-kill", "launcher", signal.SIGKILL, None, None),
]


@pytest.mark.parametrize("fault,whom,sig,cause,rank", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_ends_every_process_and_names_the_culprit(tmp_path, fault, whom, sig, cause, rank):
    run = Run(tmp_path)
    try:
        run.wait_training()
        time.sleep(random.Random(fault).uniform(0.0, 1.5))     # a seeded random moment of the training
        at = time.monotonic()
        if whom == "launcher-group":
            os.killpg(run.proc.pid, sig)                        # what a terminal's Ctrl-C does
        else:
            os.kill(run.pid_of("launcher" if whom == "launcher" else whom), sig)
        took = run.wait_gone(at)
        print(f"{fault}: every process of the run gone {took:.2f} s after the fault")
    finally:
        run.clean_up()
    err = run.err.read_text()
    if cause is None:           # SIGKILL of the launcher: nobody is left to write an outcome
        return
    out = run.outcome()
    assert out["cause"] == cause, (out, err)
    assert out["status"] == ("interrupted" if cause == "signal" else "failed")
    assert run.proc.returncode == out["exit_status"] != 0
    assert out["reason"], out                       # why the launcher blamed whom it did
    assert "Traceback" not in err, err
    name = signal.Signals(sig).name
    if cause == "signal":
        assert run.proc.returncode == 128 + sig and out["rank"] is None, out
        if whom == "mpiexec":       # forwarded to every rank: no rank is blamed, the signal is named
            assert name in out["message"] and "from outside the launcher" in out["message"], out
        else:
            assert f"interrupted by {name}" in err
    if rank is not None:
        assert out["rank"] == rank and out["role"] == ROLES[rank], out
        said = {"died": "failed: it died", "stopped": "failed: it stopped responding",
                "terminated": "was ended by a SIGTERM from outside the run"}[cause]
        assert f"hetpipe: {ROLES[rank]} {said}" in err
    if cause == "stopped":
        assert "state T" in out["message"]
    if whom == "mpiexec" and cause == "stopped":
        assert out["role"] == f"mpiexec (pid {out['pid']})" and out["rank"] is None, out
    if cause == "mpiexec":
        assert "mpiexec was killed by SIGKILL" in err


def test_rank_that_raises_is_named_from_its_own_report(tmp_path):
    run = Run(tmp_path, "failing.py", "raise", "1")
    try:
        run.proc.wait(timeout=START_TIMEOUT_S)
        assert not _run_processes(run.run_dir)
    finally:
        run.clean_up()
    out = run.outcome()
    assert (out["status"], out["cause"], out["rank"], out["role"]) == ("failed", "reported", 1, ROLES[1]), out
    assert out["message"] == "hetpipe: rank 1 (vw 0 stage 1) failed: RuntimeError: deliberate failure in the " \
                             "forward pass"
    assert run.proc.returncode == out["exit_status"] != 0


@pytest.mark.parametrize("mode, said", [
    ("forge", "rank 1 sent a push of wave 0 claiming VW 0 stage 0, which is rank 0 (a forged or corrupt header"),
    ("farpull", "pull of wave 50 from VW 0 stage 1 (rank 1) is beyond VW 0's clock")])
def test_a_malformed_message_is_blamed_on_its_sender_not_on_the_shard_or_the_claimed_rank(tmp_path, mode, said):
    """Rank 1 sends the PS shard (rank 2) a push header claiming rank 0's stage, or a pull of a wave no stage
    can request yet: the shard fails, and the launcher names rank 1, the message's transport source, not the
    shard that reported it nor the rank the header claims."""
    run = Run(tmp_path, "failing.py", mode, "1")
    try:
        run.proc.wait(timeout=START_TIMEOUT_S)
        assert not _run_processes(run.run_dir)
    finally:
        run.clean_up()
    out, err = run.outcome(), run.err.read_text()
    assert (out["status"], out["cause"], out["rank"], out["role"]) == ("failed", "reported", 1, ROLES[1]), out
    assert out["message"].startswith("hetpipe: rank 2 (ps shard 0) failed: WSPViolation: PS shard 0: ") and \
        said in out["message"], out
    assert "rank 2 (ps shard 0) was the first to report a failure, caused by a message from rank 1" in out["reason"]
    assert run.proc.returncode == out["exit_status"] != 0
    assert "Traceback" not in err, err


@pytest.mark.parametrize("mode, cause", [("sleep", "unregistered"), ("stop", "stopped")])
def test_a_rank_that_never_reaches_mpi_start_up_is_named_and_nothing_survives(tmp_path, monkeypatch, mode, cause):
    """A rank stalled (asleep, or stopped) before MPI_Init: the others wait in MPI start-up. The launcher
    names it, by its MPI rank, once the start-up timeout (stopped: half the peer timeout) has passed, and
    every process of the run is gone."""
    monkeypatch.setenv("HETPIPE_START_TIMEOUT", "6")
    run = Run(tmp_path, "stall_start.py", mode, "1")
    try:
        run.proc.wait(timeout=6 + GONE_GUARD_S)
        deadline = time.monotonic() + 10
        while _run_processes(run.run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _run_processes(run.run_dir)
    finally:
        run.clean_up()
    out = run.outcome()
    assert (out["status"], out["cause"], out["rank"]) == ("failed", cause, 1), out
    assert run.proc.returncode != 0
    if mode == "sleep":
        assert out["message"].startswith("hetpipe: rank(s) [1] did not reach MPI start-up, making no progress for"), out
        # What the launcher measured and acted on: no progress for at least the start-up timeout.
        waited = float(re.search(r"no progress for ([0-9.]+) s", out["message"]).group(1))
        assert waited >= 6.0, out
        assert "(rank 1: process" in out["message"] and "rank(s) [0, 2] waited for them in MPI_Init" in out["message"]
        assert "--start-timeout" in out["message"] and "stuck, not slow" in out["message"]
    else:
        assert out["message"].startswith("hetpipe: rank 1 failed: it stopped responding"), out


@pytest.mark.parametrize("mode", ["compute", "heartbeat"])
def test_a_slow_start_that_makes_progress_is_not_ended(tmp_path, monkeypatch, mode):
    """A rank that computes (a dataset load) or waits while calling hetpipe.heartbeat() before MPI
    start-up for three times the start-up timeout: slow, not stuck. The run completes."""
    monkeypatch.setenv("HETPIPE_START_TIMEOUT", "3")
    run = Run(tmp_path, "stall_start.py", mode, "1", "9")
    try:
        run.proc.wait(timeout=9 + START_TIMEOUT_S)
    finally:
        run.clean_up()
    assert run.proc.returncode == 0, run.err.read_text()
    assert run.outcome()["status"] == "ok"


def _process_of_rank(run_dir: Path, rank: int, deadline_s: float = START_TIMEOUT_S) -> int:
    """The pid of MPI rank ``rank`` of the run, found by its environment before it registers."""
    marker = f"HETPIPE_RUN_DIR={run_dir}\0".encode()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                env = (p / "environ").read_bytes()
            except OSError:
                continue
            if marker in env and f"PMI_RANK={rank}\0".encode() in env and _alive(int(p.name), run_dir):
                return int(p.name)
        time.sleep(0.1)
    pytest.fail(f"no process of rank {rank} within {deadline_s} s")


def _wait_files(run_dir: Path, *names: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all((run_dir / name).exists() for name in names):
        if time.monotonic() > deadline:
            pytest.fail(f"{names} not all in the run directory within {START_TIMEOUT_S} s")
        time.sleep(0.05)


def test_a_rank_killed_before_mpi_start_up_is_named(tmp_path, monkeypatch):
    """Rank 1 is in its script's own code (its first line, hetpipe.job.bootstrap, has run) and its peers
    wait in MPI_Init when it is killed."""
    monkeypatch.setenv("HETPIPE_START_TIMEOUT", "120")
    run = Run(tmp_path, "stall_start.py", "sleep", "1")
    try:
        victim = _process_of_rank(run.run_dir, 1)
        _wait_files(run.run_dir, f"spawned-{victim}", "starting-0", "starting-2")
        at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        took = run.wait_gone(at)
        print(f"killed before MPI start-up: every process gone {took:.2f} s after the kill")
    finally:
        run.clean_up()
    out = run.outcome()
    assert (out["status"], out["cause"], out["rank"], out["pid"]) == ("failed", "died", 1, victim), out
    assert out["message"].startswith("hetpipe: rank 1 failed: it died before MPI start-up"), out
    assert "Traceback" not in run.err.read_text()


def test_a_rank_dead_before_the_launcher_ever_saw_it_is_named(tmp_path, monkeypatch):
    """The launcher is stopped (SIGSTOP) from just after it started mpiexec until mpiexec has ended the
    job on rank 1's death, so its scan of the process table never saw a rank: as on a host so loaded
    that a rank dies between two of its scans. The rank's own start record names it."""
    monkeypatch.setenv("HETPIPE_START_TIMEOUT", "120")
    run = Run(tmp_path, "stall_start.py", "sleep", "1")
    try:
        _wait_files(run.run_dir, "mpiexec.pid")
        while not (run.run_dir / "mpiexec.pid").read_text().strip():
            time.sleep(0.01)
        os.kill(run.proc.pid, signal.SIGSTOP)
        mpiexec = run.pid_of("mpiexec")
        victim = _process_of_rank(run.run_dir, 1)
        _wait_files(run.run_dir, f"spawned-{victim}", "starting-0", "starting-2")
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + GONE_GUARD_S
        while _alive(mpiexec, run.run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(mpiexec, run.run_dir), "mpiexec did not end the job after a rank died"
        os.kill(run.proc.pid, signal.SIGCONT)
        run.wait_gone(time.monotonic())
    finally:
        if run.proc.poll() is None:
            os.kill(run.proc.pid, signal.SIGCONT)
        run.clean_up()
    out = run.outcome()
    assert (out["status"], out["cause"], out["rank"], out["pid"]) == ("failed", "died", 1, victim), out
    assert out["message"].startswith("hetpipe: rank 1 failed: it died before MPI start-up"), out


@pytest.mark.parametrize("whom, sig", [("rank", signal.SIGINT), ("rank", signal.SIGTERM),
                                       ("mpiexec", signal.SIGINT), ("mpiexec", signal.SIGTERM)])
def test_a_signal_before_mpi_start_up_ends_the_run_in_one_line_naming_whom_it_reached(tmp_path, monkeypatch,
                                                                                      whom, sig):
    """Rank 1 is still in the script's own code before MPI start-up (its peers wait in MPI_Init) when a
    SIGINT or SIGTERM reaches it alone, or reaches mpiexec, which hands it to every rank. Each rank logs
    the signal from its first line (hetpipe.job.bootstrap): one rank's is that rank's, every rank's is a
    signal from outside with no rank blamed; a Ctrl-C is one line, never a traceback of the script."""
    monkeypatch.setenv("HETPIPE_START_TIMEOUT", "120")
    run = Run(tmp_path, "stall_start.py", "sleep", "1")
    try:
        victim = _process_of_rank(run.run_dir, 1)
        _wait_files(run.run_dir, f"spawned-{victim}", "starting-0", "starting-2")
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(list(run.run_dir.glob("spawned-*"))) < 3:     # every rank's signal handlers are in place
            if time.monotonic() > deadline:
                pytest.fail(f"not every rank recorded its start within {START_TIMEOUT_S} s")
            time.sleep(0.05)
        at = time.monotonic()
        os.kill(victim if whom == "rank" else run.pid_of("mpiexec"), sig)
        took = run.wait_gone(at)
        print(f"{signal.Signals(sig).name} to {whom} before MPI start-up: every process gone {took:.2f} s after it")
    finally:
        run.clean_up()
    out, err = run.outcome(), run.err.read_text()
    assert "Traceback" not in err, err
    assert out["exit_status"] == run.proc.returncode != 0, out
    if out["status"] == "interrupted":
        assert out["exit_status"] == 128 + sig, out
    if whom == "mpiexec":
        assert (out["status"], out["cause"], out["rank"]) == ("interrupted", "signal", None), out
        assert "from outside the launcher" in out["message"] and signal.Signals(sig).name in out["message"], out
    elif sig == signal.SIGINT:
        assert (out["status"], out["cause"], out["rank"]) == ("interrupted", "signal", 1), out
        assert "hetpipe: rank 1 was interrupted (SIGINT) in start-up: before MPI start-up" in err, err
    else:
        assert (out["status"], out["cause"], out["rank"]) == ("failed", "terminated", 1), out
        assert "hetpipe: rank 1: SIGTERM in start-up: before MPI start-up; it ends" in err, err


def test_a_rank_stuck_in_its_data_at_start_up_is_named_within_the_timeout(tmp_path):
    """Rank 1 blocks (no CPU time) reading its data while the Trainer starts up; ranks 0 and 2 wait for
    it in a start-up collective. The launcher names it, with its phase, once it has been idle for the
    peer timeout (4 s here), not the start-up timeout of a minute or more."""
    run = Run(tmp_path, "stuck_startup.py", "1")
    try:
        run.proc.wait(timeout=START_TIMEOUT_S)
    finally:
        run.clean_up()
    out = run.outcome()
    assert (out["status"], out["cause"], out["rank"]) == ("failed", "stuck", 1), out
    assert out["role"].startswith("rank 1 (vw 0 stage 1)"), out
    assert "made no progress for" in out["message"] and "in start-up: " in out["message"], out
    idle = float(re.search(r"no progress for ([0-9.]+) s", out["message"]).group(1))
    assert PEER_TIMEOUT_S <= idle < 60.0, out
    assert "Traceback" not in run.err.read_text()


def test_a_run_that_completed_is_reported_completed_when_mpiexec_stops_after(tmp_path):
    """Every rank ends normally while mpiexec is stopped (it cannot reap them): the launcher names the
    stopped mpiexec, ends it, and reports the run as completed."""
    run = Run(tmp_path, "finish_then_exit.py", "0.5")     # the ranks end before the stop is declared (T/2)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(list(run.run_dir.glob("rank-*.txt"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(run.pid_of("mpiexec"), signal.SIGSTOP)
        run.proc.wait(timeout=GONE_GUARD_S)
        assert not _run_processes(run.run_dir)
    finally:
        run.clean_up()
    out = run.outcome()
    assert (out["status"], out["exit_status"], run.proc.returncode) == ("ok", 0, 0), out
    assert out["message"].startswith("hetpipe: the run completed; then mpiexec (pid"), out
