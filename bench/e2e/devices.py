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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

from model import ModelSpec, build_layers, synthetic_batches


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


def measure_host_layers(spec: ModelSpec, repeats: int = 10) -> Tuple[List[float], List[float]]:
    """Median forward and backward seconds of each layer on this host, one thread, one minibatch."""
    torch.set_num_threads(1)
    layers = build_layers(spec)
    x, _ = synthetic_batches(spec, 1, spec.minibatch)[0]
    fwd, bwd = [], []
    for layer in layers:
        xin = x.detach().requires_grad_(True)
        fs, bs = [], []
        for r in range(repeats + 2):
            t0 = time.perf_counter()
            y = layer(xin)
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            t2 = time.perf_counter()
            if r >= 2:
                fs.append(t1 - t0)
                bs.append(t2 - t1)
        fwd.append(sorted(fs)[len(fs) // 2])
        bwd.append(sorted(bs)[len(bs) // 2])
        x = y.detach()
    return fwd, bwd


def standin_device_model(spec: ModelSpec, slowdown: Dict[str, float], devices: List[Tuple[str, str]]) -> DeviceModel:
    """Device types derived from the measured host by a speed ratio (type time = host time x slowdown)."""
    hf, hb = measure_host_layers(spec)
    return DeviceModel(devices=devices, minibatch=spec.minibatch, source="bench stand-in profile",
                       fwd={t: [s * v for v in hf] for t, s in slowdown.items()},
                       bwd={t: [s * v for v in hb] for t, s in slowdown.items()},
                       host_fwd=hf, host_bwd=hb)


# Stand-in cluster: 6 devices of 3 emulated types, 2 of each, on 3 "nodes".
STANDIN_SLOWDOWN = {"emu_fast": 6.0, "emu_mid": 10.0, "emu_slow": 16.0}
STANDIN_DEVICES = [("n0.g0", "emu_fast"), ("n0.g1", "emu_fast"), ("n1.g0", "emu_mid"),
                   ("n1.g1", "emu_mid"), ("n2.g0", "emu_slow"), ("n2.g1", "emu_slow")]
