"""The PS's outer optimizer on the convergence task: mean, sum, sum + nesterov, mean + nesterov at D in {0, 4}.

Usage: python bench/convergence/outer.py [--budget 8] [--lr 3e-3] [--outer-lr 0.7] [--outer-momentum 0.9]
       [--rules mean:sgd,sum:sgd,sum:nesterov,mean:nesterov] [--outer-staleness none|inverse|sqrt] [--outer-delay 0]

Rows (``--rules``): ``AGG:OUTER`` with AGG "mean" or "sum" (the PS's aggregate) or "sqrt" (the sqrt gain:
each push divided by sqrt(N), hetpipe.plan.outer) and OUTER "sgd", "nesterov" or "delayed-nesterov"
(``--outer-delay`` pushes per momentum step, 0: the VW count). ``--outer-staleness`` applies to every row
but the plain ones (mean:sgd, sum:sgd), which stay the reference.

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
from typing import List, Tuple

HERE = Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE), str(HERE.parent / "e2e")]

import report  # noqa: E402
from cluster_setup import CLUSTER  # noqa: E402
from curves import best_within, loss_at, time_to_target, validation_curve  # noqa: E402
from job import Job, save_jobs  # noqa: E402
from launch import run_worker  # noqa: E402
from run import hetpipe_size, prepare  # noqa: E402
from task import TaskSpec  # noqa: E402

# (aggregate, outer) of each row, per D, unless --rules names others.
RULES = [("mean", "sgd"), ("sum", "sgd"), ("sum", "nesterov"), ("mean", "nesterov")]
GAINS_OR_AGGREGATES = ("mean", "sum", "sqrt")
OUTERS = ("sgd", "nesterov", "delayed-nesterov")


def parse_rules(text: str) -> List[Tuple[str, str]]:
    """``AGG:OUTER,...`` as (AGG, OUTER) pairs; argparse's error naming the first bad one."""
    rules = []
    for item in text.split(","):
        agg, _, outer = item.strip().partition(":")
        if agg not in GAINS_OR_AGGREGATES or outer not in OUTERS:
            raise argparse.ArgumentTypeError(f"a rule is AGG:OUTER with AGG in {', '.join(GAINS_OR_AGGREGATES)} and "
                                             f"OUTER in {', '.join(OUTERS)}, got {item!r}")
        rules.append((agg, outer))
    return rules


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=8.0, help="seconds of training wall time per run")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate on every stage (every variant)")
    ap.add_argument("--d", default="0,4", help="staleness bounds")
    ap.add_argument("--rules", type=parse_rules, default=RULES,
                    help="rows as AGG:OUTER,... (default mean:sgd,sum:sgd,sum:nesterov,mean:nesterov; see above)")
    ap.add_argument("--outer-lr", type=float, default=0.7,
                    help="the momentum rows' outer learning rate (DiLoCo's 0.7)")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="the momentum rows' momentum (DiLoCo's 0.9)")
    ap.add_argument("--outer-staleness", choices=("none", "inverse", "sqrt"), default="none",
                    help="the staleness decay of every row but the plain ones (default none)")
    ap.add_argument("--outer-delay", type=int, default=0,
                    help="delayed-nesterov's pushes per momentum step (default 0: the VW count)")
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
        for agg, outer in args.rules:
            momentum = outer != "sgd"
            plain = agg != "sqrt" and not momentum
            jobs.append(Job(system="hetpipe", task=task, seed=args.seed, lr=args.lr, budget_s=args.budget,
                            snapshot_every_s=args.snapshot_every, device_model=str(work / "devices.json"),
                            snapshots=str(work / f"d{d}-{agg}-{outer}.npz"), micro=ndev, plan=str(work / "plan.json"),
                            d=d, aggregate="mean" if agg == "sqrt" else agg, minibatches=n, snapshot_waves=every,
                            outer=outer, outer_lr=args.outer_lr if momentum else 1.0,
                            outer_momentum=args.outer_momentum,
                            outer_staleness="none" if plain else args.outer_staleness,
                            outer_gain="sqrt" if agg == "sqrt" else "none",
                            outer_delay=args.outer_delay if outer == "delayed-nesterov" else 0))
    return jobs


def is_plain(job: Job) -> bool:
    """The plain rule (mean or sum, no outer optimizer): the rows the target is chosen from."""
    return job.outer == "sgd" and job.outer_lr == 1.0 and job.outer_gain == "none" and job.outer_staleness == "none"


def rule_of(job: Job) -> str:
    base = "sqrt gain" if job.outer_gain == "sqrt" else job.aggregate
    parts = [f"lr {job.outer_lr:g}", f"momentum {job.outer_momentum:g}"] if job.outer != "sgd" else []
    if job.outer == "delayed-nesterov":
        parts.append(f"delay {job.outer_delay or 'N'}")
    if job.outer_staleness != "none":
        parts.append(f"{job.outer_staleness} staleness")
    if job.outer == "sgd":
        return base + (f" ({', '.join(parts)})" if parts else "")
    return f"{base} + {job.outer} ({', '.join(parts)})"


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
    plain = [x for x in rows if is_plain(x["job"])]
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
