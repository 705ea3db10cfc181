"""The virtual clock against a real run: one system's validation curve, trained for real on emulated devices
and again on the virtual clock, point by point.

Usage: python bench/convergence/vclock_check.py [--system hetpipe] [--d 0] [--budget 30] [--lr 3e-3]
[--seed 0] [--spread 0,1,2] [--waves equal] [--out DIR]

1. ``run.py --only SYSTEM`` trains for ``--budget`` seconds on the emulated ``cpu-emulated-6`` cluster
   (real MPI ranks, every instruction padded to its device type's profiled time) and keeps its device
   model, plan and validation curve: the weights recorded about every second, with the optimizer steps
   taken by then (the baselines) or the global version ``g`` (hetpipe: the PS's ``W_g``).
2. The virtual clock runs the same system, learning rate and seed (``vclock.run_baseline`` or
   ``vclock.run_hetpipe``) on the kept device model and plan, validating after every step or wave, and
   once more on each seed of ``--spread``.
3. Each real point is set beside the virtual clock's at the same step or version:
   - the loss. hetpipe at D = 0 replays the run's numerics bitwise, so the losses must be equal (the
     script fails otherwise). Elsewhere the losses can only agree within the seed spread: the baselines'
     real runs sum the ranks' gradients in another order than one process does, and at D >= 1 the real
     run's staleness is the host's, not the simulated record's (printed beside each other). A point
     agrees when the difference is within the standard deviation of the virtual clock's seeds there (the
     verdict, and the exit status); how many real points lie inside the range of the seeds' losses is
     printed beside it. Two runs whose trajectories have parted are like two draws of one distribution:
     their difference has sqrt(2) times its spread, so about half their points differ by more than sd.
   - the time: real seconds over virtual seconds, how far the real run's host overheads (Python, MPI,
     gloo) stretch the modelled time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE), str(HERE.parent / "e2e")]

from report import table  # noqa: E402

BASELINES = ("ddp", "ddp-fast", "hetero-dp", "pipelining")


def real_run(args, work: Path) -> dict:
    """The real emulated run (``run.py``), its kept directory under ``work``; returns its one run's record."""
    cmd = [sys.executable, str(HERE / "run.py"), "--only", args.system, "--d", str(args.d), "--aggregate", "mean",
           "--budget", str(args.budget), "--lrs", str(args.lr), "--seeds", str(args.seed),
           "--profile-trials", str(args.profile_trials), "--keep", str(work / "real"), "--out", str(work / "real-out"),
           "--waves", args.waves]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vclock_check: run.py failed (status {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    run = json.loads((work / "real-out" / "convergence-full.json").read_text())["runs"][0]
    at = run.get("snapshot_versions" if args.system == "hetpipe" else "snapshot_steps")
    if at is None or len(at) != len(run["curve"]):
        raise SystemExit(f"vclock_check: the real run kept {len(run['curve'])} validation points but "
                         f"{'no' if at is None else len(at)} step counts for them")
    return run


def kept_setting(args, work: Path):
    """The virtual clock's setting with the real run's device model and plan (the task, data, profile and
    cluster as ``run.prepare`` makes them: the profile only sizes the gradient and the memory verdicts)."""
    import vclock
    from devices import DeviceModel
    from hetpipe.plan.types import Plan

    s = vclock.setting("small", 1, 1.5, work=work / "virtual")
    return dataclasses.replace(s, dm=DeviceModel.load(work / "real" / "devices.json"),
                               plan=Plan.load(work / "real" / "plan.json"))


def virtual_curves(args, s, upto: int) -> Dict[int, tuple]:
    """Per seed of the spread: (points validated after every step or wave 0 .. ``upto``, what the run
    returns beside them: the baseline's step or hetpipe's simulated run)."""
    import vclock

    out = {}
    for seed in args.spread:
        if args.system == "hetpipe":
            points, extra = vclock.run_hetpipe(s, upto * s.plan.nm, args.lr, seed, args.d, "mean", evals=upto)
        else:
            points, extra = vclock.run_baseline(s, args.system, upto, args.lr, seed, evals=upto)
        if len(points) != upto + 1:
            raise SystemExit(f"vclock_check: the virtual clock validated {len(points)} points, not {upto + 1}")
        out[seed] = (points, extra)
    return out


def staleness_lines(run: dict, simulated) -> List[str]:
    """hetpipe: the staleness of the real run's pulls beside the simulated record's, and how many pulls got
    the same version in both."""
    import vclock
    from hetpipe.run.record import RunRecord

    if not run.get("record") or not Path(run["record"]).exists():
        return ["(the real run kept no record: staleness not compared)"]
    measured = RunRecord.load(run["record"])
    same, pulls = vclock.same_versions(simulated, measured)
    return ["staleness w - g of every pull, the simulated record beside the real run's:",
            vclock.staleness_table(simulated, measured),
            f"pulls answered at the same version in both records: {same} of {pulls}; largest clock gap at a "
            f"shard: simulated {simulated.max_gap()}, measured {measured.max_gap()}"]


def compare(args, run: dict, curves: Dict[int, tuple]) -> dict:
    """The table rows and the verdicts of each real point against the virtual clock's at its step."""
    at = run["snapshot_versions" if args.system == "hetpipe" else "snapshot_steps"]
    mine = curves[args.seed][0]
    rows, ratios, diffs, sds = [], [], [], []
    exact = within = inside = 0
    for k, (t_real, loss) in zip(at, run["curve"]):
        t_virt, samples, virt = mine[k]
        seeds = [c[0][k][2] for c in curves.values()]
        sd = statistics.stdev(seeds) if len(seeds) > 1 else 0.0
        diff = abs(loss - virt)
        exact += loss == virt
        ratio = t_real / t_virt if t_virt else None
        if k:
            ratios += [ratio] if ratio is not None else []
            diffs.append(diff)
            sds.append(sd)
            within += diff <= sd
            inside += min(seeds) <= loss <= max(seeds)
        rows.append([f"{t_real:.2f}", str(k), f"{loss:.4f}", f"{virt:.4f}", f"{diff:.1e}", f"{sd:.4f}",
                     f"{t_virt:.2f}", "-" if ratio is None else f"{ratio:.3f}"])
    return {"rows": rows, "ratios": ratios, "diffs": diffs, "sds": sds, "exact": exact, "within": within,
            "inside": inside, "points": len(rows)}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=("hetpipe",) + BASELINES, default="hetpipe")
    ap.add_argument("--d", type=int, default=0, help="hetpipe's staleness bound")
    ap.add_argument("--budget", type=float, default=30.0, help="the real run's training wall time (s)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spread", default="0,1,2", help="the virtual clock's seeds for the seed spread")
    ap.add_argument("--profile-trials", type=int, default=3)
    ap.add_argument("--waves", choices=("equal", "speed"), default="equal", help="hetpipe's waves (run.py --waves)")
    ap.add_argument("--out", type=Path, help="keep the real run's directory and this check's JSON here")
    args = ap.parse_args(argv)
    args.spread = sorted({int(x) for x in args.spread.split(",")} | {args.seed})
    work = args.out or Path(tempfile.mkdtemp(prefix="hetpipe-vclock-check-"))

    import torch
    torch.set_num_threads(1)
    run = real_run(args, work)
    s = kept_setting(args, work)
    at = run["snapshot_versions" if args.system == "hetpipe" else "snapshot_steps"]
    curves = virtual_curves(args, s, max(at))
    got = compare(args, run, curves)

    hetpipe = args.system == "hetpipe"
    what = (f"hetpipe D={args.d} (mean{'' if args.waves == 'equal' else ', waves by speed'})" if hetpipe else
            f"{args.system} ({curves[args.seed][1].note})")
    unit = "version g" if hetpipe else "step"
    print(f"{what}, lr {args.lr:g}, seed {args.seed}: real run on EMULATED devices (cpu-emulated-6, real MPI "
          f"ranks, {run['wall_s']:.1f} s wall, {run['samples']} samples) beside the VIRTUAL CLOCK on its kept "
          f"device model and plan (seeds {args.spread} for the spread)")
    print(table(["real s", unit, "real loss", "virtual loss", "|diff|", "seed sd", "virtual s", "real / virtual"],
                got["rows"]))
    n = got["points"] - 1                       # the initial weights are the same in both by construction
    lines = []
    lines.append(f"real points equal to the virtual clock's loss at the same {unit} exactly: "
                 f"{got['exact']} of {got['points']}")
    lines.append(f"points after the first within the seed spread (|diff| <= sd of the virtual clock's seeds): "
                 f"{got['within']} of {n}; largest |diff| {max(got['diffs'], default=0):.1e}, median seed sd "
                 f"{statistics.median(got['sds']) if got['sds'] else 0:.4f}")
    lines.append(f"points after the first inside the range of the virtual clock's seeds' losses: {got['inside']} of {n}")
    if got["ratios"]:
        lines.append(f"real / virtual time: median {statistics.median(got['ratios']):.3f}, range "
                     f"{min(got['ratios']):.3f}-{max(got['ratios']):.3f}")
    if hetpipe:
        lines += staleness_lines(run, curves[args.seed][1].record)
    print("\n".join(lines))
    (work / "vclock_check.json").write_text(json.dumps(
        {"system": args.system, "d": args.d, "lr": args.lr, "seed": args.seed, "spread": args.spread, "real": run,
         "virtual": {str(k): [list(p) for p in v[0]] for k, v in curves.items()},
         **{k: got[k] for k in ("exact", "within", "inside", "points", "ratios", "diffs", "sds")}}, indent=1))
    if hetpipe and args.d == 0:
        return 0 if got["exact"] == got["points"] else 1
    return 0 if got["within"] == n else 1


if __name__ == "__main__":
    sys.exit(main())
