"""The PS's outer optimizer on the convergence task: mean, sum, sum + nesterov, mean + nesterov at D in {0, 4}.

Usage: python bench/convergence/outer.py [--budget 8] [--lr 3e-3] [--outer-lr 0.7] [--outer-momentum 0.9]

The task, device model and plan of run.py (byte-level GPT on the cpu-emulated-6 preset: EMULATED
devices, real computation padded to each device type's profiled time), hetpipe only, one seed and one
Adam learning rate for every variant (no sweep: a comparison of the PS's rules at equal settings, not
of tuned systems). Every variant trains the same plan in one launch, one after another, for the same
budget of training wall time; the PS's global weights are recorded during training and validated
after it (snapshots.py). Prints one table: validation loss at the budget, the best loss within it,
and the time to a target: the lowest loss (rounded up to 0.01) that every plain-rule row (mean, sum)
reaches within the budget, or --target.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import List

HERE = Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE), str(HERE.parent / "e2e")]

import report  # noqa: E402
from cluster_setup import CLUSTER  # noqa: E402
from curves import best_within, loss_at, time_to_target, validation_curve  # noqa: E402
from job import Job, save_jobs  # noqa: E402
from launch import run_worker  # noqa: E402
from run import hetpipe_size, prepare  # noqa: E402
from task import TaskSpec  # noqa: E402

# (aggregate, outer) of each row, per D.
RULES = [("mean", "sgd"), ("sum", "sgd"), ("sum", "nesterov"), ("mean", "nesterov")]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=8.0, help="seconds of training wall time per run")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate on every stage (every variant)")
    ap.add_argument("--d", default="0,4", help="staleness bounds")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="nesterov's outer learning rate (DiLoCo's 0.7)")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="nesterov's momentum (DiLoCo's 0.9)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, help="target validation loss (default: chosen, see above)")
    ap.add_argument("--profile-trials", type=int, default=1, help="profiles of the model; each layer keeps its fastest")
    ap.add_argument("--slowdown", type=float, default=1.5, help="emulated devices this much slower than the preset")
    ap.add_argument("--snapshot-every", type=float, default=0.5, help="seconds between recorded weights")
    ap.add_argument("--margin", type=float, default=1.1, help="runs last budget x margin simulated seconds")
    ap.add_argument("--keep", type=Path, help="keep device model, plan, jobs and snapshots here")
    return ap.parse_args(argv)


def jobs_of(args, task: TaskSpec, plan, work: Path, ndev: int) -> List[Job]:
    """One job per (D, rule), all on the plan saved in ``work``."""
    jobs = []
    for d in (int(x) for x in args.d.split(",")):
        n, every, _ = hetpipe_size(plan, d, args.budget, args.margin, args.snapshot_every)
        for agg, outer in RULES:
            nesterov = outer == "nesterov"
            jobs.append(Job(system="hetpipe", task=task, seed=args.seed, lr=args.lr, budget_s=args.budget,
                            snapshot_every_s=args.snapshot_every, device_model=str(work / "devices.json"),
                            snapshots=str(work / f"d{d}-{agg}-{outer}.npz"), micro=ndev, plan=str(work / "plan.json"),
                            d=d, aggregate=agg, minibatches=n, snapshot_waves=every, outer=outer,
                            outer_lr=args.outer_lr if nesterov else 1.0, outer_momentum=args.outer_momentum))
    return jobs


def rule_of(job: Job) -> str:
    if job.outer == "sgd":
        return job.aggregate
    return f"{job.aggregate} + nesterov (lr {job.outer_lr:g}, momentum {job.outer_momentum:g})"


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    work = args.keep or Path(tempfile.mkdtemp(prefix="hetpipe-outer-"))
    work.mkdir(parents=True, exist_ok=True)
    task, _, (xv, yv), dm, plan, planner, _, _ = prepare(args, work, nm=None, policy="auto")
    jobs = jobs_of(args, task, plan, work, len(dm.devices))
    save_jobs(work / "jobs.json", jobs)
    vws = "; ".join(f"VW {v.index}: " + " | ".join(f"{st.device_type} L{st.start}-{st.stop - 1}" for st in v.stages)
                    for v in plan.virtual_workers)
    print(f"devices: EMULATED (cluster preset {CLUSTER}, real computation padded to each device type's profiled "
          f"time x {args.slowdown:g}); load average {os.getloadavg()[0]:.1f} at start", flush=True)
    print(f"plan: {planner}, Nm={plan.nm}, {len(plan.ps_shards)} PS shard(s); {vws}", flush=True)
    print(f"task: byte-level GPT, Adam lr {args.lr:g} on every stage, seed {args.seed}; budget {args.budget:g} s of "
          f"training wall time per run; {len(jobs)} runs in one launch", flush=True)
    res = run_worker(HERE / "train_hetpipe.py", plan.num_ranks, work / "jobs.json", work / "result.json",
                     timeout_s=len(jobs) * (3 * args.budget + 60) + 120)
    rows = []
    for job, r in zip(jobs, res["runs"]):
        curve = validation_curve(task, job.seed, Path(job.snapshots), xv, yv)
        rows.append({"job": job, "curve": curve, "rate": r["samples"] / curve[-1][0]})
    plain = [x for x in rows if x["job"].outer == "sgd"]
    target = args.target if args.target is not None else report.choose_target(plain, args.budget)
    body = []
    for x in rows:
        ttt = time_to_target(x["curve"], target)
        body.append([rule_of(x["job"]), str(x["job"].d), f"{loss_at(x['curve'], args.budget):.3f}",
                     f"{best_within(x['curve'], args.budget):.3f}", "-" if ttt is None else f"{ttt:.1f}",
                     f"{x['rate']:.0f}"])
    how = "given" if args.target is not None else "the lowest loss (rounded up to 0.01) every plain-rule row reaches"
    print(f"\ntarget validation loss {target:.2f} nats/byte ({how}); times are training wall-clock seconds on "
          "EMULATED devices; '-': not reached within the budget")
    print(report.table(["PS rule", "D", f"val loss at {args.budget:g} s", "best val loss", "time to target s",
                         "samples/s"], body))
    print(f"\nlaunch {res['elapsed_s']:.0f} s; whole run {time.time() - started:.0f} s; load average "
          f"{os.getloadavg()[0]:.1f} at end")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
