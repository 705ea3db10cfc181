"""Cluster specs: device types, devices on nodes, and the links between them.

File format (JSON; a preset name, a path or an equivalent dict are accepted by :func:`load_cluster`)::

    {
      "name": "hetpipe-testbed",
      "emulated": false,                      # devices are emulated on the host CPU (optional)
      "device_types": {
        "titan_v": {"memory_bytes": 12884901888, "peak_flops": 14.9e12},
        "emu_slow": {"memory_bytes": 268435456, "speed": 0.0625}
      },
      "nodes": [
        {"name": "n0", "devices": ["titan_v", "titan_v"]},      # one entry per device, by type
        {"name": "n1", "type": "emu_slow", "count": 2}          # or a type and a count
      ],
      "intra_node": {"bandwidth": 15.75e9, "latency": 1e-5},    # bytes/s and seconds
      "inter_node": {"bandwidth": 7e9, "latency": 5e-6}
    }

Device ``j`` of node ``n`` has the id ``"<n>.g<j>"``. A device type's ``speed`` is relative compute
speed: for real GPUs it defaults to the peak FP32 FLOP/s in TFLOP/s (so ratios of speeds are ratios
of peak rates); for emulated types it is the fraction of the host CPU's measured speed (0.125 means
eight times slower than the host). Only ratios of speeds are ever used.

Speed per precision: ``speed`` and ``peak_flops`` are those of an fp32 run. A bf16 or fp16 run is
modelled at the type's half-precision peak (:meth:`DeviceType.peak_for`): ``half_flops`` in the JSON
(``{"bf16": 312e12, "fp16": 312e12}``, dense FLOP/s), else the published figure of
:mod:`hetpipe.plan.peaks` for the type's ``hardware`` or name, else its FP32 peak; its speed scales
by the same ratio (:meth:`DeviceType.speed_for`). An fp32 run whose matmuls may use TF32 is read at
"tf32" (:func:`hetpipe.plan.precision.speed_precision`): ``half_flops["tf32"]``, else the published
TF32 figure. A type without ``peak_flops`` (emulated, or given by ``speed`` alone) keeps its speed for
every precision. :meth:`ClusterSpec.at_precision` is the cluster as the planner sees it for one
precision.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple, Union

from hetpipe.plan.peaks import lookup
from hetpipe.plan.precision import HALF_DTYPE, check_speed_precision
from hetpipe.util.files import read_text

PRESET_DIR = Path(__file__).resolve().parents[1] / "data" / "clusters"


@dataclass(frozen=True)
class DeviceType:
    """A kind of device: memory capacity and relative speed (see the module docstring)."""

    name: str
    memory_bytes: int
    speed: float
    peak_flops: float = 0.0     # FLOP/s, 0 when unknown (emulated types)
    hardware: str = ""          # what the device reported itself as (discovered clusters)
    # Dense FLOP/s of a "bf16" / "fp16" run where the cluster JSON gives it (see the module docstring).
    half_flops: Dict[str, float] = field(default_factory=dict)

    def peak_for(self, precision: str) -> float:
        """Peak FLOP/s of a run of ``precision``: ``peak_flops`` for "fp32"; for a half type (or "tf32")
        its ``half_flops`` entry, else the published ratio of :mod:`hetpipe.plan.peaks` (by ``hardware``,
        then name) applied to ``peak_flops``, else ``peak_flops``. 0 when ``peak_flops`` is."""
        return self.peak_flops * self._ratio(precision)

    def speed_for(self, precision: str) -> float:
        """Relative speed of a run of ``precision``: ``speed`` scaled by ``peak_for(precision) /
        peak_flops``; ``speed`` itself for "fp32" and for a type without ``peak_flops``."""
        return self.speed * self._ratio(precision)

    def _ratio(self, precision: str) -> float:
        check_speed_precision(precision, f"device type {self.name!r}")
        if precision == "fp32" or not self.peak_flops:
            return 1.0
        if precision in self.half_flops:
            return self.half_flops[precision] / self.peak_flops
        for name in (self.hardware, self.name):
            published = lookup(name) if name else None
            if published is not None:
                return getattr(published, precision) / published.fp32
        return 1.0


@dataclass(frozen=True)
class Device:
    id: str
    type: str
    node: str


@dataclass(frozen=True)
class Link:
    bandwidth: float            # bytes per second
    latency: float = 0.0        # seconds per message

    def time(self, nbytes: float) -> float:
        """Seconds to move one message of ``nbytes`` (0 for an empty message)."""
        return 0.0 if nbytes <= 0 else self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    device_types: Dict[str, DeviceType]
    devices: Tuple[Device, ...]
    intra_node: Link
    inter_node: Link
    emulated: bool = False
    # The kind of the link between two devices (``"a|b"`` -> nvlink, pcie) where discovery read it;
    # informational: the planner models one intra-node and one inter-node link.
    links: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError(f"cluster {self.name!r}: no devices")
        seen = set()
        for d in self.devices:
            if d.type not in self.device_types:
                raise ValueError(f"cluster {self.name!r}: device {d.id} has unknown device type {d.type!r} "
                                 f"(known: {sorted(self.device_types)})")
            if d.id in seen:
                raise ValueError(f"cluster {self.name!r}: duplicate device id {d.id}")
            seen.add(d.id)

    @property
    def nodes(self) -> Tuple[str, ...]:
        """Node names in the order their first device appears."""
        return tuple(dict.fromkeys(d.node for d in self.devices))

    def devices_of(self, node: str) -> Tuple[Device, ...]:
        return tuple(d for d in self.devices if d.node == node)

    def device(self, device_id: str) -> Device:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise ValueError(f"cluster {self.name!r}: unknown device {device_id!r}")

    def at_precision(self, precision: str) -> "ClusterSpec":
        """The cluster as the planner sees it for a run of ``precision``: each type's ``speed`` and
        ``peak_flops`` are :meth:`DeviceType.speed_for` and :meth:`DeviceType.peak_for` of it (and
        stay so when asked again for ``precision``). ``self`` for "fp32". A view for planning, not a
        spec to save: its "fp32" figures are the half ones."""
        check_speed_precision(precision, f"cluster {self.name!r}")
        if precision == "fp32":
            return self
        types = {}
        for t, dt in self.device_types.items():
            peak = dt.peak_for(precision)
            types[t] = replace(dt, speed=dt.speed_for(precision), peak_flops=peak,
                               half_flops={precision: peak} if peak else {})
        return replace(self, device_types=types)

    def node_link(self, node_a: str, node_b: str) -> Link:
        return self.intra_node if node_a == node_b else self.inter_node

    def link(self, dev_a: Union[str, Device], dev_b: Union[str, Device]) -> Tuple[float, float]:
        """``(bandwidth B/s, latency s)`` of the link between two devices (intra- or inter-node)."""
        a = self.device(dev_a) if isinstance(dev_a, str) else dev_a
        b = self.device(dev_b) if isinstance(dev_b, str) else dev_b
        lk = self.node_link(a.node, b.node)
        return lk.bandwidth, lk.latency

    # --- data ------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        types = {}
        for t in self.device_types.values():
            types[t.name] = {"memory_bytes": t.memory_bytes, "speed": t.speed}
            if t.peak_flops:
                types[t.name]["peak_flops"] = t.peak_flops
            if t.hardware:
                types[t.name]["hardware"] = t.hardware
            if t.half_flops:
                types[t.name]["half_flops"] = dict(t.half_flops)
        out = {
            "name": self.name, "emulated": self.emulated, "device_types": types,
            "nodes": [{"name": n, "devices": [d.type for d in self.devices_of(n)]} for n in self.nodes],
            "intra_node": {"bandwidth": self.intra_node.bandwidth, "latency": self.intra_node.latency},
            "inter_node": {"bandwidth": self.inter_node.bandwidth, "latency": self.inter_node.latency},
        }
        if self.links:
            out["links"] = dict(self.links)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _positive(where: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _link(name: str, key: str, data: Any) -> Link:
    if not isinstance(data, Mapping):
        raise ValueError(f"cluster {name!r}: {key} must be an object with bandwidth and latency, got {data!r}")
    if "bandwidth" not in data:
        raise ValueError(f"cluster {name!r}: {key} has no bandwidth")
    return Link(_positive(f"cluster {name!r}: {key}.bandwidth", data["bandwidth"]),
                _positive(f"cluster {name!r}: {key}.latency", data.get("latency", 0.0), allow_zero=True))


def _device_type(cname: str, tname: str, data: Any) -> DeviceType:
    where = f"cluster {cname!r}: device type {tname!r}"
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be an object, got {data!r}")
    unknown = set(data) - {"memory_bytes", "speed", "peak_flops", "hardware", "half_flops"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    if "memory_bytes" not in data:
        raise ValueError(f"{where}: no memory_bytes")
    mem = _positive(f"{where}: memory_bytes", data["memory_bytes"])
    flops = _positive(f"{where}: peak_flops", data.get("peak_flops", 0.0), allow_zero=True)
    if "speed" in data:
        speed = _positive(f"{where}: speed", data["speed"])
    elif flops:
        speed = flops / 1e12
    else:
        raise ValueError(f"{where}: needs speed or peak_flops")
    if mem < 1:
        raise ValueError(f"{where}: memory_bytes must be at least 1 byte, got {data['memory_bytes']!r}")
    half = data.get("half_flops", {})
    if not isinstance(half, Mapping) or set(half) - set(HALF_DTYPE) - {"tf32"}:
        raise ValueError(f"{where}: half_flops must be an object keyed by {', '.join(HALF_DTYPE)} or tf32, "
                         f"got {half!r}")
    if half and not flops:
        raise ValueError(f"{where}: half_flops needs peak_flops (the fp32 figure its speed scales from)")
    half = {p: _positive(f"{where}: half_flops.{p}", v) for p, v in half.items()}
    return DeviceType(tname, int(mem), speed, flops, str(data.get("hardware", "")), half)


def cluster_from_dict(data: Any) -> ClusterSpec:
    """Build and validate a :class:`ClusterSpec` from the file format of the module docstring."""
    if not isinstance(data, Mapping):
        raise ValueError(f"cluster: a spec must be a JSON object, got {type(data).__name__}")
    name = str(data.get("name", "cluster"))
    unknown = set(data) - {"name", "emulated", "device_types", "nodes", "intra_node", "inter_node", "description",
                           "links"}
    if unknown:
        raise ValueError(f"cluster {name!r}: unknown field(s) {sorted(unknown)}")
    for key in ("device_types", "nodes", "intra_node", "inter_node"):
        if key not in data:
            raise ValueError(f"cluster {name!r}: missing {key}")
    if not isinstance(data["device_types"], Mapping):
        raise ValueError(f"cluster {name!r}: device_types must be an object keyed by type name")
    types = {t: _device_type(name, t, v) for t, v in data["device_types"].items()}
    nodes = data["nodes"]
    if not isinstance(nodes, list) or not nodes:
        raise ValueError(f"cluster {name!r}: no nodes (empty cluster)")
    devices: List[Device] = []
    for i, node in enumerate(nodes):
        if not isinstance(node, Mapping):
            raise ValueError(f"cluster {name!r}: node {i} must be an object, got {node!r}")
        nname = str(node.get("name", f"n{i}"))
        if "devices" in node:
            kinds = node["devices"]
            if not isinstance(kinds, list):
                raise ValueError(f"cluster {name!r}: node {nname}: devices must be a list of type names")
        elif "type" in node:
            count = node.get("count", 1)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"cluster {name!r}: node {nname}: count must be an integer >= 1, got {count!r}")
            kinds = [node["type"]] * count
        else:
            raise ValueError(f"cluster {name!r}: node {nname} has neither devices nor type")
        for j, t in enumerate(kinds):
            if t not in types:
                raise ValueError(f"cluster {name!r}: device {nname}.g{j} has unknown device type {t!r} "
                                 f"(known: {sorted(types)})")
            devices.append(Device(f"{nname}.g{j}", t, nname))
    if not devices:
        raise ValueError(f"cluster {name!r}: no devices (empty cluster)")
    links = data.get("links", {})
    if not isinstance(links, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in links.items()):
        raise ValueError(f"cluster {name!r}: links must be an object mapping \"a|b\" to a link kind, got {links!r}")
    return ClusterSpec(name, types, tuple(devices), _link(name, "intra_node", data["intra_node"]),
                       _link(name, "inter_node", data["inter_node"]), bool(data.get("emulated", False)), dict(links))


def presets() -> List[str]:
    """Names of the shipped cluster presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_cluster(spec: Union[str, Path, Mapping, ClusterSpec]) -> ClusterSpec:
    """A cluster from a preset name (``hetpipe-testbed``, ``cpu-emulated``, ``cpu-emulated-6``),
    a JSON file path, a dict in the file format, or a :class:`ClusterSpec` (returned as is)."""
    if isinstance(spec, ClusterSpec):
        return spec
    if isinstance(spec, Mapping):
        return cluster_from_dict(spec)
    text = str(spec)
    path = Path(text)
    if not path.suffix and (PRESET_DIR / f"{text}.json").is_file():
        path = PRESET_DIR / f"{text}.json"
    elif not path.is_file():
        if path.suffix:
            raise ValueError(f"cluster: cannot read {text}: no such file")
        raise ValueError(f"cluster: {text!r} is neither a preset ({', '.join(presets())}) nor a file")
    if path.suffix in (".yaml", ".yml"):
        raise ValueError(f"cluster: {path}: YAML is not supported, write the spec as JSON")
    text = read_text(path, "cluster")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"cluster: {path} is not valid JSON: {e}") from e
    return cluster_from_dict(data)
