"""One training run's configuration, written by the entry as JSON and read by every rank of the run.

Each worker is started as ``python train_<system>.py <jobs.json> <results.json>`` and runs the jobs of
the file one after another in the same processes (one start-up, whose imports cost seconds of CPU
per rank, for several runs); rank 0 writes ``{"runs": [one result per job]}`` and each job's
snapshot file ``job.snapshots``. A job holds what differs between runs (system, seed, learning rate,
staleness, aggregation) and what is shared (task sizes, budget, device model).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List

from task import TaskSpec


@dataclass
class Job:
    system: str                  # a system key of run.py ("ddp", "ddp-fast", "hetero-dp", "pipelining", "hetpipe-...")
    task: TaskSpec
    seed: int                    # model initialisation and the minibatch stream
    lr: float
    budget_s: float              # DDP and pipelining train until this much wall time has passed
    snapshot_every_s: float      # DDP and pipelining: record the weights at the first step end after this interval
    device_model: str            # path of the DeviceModel JSON every system pads to
    snapshots: str               # where rank 0 writes the recorded weights (.npz)
    micro: int = 6               # minibatches per synchronous step of DDP (one per rank) and of pipelining
    plan: str = ""               # hetpipe: plan JSON path
    d: int = 0                   # hetpipe: staleness bound
    aggregate: str = "sum"       # hetpipe: how the PS combines the VWs' wave deltas
    outer: str = "sgd"           # hetpipe: the PS's outer optimizer (sgd with lr 1: the plain rule)
    outer_lr: float = 1.0        # hetpipe: its learning rate
    outer_momentum: float = 0.9  # hetpipe: nesterov's and delayed-nesterov's momentum
    outer_staleness: str = "none"  # hetpipe: how a push's lag decays it ("none", "inverse", "sqrt")
    outer_gain: str = "none"     # hetpipe: "sqrt" divides each push by sqrt(VW count) instead of the aggregate's
    outer_delay: int = 0         # hetpipe: delayed-nesterov's pushes per momentum step (0: the VW count)
    minibatches: int = 0         # hetpipe: minibatches in the run (all VWs)
    snapshot_waves: int = 1      # hetpipe: record the global weights every this many waves
    record: str = ""             # hetpipe: where the run writes its record (pulls, applies), empty: none
    timeout_s: float = 120.0     # hetpipe: seconds a rank may wait for a peer
    devices: List[int] = field(default_factory=list)   # DDP: device index of each rank (empty: rank r on device r)
    windows: List[int] = field(default_factory=list)   # DDP: windows per rank per step (empty: one minibatch each)

def save_jobs(path: Path, jobs: List[Job]) -> None:
    Path(path).write_text(json.dumps([asdict(j) for j in jobs], indent=1))


def load_jobs(path: Path) -> List[Job]:
    return [Job(**{**d, "task": TaskSpec(**d["task"])}) for d in json.loads(Path(path).read_text())]
