"""Virtual-worker formation: which devices form each VW (HetPipe's NP, ED and HD policies).

All policies form VWs of ``vw_size`` devices (default: the largest number of devices on a node), so
that the policies compare the same degree of data parallelism:

* **NP** (node partition): the devices of each node form VWs of their own — one VW per node when
  ``vw_size`` is the node size. VWs are homogeneous; fast nodes make fast VWs.
* **ED** (equal distribution): devices are dealt round-robin, type by type (fastest type first),
  so each VW gets as equal a mix of device types as the counts allow. On the HetPipe testbed every
  VW gets one GPU of each of the four types, each on a different node.
* **HD** (hybrid distribution): nodes are sorted by speed and paired fastest with slowest, second
  fastest with second slowest, ...; each pair yields VWs taking half of their devices from each
  node. VWs mix two types and cross only one node boundary. An unpaired middle node forms VWs
  alone (as NP).

A formation is a list of VWs, each a list of device ids in cluster order (the partitioner chooses
the pipeline order).
"""

from __future__ import annotations

from typing import List, Optional

from hetpipe.plan.cluster import ClusterSpec

POLICIES = ("NP", "ED", "HD")


def default_vw_size(cluster: ClusterSpec) -> int:
    return max(len(cluster.devices_of(n)) for n in cluster.nodes)


def _chunks(ids: List[str], size: int) -> List[List[str]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def form_np(cluster: ClusterSpec, vw_size: Optional[int] = None) -> List[List[str]]:
    size = vw_size or default_vw_size(cluster)
    out: List[List[str]] = []
    for n in cluster.nodes:
        out.extend(_chunks([d.id for d in cluster.devices_of(n)], size))
    return out


def form_ed(cluster: ClusterSpec, vw_size: Optional[int] = None) -> List[List[str]]:
    size = vw_size or default_vw_size(cluster)
    count = -(-len(cluster.devices) // size)
    node_pos = {n: i for i, n in enumerate(cluster.nodes)}
    order = sorted(cluster.devices,
                   key=lambda d: (-cluster.device_types[d.type].speed, d.type, node_pos[d.node], d.id))
    vws: List[List[str]] = [[] for _ in range(count)]
    for i, d in enumerate(order):
        vws[i % count].append(d.id)
    pos = {d.id: i for i, d in enumerate(cluster.devices)}
    return [sorted(v, key=pos.__getitem__) for v in vws if v]


def form_hd(cluster: ClusterSpec, vw_size: Optional[int] = None) -> List[List[str]]:
    size = vw_size or default_vw_size(cluster)

    def node_speed(n: str) -> float:
        devs = cluster.devices_of(n)
        return sum(cluster.device_types[d.type].speed for d in devs) / len(devs)

    node_pos = {n: i for i, n in enumerate(cluster.nodes)}
    nodes = sorted(cluster.nodes, key=lambda n: (-node_speed(n), node_pos[n]))
    out: List[List[str]] = []
    lo, hi = 0, len(nodes) - 1
    while lo < hi:
        a = [d.id for d in cluster.devices_of(nodes[lo])]
        b = [d.id for d in cluster.devices_of(nodes[hi])]
        per = max(1, size // 2)
        while a or b:
            take_a = min(per, len(a)) if b else min(size, len(a))
            take_b = min(size - take_a, len(b))
            out.append(a[:take_a] + b[:take_b])
            a, b = a[take_a:], b[take_b:]
        lo, hi = lo + 1, hi - 1
    if lo == hi:
        out.extend(_chunks([d.id for d in cluster.devices_of(nodes[lo])], size))
    return out


def form_virtual_workers(cluster: ClusterSpec, policy: str, vw_size: Optional[int] = None) -> List[List[str]]:
    """The VWs (lists of device ids) of ``policy`` in NP, ED, HD."""
    p = policy.upper()
    if vw_size is not None and vw_size < 1:
        raise ValueError(f"formation: vw_size must be >= 1, got {vw_size}")
    if p == "NP":
        return form_np(cluster, vw_size)
    if p == "ED":
        return form_ed(cluster, vw_size)
    if p == "HD":
        return form_hd(cluster, vw_size)
    raise ValueError(f"formation: unknown policy {policy!r} (known: {', '.join(POLICIES)}, auto)")
