"""What the torch.distributed baselines (DDP, pipelining) share: the per-step budget and snapshot
decision, and the loop over a launch's jobs.

Contract: every rank of the launch calls :func:`main` with its ``train(job, rank, world, dm)``, which
builds its model, calls :meth:`StepClock.start` and then :meth:`StepClock.after_step` after every
optimizer step, in the same order on every rank (each is a collective).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from config import write_result
from devices import DeviceModel
from job import Job, load_jobs
from mpi_env import run_gloo


class StepClock:
    """Rank 0 decides after each step whether the budget is spent and whether the weights are due for a
    snapshot; one broadcast of the two flags tells every rank, so all stop (and record) at the same step."""

    def __init__(self, job: Job, rank: int) -> None:
        self.job, self.rank = job, rank
        self.flags = torch.zeros(2)
        self.t0 = 0.0
        self.last_snap = 0.0

    def start(self) -> None:
        dist.barrier()
        self.t0 = time.perf_counter()

    def after_step(self) -> Tuple[float, bool, bool]:
        """(seconds since start on this rank, budget spent, snapshot due)."""
        now = time.perf_counter() - self.t0
        if self.rank == 0:
            self.flags[0] = float(now >= self.job.budget_s)
            self.flags[1] = float(now - self.last_snap >= self.job.snapshot_every_s or bool(self.flags[0]))
        dist.broadcast(self.flags, 0)
        snap = bool(self.flags[1])
        if snap:
            self.last_snap = now
        return now, bool(self.flags[0]), snap


def main(train: Callable[[Job, int, int, DeviceModel], Optional[dict]], name: str, jobs_path: str,
         out_path: str) -> None:
    """Run every job of ``jobs_path`` in this launch; rank 0 writes ``{"runs": [...]}`` to ``out_path``."""
    jobs: List[Job] = load_jobs(jobs_path)

    def work(rank: int, world: int) -> None:
        dm = DeviceModel.load(jobs[0].device_model)
        devices = jobs[0].devices or range(len(dm.devices))
        if world != len(devices) or any(list(j.devices) != list(jobs[0].devices) for j in jobs):
            raise SystemExit(f"{name}: {world} ranks for devices {list(devices)} (every job of a launch on the same ones)")
        runs = [train(job, rank, world, dm) for job in jobs]
        if rank == 0:
            write_result(out_path, {"runs": runs})

    run_gloo(work)
