"""Device mapping: candidate pipeline orders for VWs beyond the exact order search.

The partitioner searches every distinct order exactly (:mod:`hetpipe.plan.orders`) when a VW has at
most ``exhaustive_max`` devices or few interchangeable classes; otherwise it tries these orders.

Two devices of the same type on the same node are interchangeable, and so are node labels (every
intra-node link is alike, and every inter-node link), so orders are compared by their *signature*:
the sequence of (type, node number in order of first appearance). Small VWs (at most
``exhaustive_max`` devices) try every order with a distinct signature, which keeps the partitioner
exact. Larger VWs keep each node's devices consecutive, so that stage-to-stage activation traffic
crosses the slow inter-node network as few times as possible (AutoPipe-H's heterogeneity-aware
mapping), and try every order of the node groups when there are few distinct ones, else a handful
of heuristic orders (fastest first, slowest first, most memory first).
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, List, Mapping, Sequence, Tuple

from hetpipe.plan.stage_cost import StageDevice

MAX_GROUP_ORDERS = 120


def signature(order: Sequence[StageDevice]) -> Tuple[Tuple[str, int], ...]:
    nodes: Dict[str, int] = {}
    return tuple((s.device_type, nodes.setdefault(s.node, len(nodes))) for s in order)


def _dedup(orders) -> List[Tuple[StageDevice, ...]]:
    seen, out = set(), []
    for o in orders:
        sig = signature(o)
        if sig not in seen:
            seen.add(sig)
            out.append(tuple(o))
    return out


def distinct_perms(items: Sequence, key) -> int:
    """How many orders of ``items`` differ under ``key`` (a multinomial coefficient)."""
    counts: Dict = {}
    for it in items:
        counts[key(it)] = counts.get(key(it), 0) + 1
    n = math.factorial(len(items))
    for c in counts.values():
        n //= math.factorial(c)
    return n


def _unique_permutations(items: Sequence, key):
    """Permutations of ``items`` distinct under ``key`` (items with equal keys are interchangeable)."""
    groups: Dict = {}
    for it in items:
        groups.setdefault(key(it), []).append(it)
    keys = list(groups)
    counts = {k: len(v) for k, v in groups.items()}
    out: List = []

    def rec(prefix, used):
        if len(prefix) == len(items):
            taken = {k: 0 for k in keys}
            seq = []
            for k in prefix:
                seq.append(groups[k][taken[k]])
                taken[k] += 1
            out.append(seq)
            return
        for k in keys:
            if used[k] < counts[k]:
                used[k] += 1
                rec(prefix + [k], used)
                used[k] -= 1

    rec([], {k: 0 for k in keys})
    return out


def candidate_orders(stage_devs: Sequence[StageDevice], speed: Mapping[str, float], exhaustive_max: int = 5
                     ) -> List[Tuple[StageDevice, ...]]:
    """Device orders worth partitioning over, distinct by signature; the given order first."""
    stage_devs = list(stage_devs)
    if len(stage_devs) <= exhaustive_max:
        return _dedup([stage_devs] + [list(p) for p in itertools.permutations(stage_devs)])

    def within(node_devs: List[StageDevice]) -> List[StageDevice]:
        return sorted(node_devs, key=lambda s: (-speed[s.device_type], -s.memory_bytes, s.device))

    groups: Dict[str, List[StageDevice]] = {}
    for s in stage_devs:
        groups.setdefault(s.node, []).append(s)
    units = [within(g) for g in groups.values()]

    def unit_key(u):
        return tuple(s.device_type for s in u)

    orders: List[List[StageDevice]] = [stage_devs, [s for u in units for s in u]]
    if distinct_perms(units, unit_key) <= MAX_GROUP_ORDERS:
        for perm in _unique_permutations(units, unit_key):
            orders.append([s for u in perm for s in u])
    else:
        def unit_speed(u):
            return sum(speed[s.device_type] for s in u) / len(u)

        for key in (lambda u: -unit_speed(u), unit_speed, lambda u: -sum(s.memory_bytes for s in u)):
            orders.append([s for u in sorted(units, key=key) for s in u])
    return _dedup(orders)
