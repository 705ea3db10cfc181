"""A plan written by hand: given cuts for each virtual worker, no cluster or profile needed."""

from __future__ import annotations

from typing import Optional, Sequence

from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan


def manual_plan(num_layers: int, cuts: Sequence[Sequence[int]], *, nm: int, d: int, shards: int = 1,
                aggregate: str = "mean", devices: Optional[Sequence[Sequence[str]]] = None) -> Plan:
    """One VW per entry of ``cuts``: VW ``v``'s stages split layers ``[0, num_layers)`` at ``cuts[v]``
    (``[]``: one stage); ``shards`` PS shards own the layers round-robin. Ranks follow the plan's order:
    VW 0's stages, then VW 1's, ..., then the shards. ``devices[v][s]`` names stage ``s`` of VW ``v``
    (default ``cpu``). A ValueError names the VW whose cuts are not increasing inside the model."""
    if shards < 1 or shards > num_layers:
        raise ValueError(f"plan: {shards} PS shards for {num_layers} layers; each shard owns at least one layer")
    vws = []
    for v, vw_cuts in enumerate(cuts):
        bounds = [0, *vw_cuts, num_layers]
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"plan: VW {v}'s cuts {list(vw_cuts)} must increase strictly inside (0, {num_layers})")
        names = devices[v] if devices is not None else ["cpu"] * (len(bounds) - 1)
        vws.append(VirtualWorkerPlan(v, tuple(StagePlan(names[s], names[s], a, b, 0.0, 0.0)
                                              for s, (a, b) in enumerate(zip(bounds, bounds[1:])))))
    owned = tuple(ShardPlan(k, "n0", tuple(range(k, num_layers, shards))) for k in range(shards))
    return Plan(num_layers, nm, d, "manual", tuple(vws), owned, aggregate=aggregate)
