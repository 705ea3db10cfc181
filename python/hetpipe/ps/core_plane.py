"""The PS shard's data plane in the compiled core: which plane a shard rank runs, and the core one.

Over MPI a shard rank hands pushes, wave application and pulls to ``hetpipe_core.ShardPlane`` served
by ``hetpipe_core._mpi.ShardService``: the core's threads receive PUSH and PULL messages (payloads
straight into the plane's pending buffers), apply waves and answer pulls without the GIL, on the wire
format of :mod:`hetpipe.transport.protocol`; the result is bitwise that of the Python shard
(:class:`hetpipe.ps.shard.ShardState`). :class:`CoreShardServer` keeps, in Python, what is no data
path: the DONE messages, deciding when the shard is finished, checkpoints at wave boundaries (the
plane holds its applier at each boundary until the snapshot is taken), the logs and the timeline, and
turning a failure of a core thread into an exception naming the culprit.

:func:`choose_plane` picks "core" when the run is over MPI, ``hetpipe_core`` was built with MPI and
MPI runs at ``MPI_THREAD_MULTIPLE``; "python" otherwise or when ``HETPIPE_PS_PLANE=python``. What stays
Python-only: the single-process replay (no MPI; and a replay that follows a run's record holds
waves back per pull, which the core does not do). Thread role: everything here runs on the shard
rank's main thread; the core's threads never call back into Python.
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import hetpipe_core
from hetpipe.util.planes import PLANES, PS_PLANE_ENV
from hetpipe.ps.server import ShardServerBase
from hetpipe.plan.outer import check_outer, has_momentum
from hetpipe.ps.shard import (
    ShardLog, WSPViolation, check_aggregate, check_wave_minibatches, held_layers, initial_delayed, initial_momentum,
    stage_ranks,
)
from hetpipe.schedule.trace import PS_VW, TraceEvent
from hetpipe.transport.base import Transport
from hetpipe.transport.core import core_mpi_missing
from hetpipe.transport.protocol import MPITransferError, TransportError, chunk_bytes

PLANE_ENV = PS_PLANE_ENV


def choose_plane(comm) -> Tuple[str, str]:
    """The data plane of a PS shard rank over ``comm`` ("core" or "python") with the one-line reason.

    ``HETPIPE_PS_PLANE``: "auto" (default), "core" (an error where the core plane cannot run) or
    "python"."""
    wanted = os.environ.get(PLANE_ENV, "").strip().lower() or "auto"
    if wanted not in PLANES:
        raise ValueError(f"hetpipe: {PLANE_ENV} must be one of {', '.join(PLANES)}, got {wanted!r}")
    if wanted == "python":
        return "python", f"python: {PLANE_ENV}=python"
    missing = core_mpi_missing(comm)
    if missing is None:
        return "core", "core: the compiled core's threads receive pushes, apply waves and serve pulls over MPI"
    if wanted == "core":
        raise ValueError(f"hetpipe: {PLANE_ENV}=core, but {missing}")
    return "python", f"python: {missing}"


class CoreShardState:
    """A shard's state in a ``hetpipe_core.ShardPlane``, read through :class:`ShardView`:
    ``W``/``B``/``M``/``A`` are zero-copy views of the plane's memory (read them, and :meth:`outer_counts`,
    while the service is stopped or the plane holds at a wave boundary), ``log`` is filled when the
    service stops."""

    def __init__(self, index: int, weights: Dict[int, np.ndarray], stage_layers: Sequence[Sequence[Tuple[int, int]]],
                 d: int, *, log_sums: bool = False, buffers: Optional[Dict[int, np.ndarray]] = None,
                 replicas: Optional[Dict[Tuple[int, int], Sequence[Tuple[int, int, int]]]] = None,
                 aggregate: str = "sum", outer: str = "sgd", outer_lr: float = 1.0, outer_momentum: float = 0.9,
                 outer_staleness: str = "none", outer_gain: str = "none", outer_delay: int = 0,
                 momentum: Optional[Dict[int, np.ndarray]] = None,
                 delayed: Optional[Tuple[Dict[int, np.ndarray], Dict[int, int]]] = None,
                 wave_minibatches: Optional[Sequence[int]] = None) -> None:
        check_aggregate(index, aggregate)
        check_wave_minibatches(index, wave_minibatches, len(stage_layers))
        self.index, self.d, self.aggregate = index, d, aggregate
        self.outer_options = check_outer(f"PS shard {index}", outer, outer_lr, outer_momentum, outer_staleness,
                                         outer_gain, outer_delay)
        self.layers = sorted(weights)
        buffers = buffers or {}
        w0 = {l: np.ascontiguousarray(weights[l], dtype=np.float32).reshape(-1) for l in self.layers}
        b0 = {l: np.ascontiguousarray(buffers.get(l, np.zeros(0)), dtype=np.float32).reshape(-1) for l in self.layers}
        self.num_vws = len(stage_layers)
        self.stage_layers = held_layers(w0, b0, stage_layers)
        self.stage_ranks = stage_ranks(stage_layers)
        self.replicas = {k: list(v) for k, v in (replicas or {}).items() if v}
        local = {l: i for i, l in enumerate(self.layers)}
        num_stages = [len(vw) for vw in stage_layers]
        plane_layers = [[[local[l] for l in self.stage_layers[vw].get(s, ())] for s in range(num_stages[vw])]
                        for vw in range(self.num_vws)]
        plane_replicas = [[[(local[l], a, n) for l, a, n in self.replicas.get((vw, s), ())]
                           for s in range(num_stages[vw])] for vw in range(self.num_vws)]
        self.plane = hetpipe_core.ShardPlane([w0[l].size for l in self.layers], plane_layers, d, 0,
                                             buffer_numels=[b0[l].size for l in self.layers], replicas=plane_replicas,
                                             aggregate=aggregate, log_sums=log_sums,
                                             wave_minibatches=list(wave_minibatches or ()), **self.outer_options)
        self.W = {l: self.plane.weights(i) for i, l in enumerate(self.layers)}
        self.B = {l: self.plane.buffers(i) for i, l in enumerate(self.layers)}
        self.M = {l: self.plane.momentum(i) for i, l in enumerate(self.layers)}
        is_delayed = outer == "delayed-nesterov"
        # nesterov's A is the plane's too, but zero at every wave boundary: not part of the state.
        self.A = {l: self.plane.aggregated(i) if is_delayed else np.zeros(0, np.float32)
                  for i, l in enumerate(self.layers)}
        m0 = initial_momentum(index, w0, momentum, has_momentum(self.outer_options))
        a0, n0 = initial_delayed(index, w0, delayed, is_delayed)
        for i, l in enumerate(self.layers):
            self.W[l][:] = w0[l]
            self.B[l][:] = b0[l]
            self.M[l][:] = m0[l]
            self.A[l][:] = a0[l]
            self.plane.set_outer_count(i, n0[l])
        self.clock = self.plane            # clock(vw), as ShardState.clock
        self.on_applied = None             # called with ``applied`` at each wave boundary (checkpoints)
        self.log = ShardLog()
        self.log_sums = log_sums

    @property
    def applied(self) -> int:
        return int(self.plane.applied)

    @property
    def global_clock(self) -> int:
        return int(self.plane.global_clock)

    def outer_counts(self) -> Dict[int, int]:
        return {l: int(self.plane.outer_count(i)) for i, l in enumerate(self.layers)}

    def collect_log(self) -> None:
        """Copy the plane's log into ``log`` (a :class:`ShardLog`)."""
        got = self.plane.log()
        self.log = ShardLog(pushes=[tuple(p) for p in got["pushes"]], clocks=[tuple(c) for c in got["clocks"]],
                            pulls=[tuple(p) for p in got["pulls"]], pull_clocks=list(got["pull_clocks"]),
                            applied=[tuple(a) for a in got["applied"]],
                            pushed_sum={l: got["pushed_sum"][i] for i, l in enumerate(self.layers)}
                            if self.log_sums else {})


_live: "weakref.WeakSet[CoreShardServer]" = weakref.WeakSet()


@atexit.register
def _stop_live() -> None:
    """Stop services still running at exit, before mpi4py (registered earlier) finalises MPI."""
    for server in list(_live):
        server.service.stop()


class CoreShardServer(ShardServerBase):
    """Drives a :class:`CoreShardState` served by the core's MPI service; ``step()`` never blocks.

    The service starts at the first step (the checkpointer may have set ``state.on_applied`` by then)
    and stops once the shard finished or failed."""

    def __init__(self, state: CoreShardState, transport: Transport, pool, num_stage_ranks: int, comm, *,
                 trace: Optional[List[TraceEvent]] = None, t0: float = 0.0) -> None:
        super().__init__(state, transport, pool, num_stage_ranks, trace=trace, t0=t0)
        from mpi4py import MPI

        from hetpipe_core import _mpi

        sources = [state.stage_ranks[k] for k in sorted(state.stage_ranks)]    # VW by VW, stage by stage
        self.service = _mpi.ShardService(state.plane, MPI._handleof(comm), state.index, trace is not None,
                                         chunk_bytes(), sources=sources)
        self._started = False
        self._events = 0
        _live.add(self)

    def step(self) -> bool:
        state, svc, t = self.state, self.service, self.transport
        plane = state.plane
        if not self._started:
            plane.set_hold(state.on_applied is not None)
            svc.start()
            self._started = True
        self._check()
        t.progress()
        progressed = self._receive_done()
        held = plane.held
        if held >= 0:
            state.on_applied(held)
            plane.release(held)
            progressed = True
        events = svc.events
        if events != self._events:
            self._events, progressed = events, True
        complete = (len(self.done) == self.num_stage_ranks and svc.pulls_outstanding == 0 and t.pending_sends() == 0
                    and all(svc.pushes_received(vw, s) == n for (vw, s), n in self.done.items())
                    and plane.applied == plane.global_clock and plane.held < 0)
        if complete and not self.finished:
            self._stop()
            self.finished = True
            return True
        waiting = self.num_stage_ranks - len(self.done)
        self.blocked_on = (f"messages from the stages ({waiting} not done, global clock {plane.global_clock}, "
                           f"{plane.applied} wave(s) applied, {svc.pulls_outstanding} pull(s) unanswered)")
        return progressed

    def _check(self) -> None:
        """Raise the failure of a core thread, naming the culprit."""
        svc = self.service
        if not svc.failed:
            return
        svc.stop()
        if svc.error_kind == "wsp":
            raise WSPViolation(svc.error, sender=None if svc.error_source < 0 else svc.error_source)
        raise (MPITransferError if svc.error_kind == "mpi" else RuntimeError)(svc.error)

    def _stop(self) -> None:
        self.service.stop()
        self._check()
        lost = self.service.lost()
        if lost:
            raise TransportError(f"PS shard {self.state.index}: stopped with messages consumed but not handled: "
                                 f"{'; '.join(lost)}")
        self.state.collect_log()
        if self.trace is not None:
            for kind, vw, stage, wave, start, end, before, after in self.service.trace():
                if kind == "PUSH":
                    label = f"push w{wave} VW {vw}.{stage}"
                    if after > before:
                        label += f"; applied wave(s) {before}..{after - 1}"
                else:
                    label = f"pull w{wave} VW {vw}.{stage} (g={before})"
                self.trace.append(TraceEvent(PS_VW, self.state.index, kind, start - self.t0, end - start, -1, wave,
                                             label))
