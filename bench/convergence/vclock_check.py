"""The virtual clock against a real run: hetpipe's validation curve, run for real on emulated devices and
replayed on the virtual clock, wave by wave.

Usage: python bench/convergence/vclock_check.py [--d 0] [--budget 30] [--lr 3e-3] [--seed 0] [--waves equal]
[--out DIR]

1. ``run.py --only hetpipe`` trains the plan for ``--budget`` seconds on the emulated ``cpu-emulated-6``
   cluster (real MPI ranks, every instruction padded to its device type's profiled time) and keeps its
   device model, plan and validation curve (the PS's global weights, snapshotted about every second).
2. ``vclock.run_hetpipe`` replays the same plan, learning rate and seed for as many minibatches per VW,
   its times from the simulator on the kept plan, and validates after every wave.
3. Each real snapshot's validation loss is looked up among the virtual clock's: at D = 0 the replay's
   numerics are the run's bitwise, so every snapshot must equal one wave's loss exactly, and that wave's
   virtual time beside the snapshot's real time is how far the real run's host overheads (Python, MPI,
   start of each wave) stretch the modelled time. At D >= 1 the run's staleness is the host's, not the
   simulated record's, so exact matches are not expected there (the count says how many there were).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE), str(HERE.parent / "e2e")]

from report import table  # noqa: E402


def real_run(args, work: Path) -> dict:
    """The real emulated run (``run.py``), its kept directory under ``work``; returns its one run's record."""
    cmd = [sys.executable, str(HERE / "run.py"), "--only", "hetpipe", "--d", str(args.d), "--aggregate", "mean",
           "--budget", str(args.budget), "--lrs", str(args.lr), "--seeds", str(args.seed),
           "--profile-trials", str(args.profile_trials), "--keep", str(work / "real"), "--out", str(work / "real-out"),
           "--waves", args.waves]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vclock_check: run.py failed (status {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return json.loads((work / "real-out" / "convergence-full.json").read_text())["runs"][0]


def virtual_run(args, work: Path, run: dict):
    """The virtual clock on the real run's kept plan: (points, minibatches per VW, waves)."""
    import dataclasses

    import torch

    import vclock
    from hetpipe.plan.types import Plan

    torch.set_num_threads(1)
    plan = Plan.load(work / "real" / "plan.json")
    # The task, data and model bytes are the real run's; its stage times come from the kept plan.
    s = dataclasses.replace(vclock.setting("small", 1, 1.5, work=work / "virtual"), plan=plan)
    waves = run["samples"] // (plan.minibatches_per_wave * s.task.minibatch)
    steps = waves * plan.nm                # run_hetpipe's unit: waves of the plan's Nm
    points, _ = vclock.run_hetpipe(s, steps, run["lr"], args.seed, args.d, "mean", evals=waves)
    return points, steps, waves


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=0)
    ap.add_argument("--budget", type=float, default=30.0, help="the real run's training wall time (s)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-trials", type=int, default=3)
    ap.add_argument("--waves", choices=("equal", "speed"), default="equal", help="the plan's waves (run.py --waves)")
    ap.add_argument("--out", type=Path, help="keep the real run's directory and this check's JSON here")
    args = ap.parse_args(argv)
    work = args.out or Path(tempfile.mkdtemp(prefix="hetpipe-vclock-check-"))
    run = real_run(args, work)
    points, _, waves = virtual_run(args, work, run)
    at = {}
    for t, n, loss in points:
        at.setdefault(loss, (t, n))
    rows, ratios = [], []
    for t_real, loss in run["curve"]:
        hit = at.get(loss)
        if hit is None:
            rows.append([f"{t_real:.2f}", f"{loss:.4f}", "no exact match", "-", "-"])
            continue
        ratio = t_real / hit[0] if hit[0] else None
        if ratio is not None:
            ratios.append(ratio)
        rows.append([f"{t_real:.2f}", f"{loss:.4f}", f"{hit[0]:.2f}", str(hit[1]), "-" if ratio is None else f"{ratio:.3f}"])
    matched = sum(r[2] != "no exact match" for r in rows)
    plan_waves = "" if args.waves == "equal" else ", waves by speed"
    print(f"hetpipe D={args.d} (mean{plan_waves}), lr {args.lr:g}, seed {args.seed}: real run on EMULATED devices "
          f"(cpu-emulated-6, real MPI ranks, {run['wall_s']:.1f} s wall, {run['samples']} samples, {waves} waves) "
          f"beside the VIRTUAL CLOCK on its kept plan")
    print(table(["real s", "val loss", "virtual s", "samples", "real / virtual"], rows))
    summary = (f"real snapshots equal to a virtual-clock wave's loss exactly: {matched} of {len(rows)}")
    if ratios:
        summary += (f"; real / virtual time at the matched waves: median {statistics.median(ratios):.3f}, "
                    f"range {min(ratios):.3f}-{max(ratios):.3f}")
    print(summary)
    (work / "vclock_check.json").write_text(json.dumps(
        {"d": args.d, "lr": args.lr, "seed": args.seed, "real": run, "virtual": [list(p) for p in points],
         "matched": matched, "snapshots": len(rows), "ratios": ratios}, indent=1))
    return 0 if args.d > 0 or matched == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
