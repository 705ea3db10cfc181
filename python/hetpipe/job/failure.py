"""Failure handling: one failing rank brings every rank down, with a message naming it, never a hang.

Contract: a rank that raises prints ``hetpipe: rank R (vw V stage S) failed: <error>`` to stderr and
calls ``MPI.COMM_WORLD.Abort(1)``; mpiexec then tears the whole job down (as it does when a rank is
killed). An error every rank reaches together (``verdict``) is printed once, by rank 0. Ranks blocked
on a peer that vanished without Abort time out (``HETPIPE_TIMEOUT`` seconds or the trainer's
``timeout``) with a message naming the peer, and take the same path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from typing import Callable, Iterator, List, Optional, Sequence

from hetpipe.job.rundir import (
    launcher_ending, launcher_interrupting, mark_aborted, mark_blames, mark_interrupted, mark_terminated,
)
from hetpipe.util.numbers import seconds

DEFAULT_TIMEOUT_S = 120.0
# mpiexec forwards each rank's stderr asynchronously, and Abort tears its proxies down at once, which
# can drop a message still in flight; the failing rank waits this long after reporting before Abort.
ABORT_GRACE_S = 0.5
SIGNAL_GRACE_ENV = "HETPIPE_TERM_GRACE"
SIGNAL_GRACE_S = 60.0   # default time ranks get to write a SIGTERM checkpoint when the launcher is interrupted
_reported = ""      # the last one-line failure message of this process, kept in its aborted mark
# The world rank of each rank of the communicator the run's messages travel on (a world renumbered in plan
# order), to name the sender an exception blames (its ``sender``) by world rank; empty: the same numbers.
_world_ranks: List[int] = []
INTERRUPTED_EXIT = 128 + signal.SIGINT      # a Ctrl-C'd process's exit status, as a shell reports it
# mpiexec hands a terminal's SIGINT to every rank: rank 0 says it for the job and exits, whereupon mpiexec
# ends the others. A rank still running this long after its own KeyboardInterrupt got the signal alone.
INTERRUPT_WAIT_S = 2.0


def timeout_s(explicit: Optional[float] = None) -> float:
    """The run's peer timeout: ``explicit``, else ``HETPIPE_TIMEOUT``, else 120 s."""
    if explicit is not None:
        return seconds("timeout", explicit)
    env = os.environ.get("HETPIPE_TIMEOUT")
    return seconds("HETPIPE_TIMEOUT", env) if env else DEFAULT_TIMEOUT_S


def signal_grace_s() -> float:
    """Seconds the ranks get after SIGTERM to write their checkpoint when the launcher itself was
    interrupted: ``HETPIPE_TERM_GRACE`` (``hetpipe launch --term-grace``), else ``SIGNAL_GRACE_S``.
    The launcher SIGKILLs what is left after it; a rank waits at most this long for its peers' parts."""
    text = os.environ.get(SIGNAL_GRACE_ENV)
    if text is None:
        return SIGNAL_GRACE_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"hetpipe launch: {SIGNAL_GRACE_ENV} must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"hetpipe launch: {SIGNAL_GRACE_ENV} (--term-grace) must be > 0 seconds, got {text!r}")
    return value


def transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI's own error from a transfer (mpi4py's ``MPI.Exception``, or an error whose
    class sets ``mpi_transfer``: an MPI call of the core's threads): what a rank sees when its peer died
    or the network failed, not a fault of its own code."""
    if getattr(exc, "mpi_transfer", False) is True:
        return True
    return type(exc).__module__.startswith("mpi4py") and type(exc).__name__ == "Exception"


def set_world_ranks(order: Sequence[int]) -> None:
    """The world rank of each rank of the run's communicator (``order[r]``), once the world was
    renumbered in plan order; see :func:`report`."""
    _world_ranks[:] = list(order)


def report(describe: str, exc: BaseException, with_traceback: bool = True) -> None:
    """Print the one-line failure message (and the traceback below it) to stderr. An MPI transfer
    error, or an error whose class says its message is all there is to it (``one_line``: a wait on a
    peer that timed out, a checkpoint that could not be written or read), gets one line and no
    traceback: the launcher names the peer that died first. An exception
    whose ``sender`` names the rank whose message broke the protocol (by its transport source) marks
    that rank as the culprit, for the launcher."""
    global _reported
    if getattr(exc, "one_line", False):
        with_traceback = False      # its message says it all (a peer that timed out, a disk that is full)
    sender = getattr(exc, "sender", None)
    if isinstance(sender, int) and sender >= 0:
        mark_blames(_world_ranks[sender] if sender < len(_world_ranks) else sender)
        with_traceback = False      # the sender's fault: where this rank's code noticed it helps no one
    if transport_failure(exc):
        with_traceback = False
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__) if with_traceback else []
    what = "an MPI transfer failed (its peer is gone, or the network): " if transport_failure(exc) else ""
    _reported = f"hetpipe: {describe} failed: {what}{type(exc).__name__}: {exc}"
    sys.stderr.write(f"{_reported}\n{''.join(lines)}")
    sys.stderr.flush()


def abort(comm, code: int = 1) -> None:
    """Tear the job down; falls back to a hard exit if there is no communicator."""
    mark_aborted(_reported)
    if comm is not None:
        time.sleep(ABORT_GRACE_S)
        comm.Abort(code)
    os._exit(code)


def verdict(comm, describe: str, exc: BaseException, code: int = 1) -> None:
    """End the job on an error every rank reached together (a planning error, a bad rank count): rank 0
    of ``comm`` reports it, once for the job, and aborts; the other ranks stay quiet and are torn down
    by that Abort (or exit with the same code should it not come)."""
    if comm is None or comm.Get_rank() == 0:
        report(describe, exc, with_traceback=False)
        abort(comm, code)
    mark_aborted()
    time.sleep(ABORT_GRACE_S + 10.0)
    os._exit(code)


def interrupted(comm, line: str, describe: str) -> None:
    """End the job after a Ctrl-C (SIGINT, raised as KeyboardInterrupt) reached this rank: one line for
    the job, no traceback, exit status :data:`INTERRUPTED_EXIT`. Never returns.

    Rank 0 of ``comm`` (a lone process too) writes ``line`` and exits; mpiexec then ends the other ranks.
    Another rank stays quiet for :data:`INTERRUPT_WAIT_S`, and says that it (``describe``) was interrupted
    only if it is still running then: the signal reached it alone. A second Ctrl-C meanwhile is ignored,
    and so is SIGTERM's checkpoint handler: mpiexec's teardown is not a request to checkpoint."""
    global _reported
    mark_interrupted()
    for sig, how in ((signal.SIGINT, signal.SIG_IGN), (signal.SIGTERM, signal.SIG_DFL)):
        with contextlib.suppress(ValueError):       # not the main thread: nothing to change
            signal.signal(sig, how)
    if comm is not None and comm.Get_rank() != 0:
        mark_aborted()
        time.sleep(INTERRUPT_WAIT_S)
        line = f"hetpipe: {describe} was interrupted (SIGINT), alone; the job ends"
    _reported = line
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()
    # MPI_Abort makes 130 mpiexec's own exit status (ranks mpiexec kills would otherwise set it); a lone
    # process has no peer to end.
    abort(comm if comm is not None and comm.Get_size() > 1 else None, INTERRUPTED_EXIT)


def install_excepthook(comm, describe: Callable[[], str]) -> None:
    """Make any uncaught exception on this rank report and abort the job (``describe()`` names the rank);
    a Ctrl-C ends it in one line (:func:`interrupted`)."""

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            interrupted(comm, "hetpipe: interrupted (SIGINT)", describe())
        report(describe(), exc)
        abort(comm)

    sys.excepthook = hook


def install_sigterm(describe: Callable[[], str], phase: Callable[[], str]) -> None:
    """Outside training (where the checkpointer's handler replaces it), a SIGTERM from outside the run
    ends this rank saying so: one line naming it (``describe()``) and its phase (``phase()``), the
    ``terminated`` mark the launcher reads (a preemption, not a fault; every rank so marked at once is a
    signal to mpiexec or to the job), exit status 128 + 15; quiet when the launcher is ending the run
    itself (interrupted, or after a fault it named). Main thread only; elsewhere it does nothing."""

    def handler(sig, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not (launcher_interrupting() or launcher_ending()):
            sys.stderr.write(f"hetpipe: {describe()}: SIGTERM in {phase()}; it ends\n")
            sys.stderr.flush()
            mark_terminated(f"in {phase()}")
        os._exit(128 + sig)

    with contextlib.suppress(ValueError):       # not the main thread: nothing to change
        signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def aborting(comm, describe: Optional[str] = None) -> Iterator[None]:
    """Run the block; should it raise, report it naming this rank (``describe``, default ``rank R``) and
    tear the job down (:func:`abort`), so that no peer waits on this rank until its timeout."""
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - any failure must bring the job down, naming this rank
        report(describe or f"rank {comm.Get_rank()}", e)
        abort(comm)
