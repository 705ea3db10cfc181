"""The WSP oracle's case (tests/wsp_case.py) trained under mpiexec with emulated stage times, recorded.

Per configuration of ``wsp_case.CONFIGS`` named, rank 0 of the run writes OUT/<name>/record.json (the
run's record), weights.npz (the final global weights by layer) and losses.json (per VW, per minibatch),
and prints ``RESULT {"name": ..., "dir": ...}``.

Usage: mpiexec -n 5 python wsp_oracle_run.py OUT d1 d2
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))      # tests/: the case shared with the unit tests

import wsp_case  # noqa: E402
from common import split_world  # noqa: E402


def main() -> int:
    out = Path(sys.argv[1])
    for name in sys.argv[2:]:
        cfg = wsp_case.CONFIGS[name]
        plan = wsp_case.plan(cfg["d"], cfg["shards"], cfg["aggregate"])
        sub = split_world(plan.num_ranks)
        if sub is None:
            MPI.COMM_WORLD.Barrier()
            continue
        where = out / name
        run = wsp_case.trainer(wsp_case.model(), wsp_case.batches(), plan, cfg["momentum"], emulate=True, comm=sub,
                               record=where / "record.json").fit()
        if sub.Get_rank() == 0:
            np.savez(where / "weights.npz", **{str(layer): w for layer, w in run.weights.items()})
            (where / "losses.json").write_text(json.dumps(
                {str(v): {str(p): loss for p, loss in per.items()} for v, per in run.losses.items()}))
            print("RESULT " + json.dumps({"name": name, "dir": str(where)}), flush=True)
        sub.Free()
        MPI.COMM_WORLD.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
