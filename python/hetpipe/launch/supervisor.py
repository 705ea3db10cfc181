"""Launcher side: run mpiexec, watch the ranks, end every process of the run on any fault, and record why.

Contract (docs: README, "When a run fails"). The launcher starts mpiexec in a session of its own, so
that a terminal's Ctrl-C reaches the launcher alone, and ends the run itself:

* a rank reported its own failure, or died (killed, crashed): mpiexec normally ends the job; if it
  has not within ``END_GRACE_S``, the launcher does;
* a rank is stopped (state ``T``: SIGSTOP, SIGTSTP) for ``STOP_FRACTION`` of the peer timeout: its
  peers would only time out later, naming whom they waited for, so the launcher names it and ends the run;
  the rank processes are found from the moment mpiexec starts them (their environment carries the
  run's marker and the MPI launcher's rank number), not only once they registered;
* mpiexec or one of its proxies is stopped as long: it is named (a run whose every rank had already
  completed is reported as completed) and the run ends;
* slow is not stuck: outside training (before MPI start-up, in start-up's phases, in shutdown; each
  rank records its phase, :func:`hetpipe.job.rundir.mark_phase`) a rank process of this host is
  stuck once it has made no progress for the start-up timeout (the peer timeout, at least
  ``START_MIN_S``; ``HETPIPE_START_TIMEOUT`` or ``--start-timeout``): no CPU time used and no
  heartbeat (``hetpipe.heartbeat()``, for a load that waits without computing). A rank that computes
  (imports, a dataset load of minutes, planning) is never ended for being slow. Ranks that have not
  registered (reached MPI start-up, ``job.world``) are named once every such process of this host is
  idle that long, the ones that never reached MPI start-up first (the others wait for them in
  MPI_Init); a rank never seen on this host (another host's) within that time from the launch is
  named too. A registered rank idle for the peer timeout (``--timeout``) in a start-up or shutdown
  phase is named with its phase: its peers wait for it in a collective, as they would in training;
* the launcher gets SIGINT, SIGTERM or SIGHUP: it ends the run and exits with 128 + the signal; the
  ranks then get up to :func:`signal_grace_s` (``hetpipe launch --term-grace``) to write their
  SIGTERM checkpoint and exit, since a real model's state takes longer to write than a fault's teardown;
  the launcher marks the run directory first (``interrupting``), so that the ranks stay quiet and the
  run is one line: the signal, the wave reached and the last complete checkpoint;
* mpiexec exits (killed, or after a failure): the launcher ends whatever is left.

Ending the run: every process whose environment carries this run's ``HETPIPE_RUN_DIR`` (mpiexec, its
proxies, the ranks, anything they started; :mod:`hetpipe.job.procs`) gets SIGTERM (SIGKILL if
stopped), and SIGKILL after ``TERM_GRACE_S`` (after a fault) or :func:`signal_grace_s` (after a signal);
the wait ends as soon as no process is left. The verdict is written to ``<run dir>/outcome.json``
(:class:`Outcome`) for programs (a restarting launcher) and printed as one line for people.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from hetpipe.job.failure import ABORT_GRACE_S, signal_grace_s
from hetpipe.job.guard import LAUNCHER_HOST_ENV, LAUNCHER_PID_ENV
from hetpipe.job.procs import (command_name, cpu_ticks, environment_marker, processes_with, rank_processes, running,
                                send, signal_name, stopped)
from hetpipe.job.rundir import (RUN_DIR_ENV, blamed_ranks, mark_ending, mark_interrupting, marked, phases,
                                rank_hosts, ranks_by_pid, reached_clock, recorded_ranks, signals_got, spawned_ranks,
                                starting_ranks)
from hetpipe.util.numbers import seconds
from hetpipe.launch.deaths import DeathWatcher

OUTCOME_FILE = "outcome.json"
LAUNCHER_PID_FILE = "launcher.pid"
MPIEXEC_PID_FILE = "mpiexec.pid"
STOP_FRACTION = 0.5     # a rank stopped this long (x the peer timeout) is declared unresponsive
STOP_MIN_S = 1.0
END_GRACE_S = 3.0       # after a rank died or reported, the time mpiexec gets to end the job itself
TERM_GRACE_S = 2.0      # after a fault: SIGTERM, then SIGKILL after this long
GONE_WAIT_S = 5.0       # after SIGKILL, how long to wait for the processes to disappear
TICK_S = 0.1
START_MIN_S = 60.0      # the least time the ranks get to register (see the module docstring)
START_TIMEOUT_ENV = "HETPIPE_START_TIMEOUT"
HYDRA_CTRL_C = b"Sending Ctrl-C to processes as requested"     # MPICH's mpiexec, on SIGINT
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Outcome:
    """How a launched run ended; ``outcome.json`` holds it as JSON.

    status: ``ok``, ``failed`` or ``interrupted``. cause (when not ok): ``reported`` (a rank raised
    and said why), ``died`` (a rank vanished without reporting, before MPI start-up too), ``terminated``
    (the first rank to end did so on a SIGTERM from outside the run, after its handler wrote its
    checkpoint), ``stopped`` (a rank, or mpiexec or its proxy, stopped responding), ``stuck`` (a rank
    made no progress outside training), ``unregistered`` (ranks did not reach MPI start-up), ``mpiexec``
    (mpiexec itself was killed), ``signal`` (the launcher was interrupted, or every rank got SIGINT or
    SIGTERM from outside it: a signal to mpiexec or to the whole job) or ``exit`` (mpiexec failed and no
    rank is to blame). rank, role, pid: the culprit, if any (role names mpiexec or its proxy when one
    of them is). reason: why the launcher blamed it (what it saw), in words. A run whose every rank
    completed is ``ok`` even if something failed after, which ``message`` then says.
    """

    status: str
    exit_status: int
    cause: str = ""
    rank: Optional[int] = None
    role: Optional[str] = None
    pid: Optional[int] = None
    message: str = ""
    reports: List[str] = field(default_factory=list)      # the failure messages ranks reported themselves
    ended_pids: List[int] = field(default_factory=list)   # processes the launcher had to signal
    run_dir: str = ""
    reason: str = ""

    def write(self, run_dir: str) -> None:
        tmp = Path(run_dir, f".{OUTCOME_FILE}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, Path(run_dir, OUTCOME_FILE))

    @classmethod
    def read(cls, run_dir: str) -> "Outcome":
        return cls(**json.loads(Path(run_dir, OUTCOME_FILE).read_text()))


class Progress:
    """When each watched process last made progress: its CPU time advanced, or its phase file changed
    (a new phase, or a heartbeat). Thread role: the launcher's main thread."""

    def __init__(self) -> None:
        self._last: Dict[int, Tuple[Optional[int], float, float]] = {}     # pid -> (ticks, phase mtime, when)

    def idle(self, pids, run_dir: str, now: float) -> Dict[int, float]:
        """pid -> seconds since it last made progress, for each of ``pids`` still running (a process
        seen for the first time has just made progress)."""
        out = {}
        for pid in pids:
            ticks = cpu_ticks(pid)
            if ticks is None:
                continue
            try:
                mtime = Path(run_dir, f"phase-{pid}").stat().st_mtime
            except OSError:
                mtime = 0.0
            seen = self._last.get(pid)
            if seen is None or seen[0] != ticks or seen[1] != mtime:
                self._last[pid] = (ticks, mtime, now)
                out[pid] = 0.0
            else:
                out[pid] = now - seen[2]
        return out


class Supervisor:
    """Runs one mpiexec job of ``ranks`` ranks with ``run_dir`` as its run directory (see the module doc).

    Thread role: :meth:`run` is called from the main thread (it installs signal handlers there, and
    restores them); two daemon threads relay mpiexec's output, the death watcher has its own."""

    def __init__(self, command: List[str], ranks: int, run_dir: str, peer_timeout_s: float) -> None:
        self.command, self.ranks, self.run_dir = command, ranks, run_dir
        self.stop_after_s = max(STOP_MIN_S, STOP_FRACTION * peer_timeout_s)
        self.peer_timeout_s = peer_timeout_s
        start = os.environ.get(START_TIMEOUT_ENV)
        self.start_timeout_s = seconds(START_TIMEOUT_ENV, start) if start else max(START_MIN_S, peer_timeout_s)
        self.marker = environment_marker(RUN_DIR_ENV, run_dir)
        self._signal: Optional[int] = None
        self.signal_grace_s = signal_grace_s()
        self.seen: Dict[int, int] = {}          # pid -> MPI rank of every rank process seen, registered or not
        self.mpiexec_pid: Optional[int] = None
        self.names: Dict[int, str] = {}         # pid -> what a process of the run that is no rank is
        self._in_init_since: Optional[float] = None     # since when every unregistered rank is in MPI_Init
        self.mpiexec_interrupted = False        # mpiexec said it got SIGINT (set by the stderr relay thread)
        self.signals: Dict[int, set] = {}       # pid -> signals each rank logged before the teardown
        # The host this launcher counts as: only the ranks recorded on it are watched by pid.
        self.host = os.environ.get(LAUNCHER_HOST_ENV) or socket.gethostname()

    def run(self) -> Outcome:
        previous = self._install_handlers()
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _install_handlers(self) -> Dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def note(sig, _frame) -> None:
            if self._signal is None:
                self._signal = sig

        return {sig: signal.signal(sig, note) for sig in _HANDLED}

    def _run(self) -> Outcome:
        Path(self.run_dir, LAUNCHER_PID_FILE).write_text(f"{os.getpid()}\n")
        env = {**os.environ, RUN_DIR_ENV: self.run_dir, LAUNCHER_PID_ENV: str(os.getpid()),
               LAUNCHER_HOST_ENV: self.host}
        watcher = DeathWatcher(self.run_dir, self.ranks, self.host).start()
        proc = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=_die_with_parent)
        Path(self.run_dir, MPIEXEC_PID_FILE).write_text(f"{proc.pid}\n")
        self.mpiexec_pid = proc.pid
        relays = [_relay(proc.stdout, sys.stdout.buffer), _relay(proc.stderr, sys.stderr.buffer, self._heard)]
        verdict = self._watch(proc, watcher)
        rc = proc.poll()
        # What happened before the launcher stepped in decides the culprit; the teardown's deaths do not.
        vanished = [(pid, watcher.vanished_at[pid]) for pid in list(watcher.vanished)]
        # Rank processes gone before the watcher took them up (a death within a tick of their start, or
        # before the launcher's scan ever saw them: their own start record names them).
        self._see({}, None)
        vanished += [(pid, time.time()) for pid in self.seen if pid not in watcher.vanished_at and not running(pid)]
        aborted = _reports(self.run_dir)
        stuck = [pid for pid in set(ranks_by_pid(self.run_dir, self.host)) | set(self.seen) if stopped(pid)]
        self.signals = signals_got(self.run_dir)        # before the teardown's own SIGTERMs
        interrupted = verdict is not None and verdict[0] == "signal"
        if interrupted:
            mark_interrupting(self.run_dir, signal_name(verdict[1]))     # the ranks leave the saying to this launcher
        else:
            mark_ending(self.run_dir)       # the teardown's SIGTERM is no news: ranks with nothing to write stay quiet
        ended = self._end_all(self.signal_grace_s if interrupted else TERM_GRACE_S)
        final_rc = proc.wait()
        watcher.stop()
        for t in relays:
            t.join(timeout=5)
        outcome = self._verdict(verdict, rc if rc is not None else final_rc, vanished, aborted, stuck)
        outcome.ended_pids = ended
        outcome.run_dir = self.run_dir
        outcome.write(self.run_dir)
        return outcome

    def _see(self, ranks_now: Dict[int, int], watcher: Optional[DeathWatcher]) -> None:
        """Add to :attr:`seen` the rank processes found running (``ranks_now``) and those that recorded
        their start on this host (``spawned-PID``: alive or not), and have ``watcher`` (None once it no
        longer orders deaths) watch the new."""
        found = {**spawned_ranks(self.run_dir, self.host), **ranks_now}
        for pid in set(found) - set(self.seen):
            if watcher is not None:
                watcher.watch(pid)      # its death is then ordered with the registered ranks'
        self.seen.update(found)

    def _heard(self, chunk: bytes) -> None:
        """mpiexec's own stderr, as relayed (the relay thread): MPICH's mpiexec says when it got a Ctrl-C
        (SIGINT) and hands it to the ranks, which nothing else the launcher sees tells apart from a
        rank's own SIGINT or death."""
        if HYDRA_CTRL_C in chunk:
            self.mpiexec_interrupted = True

    def _watch(self, proc: subprocess.Popen, watcher: DeathWatcher) -> Optional[Tuple[str, int, float]]:
        """Wait for mpiexec to exit, or for a reason to end the run: ("signal", sig, 0), ("stopped", pid,
        seconds) (a rank, mpiexec or a proxy), ("stuck", pid, seconds) (a registered rank idle outside
        training), ("unregistered", 0, seconds), ("overdue", 0, 0) (mpiexec did not end the job after a
        failure). None: mpiexec exited."""
        since: Dict[int, float] = {}
        failed_at: Optional[float] = None
        started = time.monotonic()
        progress = Progress()
        me = [os.getpid()]
        while proc.poll() is None:
            if self._signal is not None:
                return "signal", self._signal, 0.0
            now = time.monotonic()
            recorded = recorded_ranks(self.run_dir)
            family = processes_with(self.marker, me)         # mpiexec, its proxies and the ranks: one scan
            ranks_now = rank_processes(self.marker, me, among=family)
            self._see(ranks_now, watcher)
            registered = {rank for rank, _ in recorded.values()}
            # Stopped: a rank, or mpiexec and its proxies (every process of the run that is not a rank).
            for pid in set(family) | {proc.pid} | set(ranks_by_pid(self.run_dir, self.host)) | set(self.seen):
                if stopped(pid):
                    since.setdefault(pid, now)
                else:
                    since.pop(pid, None)
            late = [pid for pid, t in since.items() if now - t >= self.stop_after_s]
            if late:
                pid = min(late, key=since.__getitem__)
                if pid not in self.seen and pid not in recorded:
                    self.names[pid] = "mpiexec" if pid == proc.pid else \
                        f"mpiexec's {command_name(pid) or 'helper process'}"
                return "stopped", pid, now - since[pid]
            found = self._stuck(progress, ranks_now, recorded, registered, now, started)
            if found is not None:
                return found
            if failed_at is None and (watcher.first_unmarked() is not None or marked(self.run_dir, "aborted")):
                failed_at = now
            if failed_at is not None and now - failed_at > END_GRACE_S:
                return "overdue", 0, 0.0
            time.sleep(TICK_S)
        return None

    def _stuck(self, progress: Progress, ranks_now: Dict[int, int], recorded, registered, now: float,
               started: float) -> Optional[Tuple[str, int, float]]:
        """A rank stuck outside training (see the module docstring), or None."""
        phase_of = phases(self.run_dir)
        watched = [pid for pid in ranks_now if phase_of.get(pid) not in ("training", "done")]
        idle = progress.idle(watched, self.run_dir, now)
        limit = self.start_timeout_s
        if len(registered) < self.ranks:
            # Ranks in MPI_Init (their starting mark) wait there for the others, however they spend CPU:
            # the progress that counts is that of the ranks still on their way to it.
            starting = starting_ranks(self.run_dir)
            on_way = [pid for pid, rank in ranks_now.items() if rank not in registered and rank not in starting]
            unseen = set(range(self.ranks)) - registered - set(ranks_now.values())
            if on_way and not unseen and all(idle.get(pid, 0.0) >= limit for pid in on_way):
                return "unregistered", 0, min(idle[pid] for pid in on_way)
            if not on_way and not unseen:
                # Every rank reached MPI_Init, which should end at once: it has not for ``limit``.
                self._in_init_since = self._in_init_since or now
                if now - self._in_init_since >= limit:
                    return "unregistered", 0, now - self._in_init_since
            else:
                self._in_init_since = None
            if unseen and now - started > limit and all(idle.get(pid, 0.0) >= limit for pid in on_way):
                return "unregistered", 0, now - started
        # A registered rank is in the run's collectives: its peers wait for it there, so the run's own
        # timeout bounds its idleness, as it bounds a wait in training.
        for pid in recorded:
            if pid in idle and idle[pid] >= self.peer_timeout_s and \
                    phase_of.get(pid, "").startswith(("start-up", "shutdown")):
                return "stuck", pid, idle[pid]
        return None

    def _end_all(self, grace_s: float) -> List[int]:
        """SIGTERM (SIGKILL if stopped) every process of the run, SIGKILL the survivors after
        ``grace_s``, and wait until none runs. Returns the pids signalled."""
        me = {os.getpid()}
        left = processes_with(self.marker, me)
        ended = sorted(left)
        for pid in left:
            send(pid, signal.SIGKILL if stopped(pid) else signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = processes_with(self.marker, me)
        for pid in left:
            send(pid, signal.SIGKILL)
        deadline = time.monotonic() + GONE_WAIT_S
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = processes_with(self.marker, me)
            for pid in set(left) - set(ended):      # started meanwhile (a rank forking)
                send(pid, signal.SIGKILL)
                ended.append(pid)
        if left:
            sys.stderr.write(f"hetpipe: process(es) {left} of the run survived SIGKILL (uninterruptible sleep?)\n")
        return ended

    def _verdict(self, verdict, rc: int, vanished: List[Tuple[int, float]], reports: List[Tuple[int, str, float]],
                 stuck: List[int]) -> Outcome:
        recorded = recorded_ranks(self.run_dir)
        who = {**{pid: (rank, f"rank {rank}") for pid, rank in self.seen.items()}, **recorded}
        who.update({pid: (None, f"{name} (pid {pid})") for pid, name in self.names.items()})
        messages = [text for _, text, _ in reports if text]
        done = marked(self.run_dir, "exited")
        terminated = marked(self.run_dir, "terminated")
        interrupted = marked(self.run_dir, "interrupted")
        first = next(((pid, at) for pid, at in vanished if pid not in done), None)
        unmarked = [(pid, at) for pid, at in vanished if pid not in done | terminated | interrupted]
        died = unmarked[0] if unmarked else None
        if died is not None and died[0] not in recorded:
            # Before MPI start-up MPI ends the others within milliseconds of a death, often before the
            # watcher wakes (or before the launcher saw the process at all): a rank that died before it
            # reached MPI_Init (no starting mark) is the cause; those in MPI_Init were waiting for it.
            starting = starting_ranks(self.run_dir)
            died = next(((pid, at) for pid, at in unmarked
                         if pid not in recorded and self.seen.get(pid) not in starting), died)

        def blame(cause: str, pid: int, say: Callable[[str], str], reason: str) -> Outcome:
            """The outcome naming ``pid`` (a rank, or mpiexec or its proxy); ``say(role)`` is the message."""
            rank, role = who.get(pid, (None, f"the process with pid {pid}"))
            return Outcome("failed", rc if rc > 0 else 1, cause, rank, role, pid, say(role), messages, reason=reason)

        if verdict is not None and verdict[0] == "signal":
            name = signal_name(verdict[1])
            return Outcome("interrupted", 128 + verdict[1], "signal",
                           message=f"hetpipe: interrupted by {name}{self._progress()}", reports=messages,
                           reason=f"the launcher got {name}")
        # Every rank recorded a normal exit after its work: the run completed, whatever came after.
        completed = len(recorded) >= self.ranks and set(recorded) <= done and not marked(self.run_dir, "aborted")
        if completed and (verdict is not None and verdict[0] == "stopped" or rc <= 0):
            after = ""
            if verdict is not None and verdict[0] == "stopped":
                after = f"; then {who.get(verdict[1], (None, f'pid {verdict[1]}'))[1]} stopped responding " \
                        "(state T) and the launcher ended it"
            elif rc < 0:
                after = f"; then mpiexec was killed by {signal_name(-rc)}"
            return Outcome("ok", 0, message=f"hetpipe: the run completed{after}" if after else "",
                           reason="every rank recorded a normal exit" if after else "")
        if verdict is not None and verdict[0] == "unregistered":
            return self._unregistered(verdict[2], messages)
        if verdict is not None and verdict[0] == "stuck":
            phase = phases(self.run_dir).get(verdict[1], "start-up")
            return blame("stuck", verdict[1],
                         lambda role: f"hetpipe: {role} made no progress for {verdict[2]:.1f} s in {phase} (its "
                                      "process used no CPU time: blocked or asleep, not slow) while its peers waited "
                                      "for it; the launcher ended the job (--timeout sets how long a rank may idle "
                                      "outside training)",
                         f"its CPU time did not advance for {verdict[2]:.1f} s in phase {phase!r}")
        if verdict is not None and verdict[0] == "stopped":
            return blame("stopped", verdict[1], lambda role: f"hetpipe: {role} failed: it stopped responding (its "
                                                             f"process was stopped, state T, for {verdict[2]:.1f} "
                                                             "s); the launcher ended the job",
                         f"its process was in state T for {verdict[2]:.1f} s")
        if rc == 0 and verdict is None:
            return Outcome("ok", 0)
        if stuck:
            return blame("stopped", stuck[0], lambda role: f"hetpipe: {role} failed: it stopped responding (its "
                                                           "process was stopped, state T); the job was ended",
                         "its process was in state T when mpiexec ended")
        if rc < 0 and verdict is None:
            return Outcome("failed", 1, "mpiexec", message=f"hetpipe: mpiexec was killed by {signal_name(-rc)}; "
                                                           "the launcher ended the run's processes",
                           reports=messages, reason=f"mpiexec, the launcher's child, ended on {signal_name(-rc)}")
        # The rank processes a signal could reach: the registered ranks, or before MPI start-up the rank
        # processes seen (each logs its signals from its first line: hetpipe.job.bootstrap).
        population = set(recorded) if recorded else set(self.seen)
        got = {sig: [pid for pid in population if sig in self.signals.get(pid, ())] for sig in (signal.SIGINT,
                                                                                             signal.SIGTERM)}
        every = {sig for sig, pids in got.items() if population and len(pids) == len(population) >= self.ranks}
        if signal.SIGTERM in every and signal.SIGINT not in every:
            # Every rank got SIGTERM, logged by its interpreter at once (before a Python handler could run,
            # a rank blocked in MPI included): sent to mpiexec (which forwards it) or to the whole job.
            return Outcome("interrupted", 128 + signal.SIGTERM, "signal",
                           message="hetpipe: every rank was ended by SIGTERM from outside the launcher (sent to "
                                   f"mpiexec or to the whole job){self._progress()}", reports=messages,
                           reason=f"all {len(population)} ranks logged a SIGTERM; the launcher got none")
        if signal.SIGINT in every and not self.mpiexec_interrupted:
            self.mpiexec_interrupted = True     # every rank got the Ctrl-C: sent to mpiexec or to the job
        hit = sorted(who[pid][0] for pid in interrupted & population if who.get(pid, (None,))[0] is not None)
        if self.mpiexec_interrupted:
            return Outcome("interrupted", 128 + signal.SIGINT, "signal",
                           message="hetpipe: interrupted by SIGINT from outside the launcher, sent to mpiexec or "
                                   f"to the whole job (it reached every rank){self._progress()}", reports=messages,
                           reason="mpiexec said it got a Ctrl-C and sent it to the ranks")
        if hit:
            # A Ctrl-C that reached ranks and not the launcher: sent to mpiexec (which forwards it to every
            # rank) or to the ranks' processes. The first rank to see it ends the job (MPI_Abort), so the
            # others may die before they record it: that is no fault of theirs.
            every = len(hit) >= self.ranks
            return Outcome("interrupted", 128 + signal.SIGINT, "signal",
                           rank=None if every or len(hit) > 1 else hit[0],
                           message=f"hetpipe: interrupted by SIGINT from outside the launcher (it reached "
                                   f"{'every rank' if every else f'rank(s) {hit}'}: sent to mpiexec or to the "
                                   f"ranks){self._progress()}", reports=messages,
                           reason=f"rank(s) {hit} recorded a SIGINT; the launcher got none")
        ended = [pid for pid in population if pid in terminated]
        if population and len(ended) == len(population) >= self.ranks:
            # Every rank got SIGTERM at once: sent to mpiexec (which forwards it) or to the whole job, not
            # to one rank, and not to the launcher.
            return Outcome("interrupted", 128 + signal.SIGTERM, "signal",
                           message="hetpipe: every rank was ended by SIGTERM from outside the launcher (sent to "
                                   f"mpiexec or to the whole job){self._progress()}", reports=messages,
                           reason=f"all {len(ended)} ranks recorded an end on SIGTERM; the launcher got none")
        # A rank that died before any report is the cause: its peers may then fail on their transfers
        # with it (MPI errors) and report that. A report before any death is the cause: its rank calls
        # Abort, which kills the rest, ABORT_GRACE_S after writing its mark; deaths seen up to half
        # that after the mark cannot be Abort's, and allow for the watcher thread waking late.
        # Ranks on other hosts cannot be watched by pid: when some ended silently there, the verdict says
        # so beside the first death seen here (MPI ends every rank when one dies, so either may be first).
        elsewhere = self._silent_elsewhere()
        if first is not None and first[0] in terminated and (not reports or
                                                             first[1] < reports[0][2] + ABORT_GRACE_S / 2):
            # The first rank to go was stopped by a SIGTERM from outside the run (the launcher's own come
            # after the verdict) and wrote its checkpoint: the job ended because of it, not of a fault.
            said = Path(self.run_dir, f"terminated-{first[0]}").read_text().strip()
            return blame("terminated", first[0], lambda role: f"hetpipe: {role} was ended by a SIGTERM from outside "
                                                              f"the run ({said}){elsewhere}; the job was ended",
                         "it was the first rank to end, on a SIGTERM its handler recorded")
        if died is not None and (not reports or died[1] < reports[0][2] + ABORT_GRACE_S / 2):
            if died[0] not in recorded:
                return blame("died", died[0], lambda role: f"hetpipe: {role} failed: it died before MPI start-up "
                                                           f"(killed, or crashed){elsewhere}; the job was ended",
                             "it was the first rank process to vanish, before it registered in the run directory")
            return blame("died", died[0], lambda role: f"hetpipe: {role} failed: it died without reporting an "
                                                       f"error (killed, or crashed in native code){elsewhere}; "
                                                       "the job was ended",
                         "it was the first rank to vanish without a mark of a normal exit or a report")
        if reports:
            pid, text, _ = reports[0]
            sender = blamed_ranks(self.run_dir).get(pid)
            if sender is not None:
                # The reporting rank names the rank whose message broke the protocol, by its transport source.
                reporter = who.get(pid, (None, f"the process with pid {pid}"))[1]
                culprit = next((p for p, (r, _) in who.items() if r == sender), None)
                return Outcome("failed", rc if rc > 0 else 1, "reported", sender,
                               who[culprit][1] if culprit is not None else f"rank {sender}", culprit,
                               text or f"hetpipe: {reporter} failed on a message from rank {sender}", messages,
                               reason=f"{reporter} was the first to report a failure, caused by a message from "
                                      f"rank {sender} (its transport source)")
            return blame("reported", pid, lambda role: text or f"hetpipe: {role} failed (it reported an error)",
                         "it was the first rank to report its own failure")
        if completed:
            return Outcome("failed", rc, "exit", message=f"hetpipe: every rank ended normally, but mpiexec exited "
                                                         f"with status {rc} (a rank's own exit status)",
                           reports=messages, reason="every rank recorded a normal exit; mpiexec's status is not 0")
        return Outcome("failed", rc if rc > 0 else 1, "exit", message=f"hetpipe: mpiexec exited with status {rc}"
                       + elsewhere, reports=messages, reason="no rank died, stopped or reported first")

    def _unregistered(self, waited: float, messages: List[str]) -> Outcome:
        """The verdict when ranks did not reach MPI start-up: those that never began it are the cause
        (the others wait for them in MPI_Init); every such process was idle ``waited`` s (or, for ranks
        never seen on this host, the launch is that old)."""
        registered = {rank for rank, _ in recorded_ranks(self.run_dir).values()}
        missing = [r for r in range(self.ranks) if r not in registered]
        culprits = [r for r in missing if r not in starting_ranks(self.run_dir)] or missing
        pids = {rank: pid for pid, rank in self.seen.items()}
        where = "; ".join(f"rank {r}: " + (f"process {pids[r]} running, idle" if r in pids else "no process seen")
                          for r in culprits)
        waiting = sorted(set(missing) - set(culprits))
        return Outcome("failed", 1, "unregistered", culprits[0], f"rank {culprits[0]}", pids.get(culprits[0]),
                       f"hetpipe: rank(s) {culprits} did not reach MPI start-up, making no progress for "
                       f"{waited:.1f} s ({where}" + (f"; rank(s) {waiting} waited for them in MPI_Init" if waiting
                                                     else "")
                       + "): stuck, not slow (a rank using CPU time, or calling hetpipe.heartbeat(), is waited "
                       "for); the launcher ended the job (--start-timeout sets how long)", messages,
                       reason=f"no CPU time or heartbeat from rank(s) {culprits} for {waited:.1f} s before MPI "
                              "start-up")

    def _progress(self) -> str:
        """How far an interrupted run got, read once its ranks ended (their SIGTERM checkpoints written):
        `` at wave N`` (the highest wave boundary a rank's checkpointer recorded) and its last complete
        checkpoint; empty where the run recorded neither (no checkpoints, or ended before training)."""
        from hetpipe.checkpoint.format import latest

        clock = reached_clock(self.run_dir)
        text = f" at wave {clock}" if clock >= 0 else ""
        listed = Path(self.run_dir, "checkpoints.txt")
        if listed.exists():
            directory = Path(listed.read_text().strip())
            found = latest(directory)
            text += f"; last complete checkpoint: {found}" if found is not None else \
                f"; no complete checkpoint in {directory}"
        return text

    def _silent_elsewhere(self) -> str:
        """The ranks on other hosts that ended with neither an exit nor a failure mark, by host: a host
        lost (or its ranks killed there), which the launcher cannot watch by pid."""
        done = marked(self.run_dir, "exited") | marked(self.run_dir, "aborted") | marked(self.run_dir, "terminated")
        hosts = rank_hosts(self.run_dir)
        lost: Dict[str, List[int]] = {}
        for pid, (rank, _) in recorded_ranks(self.run_dir).items():
            if hosts.get(pid, "") not in ("", self.host) and pid not in done:
                lost.setdefault(hosts[pid], []).append(rank)
        return "".join(f"; rank(s) {sorted(r)} on host {h} ended without a word (host lost, or killed there)"
                       for h, r in sorted(lost.items()))


def _die_with_parent() -> None:
    """In mpiexec's process, before it runs: SIGTERM it if the launcher dies (Linux), so that a
    launcher killed with SIGKILL does not orphan the job (mpiexec then ends its ranks itself, the
    ranks that never registered included; registered ranks also watch the launcher themselves)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _reports(run_dir: str) -> List[Tuple[int, str, float]]:
    """(pid, message, wall-clock time) of the ranks that reported their own failure, earliest first."""
    marks = sorted((f.stat().st_mtime, f) for f in Path(run_dir).glob("aborted-*"))
    return [(int(f.name.split("-", 1)[1]), f.read_text().strip(), at) for at, f in marks]


def _relay(src, dst, tap: Optional[Callable[[bytes], None]] = None) -> threading.Thread:
    """A daemon thread copying ``src`` to ``dst`` as it arrives (mpiexec's output to the launcher's);
    ``tap`` sees each chunk first."""

    def copy() -> None:
        for chunk in iter(lambda: src.read1(65536), b""):
            if tap is not None:
                tap(chunk)
            try:
                dst.write(chunk)
                dst.flush()
            except (BrokenPipeError, ValueError):
                pass    # the launcher's own output is gone; keep draining so that mpiexec never blocks

    t = threading.Thread(target=copy, name="hetpipe-relay", daemon=True)
    t.start()
    return t
