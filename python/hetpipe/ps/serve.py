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
from typing import Dict, List, Optional, Sequence

import numpy as np

import hetpipe_core
from hetpipe.plan.types import Plan
from hetpipe.ps.core_plane import CoreShardServer, CoreShardState, choose_plane
from hetpipe.ps.server import ShardServer
from hetpipe.ps.shard import ShardLog, ShardState
from hetpipe.transport.drive import drive
from hetpipe.transport.mpi import MPITransport


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
    stage_layers = [[(s.start, s.stop) for s in vw.stages] for vw in plan.virtual_workers]
    options = dict(log_sums=audit, buffers={l: buffers[l] for l in owned}, aggregate=plan.aggregate,
                   **plan.outer_options)
    chosen = plane or choose_plane(comm)[0]
    if chosen == "core":
        state = CoreShardState(shard, {l: weights[l] for l in owned}, stage_layers, plan.d, **options)
        pool = hetpipe_core.PinnedBufferPool(1, 4096, -1)
        server = CoreShardServer(state, MPITransport(comm, pool), pool, plan.num_stage_ranks, comm)
    else:
        state = ShardState(shard, {l: weights[l] for l in owned}, stage_layers, plan.d, **options)
        biggest = 4 * max(sum(weights[l].size + buffers[l].size for l in owned if st.start <= l < st.stop)
                          for vw in plan.virtual_workers for st in vw.stages)
        pool = hetpipe_core.PinnedBufferPool(2 * plan.num_stage_ranks + 8, max(4096, -(-biggest // 4096) * 4096), -1)
        server = ShardServer(state, MPITransport(comm, pool), pool, plan.num_stage_ranks)
    drive(server, timeout, f"hetpipe: rank {rank} (ps shard {shard})")
    server.transport.close()
    return ShardOutcome(shard, {l: np.array(state.W[l]) for l in owned}, {l: np.array(state.B[l]) for l in owned},
                        state.log, chosen)
