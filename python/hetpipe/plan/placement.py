"""Parameter-server placement: which PS shard (on which node) owns each layer's parameters.

Every VW holds the whole model, so each wave every VW pushes and pulls every layer's parameters
once. A layer's traffic to a shard on node ``n`` crosses the network only for the VWs whose stage
holding that layer is *not* on ``n``: its remote bytes are ``param_bytes x (#VWs - #VWs holding it
on n)``. Following Park et al. (arXiv:1901.05803), layers are assigned largest first to the shard
that minimises its resulting remote load (bytes x traffic), which balances the shards' network
time and favours the node whose VWs use the layer (HetPipe's ED-local placement); ties go to the
shard with the fewest parameter bytes. Shards are spread over the nodes, one per node by default.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hetpipe.plan.types import ShardPlan


def shard_nodes(nodes: Sequence[str], num_shards: Optional[int] = None) -> List[str]:
    """The node of each shard: round-robin over the nodes (one shard per node by default)."""
    n = len(nodes) if num_shards is None else num_shards
    if n < 1:
        raise ValueError(f"placement: num_ps_shards must be >= 1, got {num_shards}")
    return [nodes[i % len(nodes)] for i in range(n)]


def holders(num_layers: int, nodes: Sequence[str], vw_stages: Sequence[Sequence[Tuple[int, int, str]]]
            ) -> np.ndarray:
    """``h[l, n]``: how many VWs hold layer ``l`` on a device of node ``nodes[n]``.

    ``vw_stages``: per VW, its stages as ``(start, stop, node)``."""
    idx = {n: i for i, n in enumerate(nodes)}
    h = np.zeros((num_layers, len(nodes)))
    for stages in vw_stages:
        for a, b, node in stages:
            h[a:b, idx[node]] += 1
    return h


def place_layers(param_bytes: Sequence[float], nodes: Sequence[str],
                 vw_stages: Sequence[Sequence[Tuple[int, int, str]]], num_shards: Optional[int] = None,
                 shard_at: Optional[Sequence[str]] = None) -> Tuple[ShardPlan, ...]:
    """Assign every layer to a shard (see the module docstring). ``shard_at``: the node of each
    shard, when the shards' ranks are already placed (a node may be one without devices)."""
    L = len(param_bytes)
    if shard_at is not None:
        where = list(shard_at)
        nodes = list(nodes) + [n for n in dict.fromkeys(where) if n not in nodes]
    else:
        where = shard_nodes(list(nodes), num_shards)
    h = holders(L, nodes, vw_stages)
    node_idx = {n: i for i, n in enumerate(nodes)}
    col = np.array([node_idx[n] for n in where])
    nvw = len(vw_stages)
    pb = np.asarray(param_bytes, dtype=float)
    remote = pb[:, None] * (nvw - h[:, col])          # (L, shards)
    load = np.zeros(len(where))
    owned = np.zeros(len(where))
    layers: Dict[int, List[int]] = {s: [] for s in range(len(where))}
    for lay in sorted(range(L), key=lambda i: (-pb[i], i)):
        cand = load + remote[lay]
        best = np.flatnonzero(cand <= cand.min() * (1 + 1e-12) + 1e-9)
        s = int(best[np.argmin(owned[best])])
        layers[s].append(lay)
        load[s] += remote[lay, s]
        owned[s] += pb[lay]
    return tuple(ShardPlan(s, where[s], tuple(sorted(layers[s])), int(owned[s])) for s in range(len(where)))
