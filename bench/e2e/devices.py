"""The emulated device model shared by every system: the devices, their types, per-layer times.

A ``DeviceModel`` says, for each device type, the forward and backward seconds of each layer on one
minibatch of ``minibatch`` samples. Every system in the benchmark (hetpipe, DDP, pipelining, the
standalone limit) pads its computation to these same numbers; the model is built once by the entry
and handed to every rank as a JSON file.

Per-sample-linear assumption: a rank that processes ``n`` samples of a layer takes
``n / minibatch`` times the profiled minibatch time (``scaled_times``). This holds for the
compute-bound MLP layers of the benchmark at these sizes; it is the only extrapolation made.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple


@dataclass
class DeviceModel:
    """Devices (id, type) in cluster order and, per type, per-layer minibatch times in seconds."""

    devices: List[Tuple[str, str]]
    fwd: Dict[str, List[float]]
    bwd: Dict[str, List[float]]
    minibatch: int
    source: str                                   # where the numbers came from, for the table header
    host_fwd: List[float] = field(default_factory=list)   # measured host times the types derive from
    host_bwd: List[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.devices = [tuple(d) for d in self.devices]
        for _, t in self.devices:
            if t not in self.fwd or t not in self.bwd:
                raise ValueError(f"device model: type {t!r} has no profile (types: {sorted(self.fwd)})")

    @property
    def types(self) -> List[str]:
        return sorted({t for _, t in self.devices}, key=lambda t: sum(self.fwd[t]) + sum(self.bwd[t]))

    def minibatch_time(self, device_type: str) -> float:
        """Seconds of forward plus backward of the whole model on one minibatch."""
        return sum(self.fwd[device_type]) + sum(self.bwd[device_type])

    def standalone_throughput(self, device_type: str) -> float:
        """Samples/s the device model gives one device of this type training the whole model alone."""
        return self.minibatch / self.minibatch_time(device_type)

    def scaled_times(self, device_type: str, layers: Sequence[int], samples: int) -> Tuple[float, float]:
        """(forward, backward) seconds of ``layers`` on ``samples`` samples (per-sample linear)."""
        f = samples / self.minibatch
        return (f * sum(self.fwd[device_type][i] for i in layers),
                f * sum(self.bwd[device_type][i] for i in layers))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "DeviceModel":
        return cls(**json.loads(Path(path).read_text()))
