"""hetpipe: the planned Plan under WSP (staleness D, the job's aggregation rule and outer optimizer), emulated devices.

Started as ``mpiexec -n <plan ranks> python train_hetpipe.py job.json result.json``. The model of a
HetPipe run is the parameter servers' global weights ``W_g``; each PS shard records its layers of
``W_g`` right after it applies a wave ``g`` that is a multiple of ``job.snapshot_waves`` (and the
last wave), with the time, through a ``ShardServer`` subclass installed in this process only (the
runtime's behaviour is unchanged; the copy is a few hundred microseconds on the shard rank, which
idles between pushes). The subclass steps the Python shard, so the shards run the Python data plane
(``HETPIPE_PS_PLANE=python``; the core plane applies waves on its own threads, between two steps),
as in the recorded results. Rank 0 joins the shards' snapshots by wave. The run is a fixed number of
minibatches (``job.minibatches``), sized by the entry to outlast the time budget.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Dict, List, Optional

import torch
from mpi4py import MPI

import hetpipe.ps.serve as shard_serve
import hetpipe.run.build as runtime_build
import hetpipe_worker as e2e
import snapshots
from config import write_result
from hetpipe.job.roles import role_of
from hetpipe.plan.types import Plan
from hetpipe.ps.server import ShardServer
from hetpipe.ps.core_plane import PLANE_ENV
from hetpipe.run.trainer import Trainer
from job import Job, load_jobs
from task import MinibatchStream, build_layers, corpus, loss_fn, optimizer
from hetpipe import PSRule, Reporting, Runtime


class RecordingServer(ShardServer):
    """The runtime's ShardServer, recording ``W_g`` of its layers at the waves the job asks for."""

    instances: List["RecordingServer"] = []
    every = 1
    last_wave = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.snaps: Dict[int, snapshots.Snapshot] = {0: (0.0, self._copy())}
        RecordingServer.instances.append(self)

    def _copy(self) -> Dict[int, "object"]:
        return {l: w.copy() for l, w in self.state.W.items()}

    def step(self) -> bool:
        progressed = super().step()
        g = self.state.applied
        if g not in self.snaps and (g % self.every == 0 or g == self.last_wave):
            self.snaps[g] = (time.perf_counter() - self.t0, self._copy())
        return progressed


def train(job: Job, comm, rank: int) -> Optional[dict]:
    """One run; returns its result on rank 0 (None elsewhere) after writing its snapshots."""
    e2e.RecordingPacer.instances.clear()
    RecordingServer.instances.clear()
    plan = dataclasses.replace(Plan.load(job.plan), d=job.d)
    nvw = len(plan.virtual_workers)
    RecordingServer.every = job.snapshot_waves
    RecordingServer.last_wave = math.ceil(job.minibatches / plan.minibatches_per_wave)
    text, _, _ = corpus(job.task)
    data = MinibatchStream(text, job.task, job.seed, count=job.minibatches)
    ps = {"aggregate": job.aggregate}
    rule = job.aggregate
    if job.outer != "sgd" or job.outer_lr != 1.0:
        ps.update(outer=job.outer, outer_lr=job.outer_lr, outer_momentum=job.outer_momentum)
        rule += f" + {job.outer} lr {job.outer_lr:g}" + (f" momentum {job.outer_momentum:g}"
                                                         if job.outer != "sgd" else "")
    if job.outer == "delayed-nesterov":
        ps.update(outer_delay=job.outer_delay)
        rule += f" delay {job.outer_delay or 'N'}"
    if job.outer_gain != "none":
        ps.update(outer_gain=job.outer_gain)
        rule += f" + {job.outer_gain} gain"
    if job.outer_staleness != "none":
        ps.update(outer_staleness=job.outer_staleness)
        rule += f" + {job.outer_staleness} staleness"
    result = Trainer(build_layers(job.task, job.seed), loss_fn, lambda p: optimizer(p, job.lr), data, plan=plan,
                     ps=PSRule(**ps), reporting=Reporting(progress=False, record=job.record or None),
                     runtime=Runtime(emulate=True, timeout=job.timeout_s)).fit()
    pacers = e2e.RecordingPacer.instances
    role = role_of(plan, rank)
    mine = {"rank": rank, "role": result.role, "elapsed_s": result.elapsed_s,
            "pad_frac": sum(c.padded_s for c in pacers) / result.elapsed_s,
            "overrun_s": sum(c.overrun_s for c in pacers),
            "snapshots": RecordingServer.instances[-1].snaps if role.kind == "ps" else None}
    if role.kind == "stage":
        st = plan.virtual_workers[role.vw].stages[role.stage]
        mine.update(device=st.device, type=st.device_type, layers=[st.start, st.stop])
    else:
        mine.update(device=f"ps{role.shard}", type="host (PS)")
    ranks = comm.gather(mine, root=0)
    if rank != 0:
        return None
    parts = [r.pop("snapshots") for r in ranks if r["snapshots"] is not None]
    versions = sorted(set.intersection(*(set(p) for p in parts)))  # the version g of each merged snapshot
    snapshots.save(job.snapshots, snapshots.merge(parts))
    for r in ranks:
        r.pop("snapshots", None)
    return {"system": f"hetpipe D={plan.d} {rule}", "samples": result.samples, "snapshot_versions": versions,
            "wall_s": result.elapsed_s, "ranks": ranks, "emulated": result.emulated,
            "train_loss_last": result.final_loss(),
            "note": f"{nvw} VWs x {[len(v.stages) for v in plan.virtual_workers]} stages, "
                    f"Nm={plan.nm if plan.equal_waves else list(plan.wave_minibatches)}, {len(plan.ps_shards)} PS, "
                    f"aggregate {rule}"}


def main(jobs_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    runtime_build.Pacer = e2e.RecordingPacer
    shard_serve.ShardServer = RecordingServer         # what shard_server builds the Python shard with
    os.environ[PLANE_ENV] = "python"
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    runs = [train(job, comm, rank) for job in load_jobs(jobs_path)]
    if rank == 0:
        write_result(out_path, {"runs": runs})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
