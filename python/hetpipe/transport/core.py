"""mpi-host through the compiled core: a stage rank's messages progressed by the core's own thread.

:class:`CoreTransport` is the :class:`~hetpipe.transport.base.Transport` of a stage rank over
``hetpipe_core._mpi.StageEndpoint`` (csrc/mpi/stage_endpoint.h): the same wire format and slots as
:class:`~hetpipe.transport.mpi.MPITransport`, but the MPI requests belong to a core thread that
progresses them while Python computes (mpi4py's progress only when Python tests them between
instructions), and Python only enqueues sends and takes what arrived. Which one a stage rank runs:
:func:`choose_stage_plane` (``HETPIPE_STAGE_PLANE``: "auto", the default, takes the core where it can
run; "core" requires it; "python" keeps mpi4py). PS shard ranks have their own core service
(:mod:`hetpipe.ps.core_plane`).

Thread role: the stage's executor thread calls every method (the endpoint's contract).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np

import hetpipe_core
from hetpipe.util.planes import PLANES, STAGE_PLANE_ENV
from hetpipe.transport.base import Transport
from hetpipe.transport.protocol import ANY, KIND_NAMES, Header, Message, MPITransferError, TransportError, chunk_bytes
from hetpipe.transport.slots import slot_bytes


def core_mpi_missing(comm) -> Optional[str]:
    """Why the core's MPI services (``hetpipe_core._mpi``) cannot run over ``comm``; None when they can."""
    if not hasattr(comm, "Get_rank"):
        return "the run is not over MPI (single-process replay)"
    if not hetpipe_core.build_info().get("mpi_built", False):
        return "hetpipe_core was built without MPI (HETPIPE_WITH_MPI)"
    from mpi4py import MPI

    if not isinstance(comm, MPI.Comm):
        return f"the communicator is a {type(comm).__name__}, not an mpi4py communicator"
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return f"MPI runs at thread level {MPI.Query_thread()}, not MPI_THREAD_MULTIPLE"
    try:
        from hetpipe_core import _mpi
    except ImportError as e:
        return f"hetpipe_core._mpi does not load ({e})"
    if _mpi.library_version() != MPI.Get_library_version():
        return "hetpipe_core._mpi and mpi4py run on different MPI libraries"
    return None


def choose_stage_plane(comm, ranks_here: int = 1, cores: Optional[int] = None) -> Tuple[str, str]:
    """The data plane of a stage rank's MPI traffic ("core" or "python") with the one-line reason.

    ``ranks_here``: the job's ranks on this host; ``cores``: the cores this process may run on (None:
    its CPU affinity). "auto" takes the core only where every rank can have a core for its main thread
    and one for its progress thread: on fewer, the progress threads take turns with the computing
    threads, and each hand-over waits for a core (measured on 2 cores: ~0.2 ms more per message, and
    hetpipe's tiny-model step 1.6x slower than with mpi4py; bench/host_overhead.py)."""
    wanted = os.environ.get(STAGE_PLANE_ENV, "").strip().lower() or "auto"
    if wanted not in PLANES:
        raise ValueError(f"hetpipe: {STAGE_PLANE_ENV} must be one of {', '.join(PLANES)}, got {wanted!r}")
    if wanted == "python":
        return "python", f"mpi4py requests, progressed between instructions ({STAGE_PLANE_ENV}=python)"
    missing = core_mpi_missing(comm)
    if missing is None and wanted == "auto":
        cores = cores if cores is not None else len(os.sched_getaffinity(0))
        if cores < 2 * ranks_here:
            missing = (f"{cores} cores for {ranks_here} ranks on this host: a progress thread per rank would wait "
                       f"for a core at every message ({STAGE_PLANE_ENV}=core forces it)")
    if missing is None:
        return "core", "the core's progress thread moves the stage's messages while it computes"
    if wanted == "core":
        raise ValueError(f"hetpipe: {STAGE_PLANE_ENV}=core, but {missing}")
    return "python", f"mpi4py requests, progressed between instructions ({missing})"


class CoreTransport(Transport):
    """A stage rank's endpoint over ``comm`` (an mpi4py communicator) with its slots from ``pool``."""

    def __init__(self, comm, pool) -> None:
        from mpi4py import MPI

        from hetpipe_core import _mpi

        self.rank = comm.Get_rank()
        self.pool = pool
        self.slot_wait = ""
        self.endpoint = _mpi.StageEndpoint(pool, MPI._handleof(comm), chunk_bytes())

    def _check(self) -> None:
        """Raise the progress thread's failure: :class:`MPITransferError` for an MPI call's error."""
        if self.endpoint.failed:
            kind = MPITransferError if self.endpoint.error_kind == "mpi" else TransportError
            raise kind(f"transport: rank {self.rank}: {self.endpoint.error}")

    def send(self, dest: int, header: Header, slot=None) -> None:
        self._check()
        try:
            self.endpoint.send(dest, header.encode(), slot)
        except RuntimeError:
            self._check()       # the thread failed after the check above: raise its failure, classified
            raise

    def try_recv(self, src: int, kind: int, keep_slot: bool = False) -> Optional[Message]:
        if src == ANY:
            raise TransportError(f"transport: rank {self.rank}: the core endpoint receives {KIND_NAMES.get(kind, kind)} "
                                 "messages from a named rank only")
        try:
            got = self.endpoint.try_recv(src, kind)
        except RuntimeError:
            self._check()
            raise
        self.slot_wait = self.endpoint.slot_wait
        if got is None:
            self._check()
            return None
        sender, words, slot = got
        header = Header.decode(words)
        if slot is None:
            return Message(sender, header, np.empty(0, dtype=np.uint8))
        if keep_slot:
            return Message(sender, header, slot_bytes(slot, header.nbytes), slot)
        payload = slot_bytes(slot, header.nbytes).copy()
        self.pool.release(slot)
        return Message(sender, header, payload)

    def progress(self) -> None:
        self._check()

    def pending_sends(self) -> int:
        return self.endpoint.pending_sends

    def close(self) -> None:
        """Stop the progress thread and give every slot back; :class:`TransportError` lists the messages
        that were consumed and never delivered."""
        lost = self.endpoint.close()
        if lost:
            raise TransportError(f"transport: rank {self.rank} closed with messages consumed and not delivered: "
                                 f"{'; '.join(lost)}")
