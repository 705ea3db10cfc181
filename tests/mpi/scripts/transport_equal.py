"""The torch-p2p backend (gloo between CPU stages) against mpi-host and the single-process replay.

Per configuration: the same plan trained twice under mpiexec, once per forced backend, and replayed
in one process; prints one ``RESULT {json}`` line per configuration (from the plan's rank 0) with
whether the losses, final weights and synced buffers are bitwise equal, each run's reported
transport, and the torch-p2p run's metrics summary.

Usage: mpiexec -n N python transport_equal.py RUNDIR '[{"model": "mlp", "cuts": [3], "nm": 2}, ...]'
Optional keys: ``vws: 2`` (two VWs cut alike), ``copy_stream`` (pushes, pulls and mpi-host payloads
through the copy stream: the core's CPU stream here).
"""

import json
import sys
from pathlib import Path

from mpi4py import MPI

import real_models as rm
from common import cross_entropy, mlp, one_vw_plan, same_outcome, sgd, split_world, synthetic, two_vw_plan
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Reporting, Runtime

MODELS = {"mlp": (mlp, synthetic, cross_entropy), "tied": (rm.tied_mlp, synthetic, rm.tied_loss),
          "pytree": (rm.pytree_model, rm.DictBatches, cross_entropy)}


def plan_of(cfg, num_layers: int):
    """The D = 0 plan of a configuration: one VW cut at ``cuts``, or two VWs cut alike (``vws: 2``)."""
    if cfg.get("vws", 1) == 2:
        return two_vw_plan((cfg["cuts"], cfg["cuts"]), (0.0, 0.0), nm=cfg["nm"], d=0, num_layers=num_layers)
    return one_vw_plan(cfg["cuts"], cfg["nm"], 0, num_layers=num_layers)


def main() -> int:
    ok = True
    run_dir = Path(sys.argv[1])
    for i, cfg in enumerate(json.loads(sys.argv[2])):
        make, data, loss = MODELS[cfg["model"]]
        plan = plan_of(cfg, len(make()))
        sub = split_world(plan.num_ranks)
        if sub is None:
            MPI.COMM_WORLD.Barrier()
            continue
        metrics = run_dir / f"metrics-{i}.jsonl"
        runs = {name: Trainer(make(), loss, sgd(), data(), plan=plan, epochs=2,
                              reporting=Reporting(progress=False, metrics=metrics if name == "torch-p2p" else None),
                              runtime=Runtime(comm=sub, copy_stream=cfg.get("copy_stream"), transport=name)).fit()
                for name in ("torch-p2p", "mpi-host")}
        if sub.Get_rank() == 0:
            ref = Trainer(make(), loss, sgd(), data(), plan=plan, epochs=2).replay()
            res = {**cfg, "p2p_equals_replay": same_outcome(runs["torch-p2p"], ref),
                   "p2p_equals_mpi_host": same_outcome(runs["torch-p2p"], runs["mpi-host"]),
                   "transports": {name: r.transport for name, r in runs.items()},
                   "summary": json.loads(metrics.read_text().splitlines()[-1]),
                   "minibatches": len(ref.losses[0])}
            ok = ok and res["p2p_equals_replay"] and res["p2p_equals_mpi_host"]
            print("RESULT " + json.dumps(res), flush=True)
        sub.Free()
        MPI.COMM_WORLD.Barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
