"""The cluster a world of ranks runs on: built from what every rank reports (discovery), or a given
cluster matched onto those ranks; and which rank runs each part of a plan made for it.

Contract: every function here is pure (no MPI, no torch). The facts are
:func:`hetpipe.job.inventory.rank_facts` of every world rank, in rank order.

A rank *holds* a device when it emulates a type (``HETPIPE_EMULATE``) or when its position among the
ranks of its host is below the number of GPUs that host shows (rank ``k`` of a host holds GPU ``k``).
Every other rank is a *PS slot*: it can serve a parameter-server shard on its host, which is how
hosts without a GPU take part. A discovered node is a host, named as the host is, and device ``j``
of a node has the id ``<host>.g<j>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hetpipe.plan.cluster import ClusterSpec, Device, DeviceType, Link, cluster_from_dict
from hetpipe.plan.peaks import PEAKS, lookup
from hetpipe.util.errors import HetpipeError

# Link defaults by kind (bytes/s, s). Discovery reads the kind of each link, not its speed: these
# are typical figures (NVLink 3 per direction, PCIe 4 x16 in practice, 100 Gb/s Ethernet/IB), and
# the saved cluster JSON is where a user puts measured ones.
LINKS = {"nvlink": Link(100e9, 5e-6), "pcie": Link(12e9, 1e-5), "network": Link(10e9, 2e-5),
         "emulated-host": Link(2.0e9, 2e-5), "emulated-network": Link(2.5e8, 1e-4)}

# Peak dense FP32 FLOP/s of GPUs by a word of their name: a prior for the speed of a type before it
# is profiled (and the analytic presets' input); the profile measured on the type replaces it. The
# half-precision figures are in hetpipe.plan.peaks, which the cluster reads by the type's hardware.
PEAK_FP32 = {key: peak.fp32 for key, peak in PEAKS.items()}


class DiscoveryError(HetpipeError, ValueError):
    """The world's ranks do not describe a usable cluster, or do not fit a cluster or plan."""


@dataclass(frozen=True)
class Holder:
    """What world rank ``rank`` holds: a device of the cluster (``device`` its id; ``gpu`` its CUDA index
    on the host, None when emulated) or nothing (``device`` None: a PS slot on ``host``)."""

    rank: int
    host: str
    device: Optional[str] = None
    type: Optional[str] = None
    gpu: Optional[int] = None

    def describe(self) -> str:
        held = f"device {self.device} ({self.type})" if self.device else "no device"
        return f"rank {self.rank} on host {self.host}, {held}"


@dataclass(frozen=True)
class Discovery:
    """A cluster and the rank that holds each of its devices; ``how`` says where it came from."""

    cluster: ClusterSpec
    holders: Tuple[Holder, ...]
    how: str
    links: Dict[str, str] = field(default_factory=dict)

    def holder_of(self, device_id: str) -> Holder:
        for h in self.holders:
            if h.device == device_id:
                return h
        raise DiscoveryError(f"device {device_id} is held by no rank")

    def ps_slots(self) -> List[Holder]:
        return [h for h in self.holders if h.device is None]

    def type_holders(self) -> Dict[str, List[int]]:
        """Device type -> the ranks holding one, lowest first; types no rank holds are absent."""
        out: Dict[str, List[int]] = {}
        for h in self.holders:
            if h.type is not None:
                out.setdefault(h.type, []).append(h.rank)
        return out

    def table(self) -> str:
        """One line per rank: host, device, type, how it is known."""
        lines = [f"cluster {self.cluster.name!r} ({self.how}): {len(self.cluster.devices)} device(s) on "
                 f"{len(self.cluster.nodes)} node(s), {len(self.ps_slots())} PS slot(s)"]
        for h in self.holders:
            where = (f"cuda:{h.gpu}" if h.gpu is not None else "emulated") if h.device else "PS slot"
            lines.append(f"  rank {h.rank:<3} {h.host:<20} {h.device or '-':<24} {h.type or '-':<18} {where}")
        for pair, kind in sorted(self.links.items()):
            lines.append(f"  link {pair}: {kind}")
        return "\n".join(lines)


def gpu_type_name(hardware: str) -> str:
    """A device type name from a GPU's name: ``NVIDIA A100-SXM4-40GB`` -> ``a100_sxm4_40gb``."""
    text = re.sub(r"^(nvidia|amd)\s+", "", hardware.strip().lower())
    text = re.sub(r"^(geforce|quadro|tesla)\s+", "", text)
    return re.sub(r"[^a-z0-9]+", "_", text).strip("_") or "gpu"


def peak_fp32(hardware: str) -> float:
    """The peak FP32 FLOP/s of :data:`PEAK_FP32` whose key appears in ``hardware``'s name, else 0."""
    peak = lookup(hardware)
    return peak.fp32 if peak is not None else 0.0


def _check_errors(facts: Sequence[Mapping[str, Any]]) -> None:
    bad = [f"rank {f['rank']} ({f['host']}): {f['error']}" for f in facts if f.get("error")]
    if bad:
        raise DiscoveryError("; ".join(bad))


def _held(facts: Sequence[Mapping[str, Any]]) -> List[Tuple[Mapping[str, Any], Optional[Dict[str, Any]], int]]:
    """Per rank: its facts, what it holds (an emulated type dict, a GPU dict, or None) and its
    position among the device-holding ranks of its host."""
    seen: Dict[str, int] = {}
    out = []
    for f in facts:
        k = seen.get(f["host"], 0)
        emu = f.get("emulate")
        if emu:
            held: Optional[Dict[str, Any]] = {"emulated": True, **emu}
        elif emu is None and k < len(f.get("gpus", [])):
            held = {"emulated": False, **f["gpus"][k], "gpu": k}
        else:
            held = None
        if held is not None:
            seen[f["host"]] = k + 1
        out.append((f, held, k))
    return out


def discover(facts: Sequence[Mapping[str, Any]], name: str = "discovered") -> Discovery:
    """The cluster the ranks of ``facts`` hold (see the module docstring)."""
    _check_errors(facts)
    held = _held(facts)
    if not any(h for _, h, _ in held):
        raise DiscoveryError(f"discovery: none of the {len(facts)} rank(s) holds a device: no rank sees a GPU "
                             f"(nvidia-smi) and none sets HETPIPE_EMULATE")
    types: Dict[str, Dict[str, Any]] = {}
    nodes: Dict[str, List[str]] = {}
    holders: List[Holder] = []
    links: Dict[str, str] = {}
    emulated = real = False
    for f, h, _ in held:
        host = f["host"]
        if h is None:
            holders.append(Holder(f["rank"], host))
            continue
        if h["emulated"]:
            emulated = True
            tname = h["name"]
            entry = {"memory_bytes": h["memory_bytes"], "speed": h["speed"]}
        else:
            real = True
            tname = gpu_type_name(h["name"])
            flops = peak_fp32(h["name"])
            entry = {"memory_bytes": h["memory_bytes"], "hardware": f"{h['name']} (compute capability "
                     f"{h['compute_capability']})"}
            entry.update({"peak_flops": flops} if flops else {"speed": 1.0})
        if tname in types and types[tname]["memory_bytes"] != entry["memory_bytes"]:
            tname = f"{tname}_{entry['memory_bytes'] >> 20}m"
        types.setdefault(tname, entry)
        devs = nodes.setdefault(host, [])
        device = f"{host}.g{len(devs)}"
        devs.append(tname)
        holders.append(Holder(f["rank"], host, device, tname, None if h["emulated"] else h["gpu"]))
    if emulated and real:
        raise DiscoveryError("discovery: some ranks emulate a device type (HETPIPE_EMULATE) and others hold GPUs: "
                             f"{_mixed(held)}; emulate all or none")
    for f, h, _ in held:
        by_gpu = {x.gpu: x.device for x in holders if x.host == f["host"] and x.gpu is not None}
        for a, b, kind in f.get("links", []):
            if a in by_gpu and b in by_gpu:
                links[f"{by_gpu[a]}|{by_gpu[b]}"] = kind
    same_host = _same_host_kind(nodes, links, emulated)
    data = {"name": name, "emulated": emulated, "device_types": types,
            "description": "discovered: each rank's host, GPU (nvidia-smi) or emulated type (HETPIPE_EMULATE); "
                           "link bandwidths are defaults by link kind, not measured",
            "nodes": [{"name": host, "devices": devs} for host, devs in nodes.items()],
            "intra_node": _link_dict(LINKS[same_host]),
            "inter_node": _link_dict(LINKS["emulated-network" if emulated else "network"]),
            "links": links}
    return Discovery(cluster_from_dict(data), tuple(holders), "discovered", links)


def _mixed(held) -> str:
    return ", ".join(f"rank {f['rank']} {'emulates' if h['emulated'] else 'holds'} {h['name']}"
                     for f, h, _ in held if h)


def _same_host_kind(nodes: Mapping[str, List[str]], links: Mapping[str, str], emulated: bool) -> str:
    """The slowest link between two devices of one host (the planner models one intra-node link)."""
    if emulated:
        return "emulated-host"
    pairs = sum(len(d) * (len(d) - 1) // 2 for d in nodes.values())
    if pairs and len(links) == pairs and all(k == "nvlink" for k in links.values()):
        return "nvlink"
    return "pcie"


def _link_dict(link: Link) -> Dict[str, float]:
    return {"bandwidth": link.bandwidth, "latency": link.latency}


def match(facts: Sequence[Mapping[str, Any]], cluster: ClusterSpec) -> Discovery:
    """``cluster``'s devices given to the ranks of ``facts``: node ``n``'s devices, in order, to the
    device-holding ranks on host ``n``, in rank order. Ranks left over, and ranks on hosts that are
    no node of the cluster, are PS slots. Raises naming the node, rank or device that does not fit."""
    _check_errors(facts)
    held = _held(facts)
    hosts = sorted({f["host"] for f in facts})
    holders: List[Optional[Holder]] = [None] * len(facts)
    for node in cluster.nodes:
        devices = cluster.devices_of(node)
        ranks = [(f, h) for f, h, _ in held if f["host"] == node and h is not None]
        if len(ranks) < len(devices):
            raise DiscoveryError(
                f"cluster {cluster.name!r}: node {node} has {len(devices)} device(s) but "
                f"{len(ranks)} rank(s) on host {node} hold one (hosts of the world: {', '.join(hosts)}); "
                f"start one rank per device there, or name the node as its host")
        for dev, (f, h) in zip(devices, ranks):
            _check_type(cluster, dev, f, h)
            holders[f["rank"]] = Holder(f["rank"], node, dev.id, dev.type, None if h["emulated"] else h["gpu"])
    final = tuple(h if h is not None else Holder(f["rank"], f["host"]) for h, f in zip(holders, facts))
    return Discovery(cluster, final, "given, matched to the ranks by host")


def _check_type(cluster: ClusterSpec, dev: Device, f: Mapping[str, Any], h: Mapping[str, Any]) -> None:
    want: DeviceType = cluster.device_types[dev.type]
    if h["emulated"]:
        if h["name"] != dev.type:
            raise DiscoveryError(f"rank {f['rank']} on host {f['host']} emulates {h['name']} but cluster "
                                 f"{cluster.name!r} has {dev.type} at {dev.id}")
    elif h["memory_bytes"] and h["memory_bytes"] < want.memory_bytes:
        raise DiscoveryError(f"rank {f['rank']} on host {f['host']}: GPU {h['gpu']} ({h['name']}) has "
                             f"{h['memory_bytes']} bytes but cluster {cluster.name!r} gives {dev.id} "
                             f"({dev.type}) {want.memory_bytes}")


def assign_ranks(plan: Any, discovery: Discovery) -> List[int]:
    """The world rank that runs each rank of ``plan`` (its stages in order, then its PS shards): the
    rank holding each stage's device, then a PS slot on each shard's node. Every world rank gets a part."""
    world = len(discovery.holders)
    order: List[int] = []
    for vw in plan.virtual_workers:
        for s, st in enumerate(vw.stages):
            try:
                order.append(discovery.holder_of(st.device).rank)
            except DiscoveryError:
                raise DiscoveryError(f"the plan puts vw {vw.index} stage {s} on {st.device}, which no rank "
                                     f"holds") from None
    free: Dict[str, List[int]] = {}
    for h in discovery.ps_slots():
        free.setdefault(h.host, []).append(h.rank)
    for sh in plan.ps_shards:
        slots = free.get(sh.node, [])
        if not slots:
            raise DiscoveryError(
                f"PS shard {sh.index} belongs on node {sh.node} but no rank there is free to serve it: start "
                f"one more rank on {sh.node} that holds no device (HETPIPE_EMULATE=ps, or beyond its GPU count)")
        order.append(slots.pop(0))
    idle = sorted(set(range(world)) - set(order))
    if idle:
        raise DiscoveryError(
            f"the plan needs {len(order)} ranks but {world} were started; without a part: "
            + "; ".join(discovery.holders[r].describe() for r in idle)
            + (f" (left out by the planner: {plan.meta['left_out']})" if plan.meta.get("left_out") else "")
            + (f" (not used by the plan: {plan.meta['not_used']['text']}: start the job without them)"
               if plan.meta.get("not_used") else ""))
    return order
