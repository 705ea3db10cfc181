"""The staleness a real emulated run reaches beside that of the simulator's record of the same run.

Usage: python bench/convergence/vclock_staleness.py [--d 2] [--waves 40] [--slow 3]

Starts a 3-rank run under mpiexec: two VWs of one emulated stage each (VW 1 ``--slow`` times slower
per minibatch than VW 0; ``--stages 2``: VW 0 of two stages, 4 ranks) and one PS shard, Nm = 1,
staleness bound ``--d``; the run writes its record
(``Reporting(record=...)``). Then this process builds the same run, simulates it on the plan's stage
times (``hetpipe.run.simulated``; PS transfers instant) and prints the histogram of ``w - g`` over the
pulls of both records (``vclock.staleness_table``), and whether the replay of the simulated record runs
to the end. The measured run also pays host overheads the simulator does not model (Python per
instruction, MPI, the shared cores), so its VWs drift by more than the plan's times alone say.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE), str(HERE.parent / "e2e")]

import torch  # noqa: E402
from torch import nn  # noqa: E402

from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan  # noqa: E402
from hetpipe.run.config import Reporting, Runtime  # noqa: E402
from hetpipe.run.data import Batches  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402

LAYERS = 4
BATCH = 8
FWD_S = 0.01            # VW 0's forward per minibatch (backward: twice as long)


def plan(d: int, slow: float, stages: int = 1) -> Plan:
    """VW 0 of ``stages`` stages (each ``FWD_S`` per forward), VW 1 of one stage ``slow`` times VW 0's."""
    bounds = [0, 2, LAYERS] if stages == 2 else [0, LAYERS]
    first = tuple(StagePlan(f"n0.g{k}", "emulated0", a, b, FWD_S, 2 * FWD_S)
                  for k, (a, b) in enumerate(zip(bounds, bounds[1:])))
    second = (StagePlan("n1.g0", "emulated1", 0, LAYERS, FWD_S * slow, 2 * FWD_S * slow),)
    vws = (VirtualWorkerPlan(0, first), VirtualWorkerPlan(1, second))
    return Plan(LAYERS, 1, d, "manual", vws, (ShardPlan(0, "n0", tuple(range(LAYERS))),))


def trainer(cfg: dict, record=None, emulate: bool = False) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    n = 2 * cfg["waves"] * BATCH
    data = Batches(torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g), BATCH, seed=1)
    return Trainer(model, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.05), data,
                   plan=plan(cfg["d"], cfg["slow"], cfg["stages"]), reporting=Reporting(progress=False, record=record),
                   runtime=Runtime(emulate=emulate))


def worker(cfg_path: str, out_path: str) -> None:
    """One rank of the measured run (under mpiexec)."""
    torch.set_num_threads(1)
    cfg = json.loads(Path(cfg_path).read_text())
    trainer(cfg, record=cfg["record"], emulate=True).fit()
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(out_path).write_text(json.dumps({"record": cfg["record"]}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=2)
    ap.add_argument("--waves", type=int, default=40)
    ap.add_argument("--slow", type=float, default=3.0, help="VW 1's time per minibatch over VW 0's")
    ap.add_argument("--stages", type=int, choices=(1, 2), default=1, help="VW 0's stages (2: a 4-rank run)")
    ap.add_argument("--timeout", type=float, default=150.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from hetpipe.run.record import RunRecord
    from hetpipe.run.replay import replay_run
    from hetpipe.run.simulated import simulated_record
    from launch import run_worker
    from vclock import same_versions, staleness_table

    work = Path(tempfile.mkdtemp(prefix="hetpipe-vclock-staleness-"))
    cfg = {"d": args.d, "waves": args.waves, "slow": args.slow, "stages": args.stages,
           "record": str(work / "record.json")}
    (work / "cfg.json").write_text(json.dumps(cfg))
    res = run_worker(Path(__file__).resolve(), 2 + args.stages, work / "cfg.json", work / "out.json", args.timeout,
                     ["--worker"])
    measured = RunRecord.load(res["record"])
    spec = trainer(cfg).spec(plan(args.d, args.slow, args.stages))
    sim = simulated_record(spec)
    followed = replay_run(spec, sim.record)
    print(f"2 VWs of {args.stages} and 1 stage(s) (VW 1 {args.slow:g}x slower per minibatch than a stage of VW 0), "
          f"Nm 1, D {args.d}, {args.waves} waves; measured: a {2 + args.stages}-rank "
          f"emulated run ({res['elapsed_s']:.0f} s with start-up); simulated: the plan's stage times, PS instant")
    print(staleness_table(sim.record, measured))
    same, pulls = same_versions(sim.record, measured)
    print(f"pulls answered at the same version in both records: {same} of {pulls}")
    print(f"largest clock gap at the shard: simulated {sim.record.max_gap()}, measured {measured.max_gap()}; "
          f"the replay of the simulated record ran to the end ({len(followed.losses[0])} + {len(followed.losses[1])} "
          f"minibatches); simulated makespan {sim.sim.makespan_s:.2f} s")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[1], sys.argv[2])
    else:
        sys.exit(main())
