"""``train``: every rank of an MPI job calls it; stage ranks run their JAX stage, PS ranks serve their shard.

The PS ranks run the same core ``ShardService`` torch runs use (:func:`hetpipe.ps.serve.serve_shard`).
VW ``v`` trains on ``batches[v::V]`` (V VWs), cut to the same count for every VW, ``epochs`` times.
A failure on any rank ends the job at once, naming the rank (:func:`hetpipe.job.failure.aborting`);
the results are gathered on every rank once all finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from hetpipe.jax.model import FlatLayers, Layer, boundary_shapes
from hetpipe.jax.stage import JaxStage
from hetpipe.job.failure import aborting
from hetpipe.plan.types import Plan
from hetpipe.ps.serve import serve_shard
from hetpipe.ps.shard import ShardLog
from hetpipe.ps.worker import WorkerRank
from hetpipe.schedule.generators import hetpipe_schedule


@dataclass
class JaxResult:
    """A finished run, the same on every rank.

    ``losses[v]``: VW ``v``'s loss per minibatch, in order; ``weights[l]``: layer ``l``'s final global
    weights (flat float32); ``params``: them as each layer's pytree; ``pulls[(v, s, w)]``: per shard the
    global clock ``g`` the pull of wave ``w`` by stage ``s`` of VW ``v`` got (the run's record: at D >= 1
    it depends on timing); ``shard_logs[k]``: shard ``k``'s log; ``ps_plane``: the shards' data plane."""

    losses: Dict[int, List[float]]
    weights: Dict[int, np.ndarray]
    params: List[Any]
    pulls: Dict[Tuple[int, int, int], Dict[int, int]] = field(default_factory=dict)
    shard_logs: Dict[int, ShardLog] = field(default_factory=dict)
    ps_plane: str = ""


def vw_minibatches(batches: Sequence[Tuple[Any, Any]], num_vws: int, epochs: int) -> List[List[Tuple[Any, Any]]]:
    """Each VW's minibatches: VW ``v`` takes ``batches[v::num_vws]``, all cut to the shortest, ``epochs`` times."""
    per_vw = len(batches) // num_vws
    if per_vw == 0:
        raise ValueError(f"hetpipe: {len(batches)} minibatches for {num_vws} virtual workers; each needs at least one")
    return [list(batches[v::num_vws][:per_vw]) * epochs for v in range(num_vws)]


def train(comm, plan: Plan, layers: Sequence[Layer], loss: Callable, optimizer: Any,
          batches: Sequence[Tuple[Any, Any]], *, epochs: int = 1, timeout: float = 60.0) -> JaxResult:
    """Train ``layers`` (the same on every rank) under ``plan`` over ``comm`` (an mpi4py communicator).

    ``loss(output, labels)`` gives a scalar; ``optimizer`` follows the optax contract (``hetpipe.jax.sgd``
    or an optax ``GradientTransformation``) and steps each stage's flat weights; ``batches`` is a list of
    ``(inputs, labels)``, the same on every rank."""
    rank = comm.Get_rank()
    kind, a, b = plan.role_of(rank)
    who = f"rank {rank} ({f'vw {a} stage {b}' if kind == 'stage' else f'ps shard {a}'})"
    with aborting(comm, who):
        if len(layers) != plan.num_layers:
            raise ValueError(f"hetpipe: the plan cuts {plan.num_layers} layers, the model has {len(layers)}")
        flat = FlatLayers(layers)
        data = vw_minibatches(batches, len(plan.virtual_workers), epochs)
        shapes = boundary_shapes(flat, *data[0][0], loss)
        mine: Dict[str, Any] = {}
        if kind == "ps":
            outcome = serve_shard(comm, plan, flat.vectors, timeout=2 * timeout)
            mine = {"weights": outcome.weights, "log": (outcome.index, outcome.log), "plane": outcome.plane}
        else:
            slot = 4 * max(sum(flat.sizes), *(int(np.prod(s)) for s, _ in shapes))
            worker = WorkerRank(comm, plan, slot, timeout=timeout)
            schedule = hetpipe_schedule(worker.num_stages, len(data[a]), plan.nm, plan.d)
            stage = JaxStage(worker, flat, schedule.streams[b], data[a], loss, optimizer, shapes)
            stage.run()
            mine = {"pulls": {(a, b, w): g for w, g in stage.client.pulled.items()}}
            if stage.last:
                mine["losses"] = (a, [stage.losses[p] for p in sorted(stage.losses)])
    everyone = comm.allgather(mine)
    weights = {l: w for m in everyone for l, w in m.get("weights", {}).items()}
    return JaxResult({v: ls for m in everyone if "losses" in m for v, ls in [m["losses"]]}, weights,
                     [flat.params_of(l, weights[l]) for l in range(plan.num_layers)],
                     {k: g for m in everyone for k, g in m.get("pulls", {}).items()},
                     {k: log for m in everyone if "log" in m for k, log in [m["log"]]},
                     "+".join(sorted({m["plane"] for m in everyone if "plane" in m})))
