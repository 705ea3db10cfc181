"""The run configuration every worker process reads: model sizes, step counts, batch sizes, paths.

The entry writes one ``RunConfig`` as JSON next to the device model; each worker is started as
``python <worker>.py <config.json> <result.json>`` and rank 0 writes the result file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from model import ModelSpec


@dataclass
class RunConfig:
    spec: ModelSpec
    device_model: str            # path of the DeviceModel JSON
    global_batch: int            # samples per synchronous step of DDP and of the pipelining baseline
    microbatches: int            # pipelining: micro-batches (each one minibatch) per step
    pp_schedule: str = "1f1b"    # "1f1b" or "gpipe"
    warmup: int = 2              # steps not timed
    steps: int = 6               # steps timed
    extra: dict = field(default_factory=dict)   # per-system settings (hetpipe: nm, d, waves, plan path)

    def save(self, path: Path) -> None:
        d = asdict(self)
        Path(path).write_text(json.dumps(d, indent=1))

    @classmethod
    def load(cls, path: Path) -> "RunConfig":
        d = json.loads(Path(path).read_text())
        d["spec"] = ModelSpec(**d["spec"])
        return cls(**d)


def write_result(path: Path, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=1))
