"""A run planned on the cpu-emulated preset from a profile of this host, through the plan cache of
``hetpipe launch --plan-cache``. Usage: plan_cache_run.py OUT [PLAN]; rank 0 writes OUT/result.json (the
plan it trained with and the losses). PLAN: a plan file the script gives its Trainer."""

import json
import sys
from pathlib import Path

from mpi4py import MPI

from common import cross_entropy, mlp, sgd, synthetic
from hetpipe import Planning, Reporting, Trainer


def main() -> int:
    out = Path(sys.argv[1])
    plan = sys.argv[2] if len(sys.argv) > 2 else None
    run = Trainer(mlp(), cross_entropy, sgd(), synthetic(n=256), plan=plan,
                  planning=Planning(cluster="cpu-emulated", nm=2, d=0), reporting=Reporting(progress=False)).fit()
    if MPI.COMM_WORLD.Get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({
            "plan": run.plan.to_dict(), "losses": {str(v): l for v, l in run.losses.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
