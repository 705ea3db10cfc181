"""A PS shard rank for any front end: ``serve_shard(comm, plan, layer_weights)`` serves one shard to its end.

The torch Trainer's shard ranks and the NumPy and JAX front ends' serve the same protocol with the
same code: the compiled core's ``ShardService`` over ``hetpipe_core.ShardPlane`` where MPI runs at
``MPI_THREAD_MULTIPLE`` (:func:`hetpipe.ps.core_plane.choose_plane`), the Python shard otherwise.
No torch import; the weights are NumPy arrays, one flat float32 vector per layer.

Failure contract: no collective call is made, so a peer that fails before or during the run leaves
this rank waiting at most ``timeout`` seconds (``PeerTimeout`` naming what it waited for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hetpipe.plan.types import Plan
from hetpipe.ps.core_plane import CoreShardServer, CoreShardState, choose_plane
from hetpipe.ps.server import ShardServer, ShardServerBase
from hetpipe.ps.shard import ShardLog, ShardState
from hetpipe.schedule.trace import TraceEvent
from hetpipe.transport.base import Transport
from hetpipe.transport.drive import drive
from hetpipe.transport.mpi import MPITransport
from hetpipe.transport.slots import shard_pool


@dataclass
class ShardOutcome:
    """A served shard's end: its final global weights and synced buffers per layer, its log, its plane."""

    index: int
    weights: Dict[int, np.ndarray]
    buffers: Dict[int, np.ndarray]
    log: ShardLog
    plane: str


def layer_vectors(plan: Plan, arrays: Sequence, what: str) -> List[np.ndarray]:
    """``arrays`` as one flat float32 NumPy vector per layer of ``plan``; a ValueError names the layer
    whose dtype the PS does not hold or the count that differs."""
    if len(arrays) != plan.num_layers:
        raise ValueError(f"hetpipe: the plan has {plan.num_layers} layers, got {what} for {len(arrays)}")
    out = []
    for layer, a in enumerate(arrays):
        a = np.asarray(a)
        if a.dtype != np.float32:
            raise ValueError(f"hetpipe: layer {layer}'s {what} are {a.dtype}; the parameter servers hold float32")
        out.append(np.ascontiguousarray(a).reshape(-1))
    return out


def shard_server(plan: Plan, shard: int, weights: Mapping[int, np.ndarray], buffers: Mapping[int, np.ndarray],
                 transport: Transport, pool, *, comm: Any = None,
                 replicas: Optional[Mapping[Tuple[int, int], Sequence[Tuple[int, int, int]]]] = None,
                 momentum: Optional[Mapping[int, np.ndarray]] = None,
                 delayed: Optional[Tuple[Mapping[int, np.ndarray], Mapping[int, int]]] = None, audit: bool = False,
                 trace: Optional[List[TraceEvent]] = None, t0: float = 0.0) -> ShardServerBase:
    """Shard ``shard`` of ``plan`` holding ``weights`` and ``buffers`` of its layers: the compiled core's
    data plane served over ``comm`` (an mpi4py communicator) when given, else the Python shard over
    ``transport``. ``replicas[(vw, stage)]``: the tied slices that stage pulls; ``momentum`` and
    ``delayed`` (delayed-nesterov's buffers and their push counts): the outer optimizer's state a resumed
    run continues from."""
    stage_layers = [[(s.start, s.stop) for s in vw.stages] for vw in plan.virtual_workers]
    options = dict(log_sums=audit, buffers=dict(buffers), replicas=replicas, aggregate=plan.aggregate,
                   momentum=momentum, delayed=delayed, **plan.outer_options,
                   wave_minibatches=None if plan.equal_waves else plan.wave_minibatches)
    if comm is not None:
        core = CoreShardState(shard, dict(weights), stage_layers, plan.d, **options)
        return CoreShardServer(core, transport, pool, plan.num_stage_ranks, comm, trace=trace, t0=t0)
    state = ShardState(shard, dict(weights), stage_layers, plan.d, **options)
    return ShardServer(state, transport, pool, plan.num_stage_ranks, trace=trace, t0=t0)


def serve_shard(comm, plan: Plan, layer_weights: Sequence, *, layer_buffers: Optional[Sequence] = None,
                timeout: float = 120.0, audit: bool = False, plane: Optional[str] = None) -> ShardOutcome:
    """Serve this rank's PS shard of ``plan`` over ``comm`` (an mpi4py communicator) until every stage
    said DONE; ``layer_weights[l]``: layer ``l``'s initial weights (the same on every rank).

    ``plane``: "core" or "python" to force one (default: :func:`choose_plane`'s). ``audit``: the log
    keeps float64 sums of the pushed deltas."""
    rank = comm.Get_rank()
    kind, shard, stage = plan.role_of(rank)
    if kind != "ps":
        raise ValueError(f"hetpipe: rank {rank} runs VW {shard} stage {stage} in this plan, not a PS shard")
    weights = layer_vectors(plan, layer_weights, "weights")
    buffers = layer_vectors(plan, layer_buffers, "buffers") if layer_buffers is not None else \
        [np.zeros(0, np.float32)] * plan.num_layers
    owned = plan.ps_shards[shard].layers
    chosen = plane or choose_plane(comm)[0]
    biggest = 4 * max(sum(weights[l].size + buffers[l].size for l in owned if st.start <= l < st.stop)
                      for vw in plan.virtual_workers for st in vw.stages)
    pool = shard_pool(plan.num_stage_ranks, biggest, chosen)
    server = shard_server(plan, shard, {l: weights[l] for l in owned}, {l: buffers[l] for l in owned},
                          MPITransport(comm, pool), pool, comm=comm if chosen == "core" else None, audit=audit)
    drive(server, timeout, f"hetpipe: rank {rank} (ps shard {shard})")
    server.transport.close()
    state = server.state
    return ShardOutcome(shard, {l: np.array(state.W[l]) for l in owned}, {l: np.array(state.B[l]) for l in owned},
                        state.log, chosen)
