"""A bench-local stand-in planner, used only when ``hetpipe.plan.make_plan`` is not available.

ED formation (each VW gets one device of each type, in cluster order), contiguous partition of the
layers over a VW's devices minimising the slowest stage's forward + backward time (exact dynamic
programme), one PS shard owning every layer. The table names which planner produced the plan.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from devices import DeviceModel
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan


def min_max_partition(costs: Sequence[Sequence[float]]) -> List[Tuple[int, int]]:
    """Split layers 0..L-1 into len(costs) contiguous non-empty stages; stage k costs sum(costs[k][a:b]).

    Returns the [start, stop) ranges minimising the largest stage cost."""
    k_n, n = len(costs), len(costs[0])
    if n < k_n:
        raise ValueError(f"cannot split {n} layers over {k_n} devices")
    pre = [[0.0] * (n + 1) for _ in range(k_n)]
    for k in range(k_n):
        for i in range(n):
            pre[k][i + 1] = pre[k][i] + costs[k][i]
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k_n + 1)]
    cut = [[0] * (n + 1) for _ in range(k_n + 1)]
    best[0][0] = 0.0
    for k in range(1, k_n + 1):
        for b in range(k, n - (k_n - k) + 1):
            for a in range(k - 1, b):
                v = max(best[k - 1][a], pre[k - 1][b] - pre[k - 1][a])
                if v < best[k][b]:
                    best[k][b], cut[k][b] = v, a
    ranges, b = [], n
    for k in range(k_n, 0, -1):
        a = cut[k][b]
        ranges.append((a, b))
        b = a
    return ranges[::-1]


def standin_plan(dm: DeviceModel, nm: int, d: int, names: Sequence[str]) -> Plan:
    by_type: Dict[str, List[str]] = {}
    for dev, t in dm.devices:
        by_type.setdefault(t, []).append(dev)
    num_vws = min(len(v) for v in by_type.values())
    kind = {dev: t for dev, t in dm.devices}
    vws = []
    for v in range(num_vws):
        devs = [by_type[t][v] for t in dm.types]
        costs = [[f + b for f, b in zip(dm.fwd[kind[x]], dm.bwd[kind[x]])] for x in devs]
        stages = []
        for x, (a, b) in zip(devs, min_max_partition(costs)):
            f, w = dm.scaled_times(kind[x], range(a, b), dm.minibatch)
            stages.append(StagePlan(x, kind[x], a, b, f, w))
        vws.append(VirtualWorkerPlan(v, tuple(stages)))
    layers = len(names)
    return Plan(layers, nm, d, "ED (bench stand-in)", tuple(vws), (ShardPlan(0, "n0", tuple(range(layers))),),
                minibatch_size=dm.minibatch, layer_names=tuple(names))
