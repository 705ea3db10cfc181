"""Time to accuracy: hetpipe (D and aggregation rules) beside DDP and torch pipelining, one emulated cluster.

Usage: python bench/convergence/run.py [--quick] [--out DIR] [--keep DIR]

Every system trains the same byte-level GPT (task.py) on the same emulated heterogeneous cluster
(bench/e2e's device model and launch machinery), for the same wall-clock budget. Each system's
learning rate is the best of a sweep (seed 0, lowest validation loss at the budget); the best is then
run on the other seeds. Runs share launches (a launch's start-up costs tens of seconds of a loaded
host): the sweep is one launch per launch group (DDP; pipelining; every hetpipe variant, which all
run the same plan on the same ranks, alternating within the launch), each later seed another pass
over the groups, so load changes on the host fall on every system alike. Weights are recorded during
training and validated after each run (snapshots.py). Prints the sweep, the summary (time to target,
loss at the budget, spread over seeds), the goal lines; writes a PNG and the raw JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE), str(HERE.parent / "e2e")]

import torch  # noqa: E402

import predict  # noqa: E402
import report  # noqa: E402
from cluster_setup import CLUSTER, make_plan, profile_device_model  # noqa: E402
from curves import validation_curve  # noqa: E402
from hetpipe.run.trainer import Trainer
from hetpipe.schedule import simulate_plan  # noqa: E402
from job import Job, save_jobs  # noqa: E402
from launch import run_worker  # noqa: E402
from task import MinibatchStream, TaskSpec, build_layers, corpus, loss_fn, uniform_loss, validation_set  # noqa: E402

LABELS = {"ddp": "DDP (gloo)", "pipelining": "torch pipelining 1F1B"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 s budget, 2 learning rates, 2 seeds, D in {0, 4} (figures not meaningful)")
    ap.add_argument("--budget", type=float, default=18.0, help="seconds of training wall time per run")
    ap.add_argument("--lrs", default="3e-3,1e-2,3e-2", help="learning rates of the sweep (every system)")
    ap.add_argument("--seeds", default="0,1,2", help="seeds; the sweep runs on the first")
    ap.add_argument("--d", default="0,1,4", help="hetpipe staleness bounds")
    ap.add_argument("--aggregate", default="auto",
                    help="hetpipe aggregation rules, comma separated (auto: sum and mean if the Trainer has both)")
    ap.add_argument("--only", default="ddp,pipelining,hetpipe", help="systems to run")
    ap.add_argument("--nm", type=int, help="hetpipe minibatches in flight per VW (default: the planner's choice)")
    ap.add_argument("--policy", default="auto", help="hetpipe VW formation policy (NP, ED, HD, auto)")
    ap.add_argument("--target", type=float, help="target validation loss (default: chosen, see README)")
    ap.add_argument("--profile-trials", type=int, default=3,
                    help="profile the model this many times, keeping each layer's fastest time (a shared host "
                         "preempts some measurements)")
    ap.add_argument("--slowdown", type=float, default=1.5,
                    help="emulated devices this much slower than the preset (all systems alike), so that on a "
                         "loaded host the real work of hetpipe's busy stages still fits in their emulated time")
    ap.add_argument("--snapshot-every", type=float, default=1.0, help="seconds between recorded weights")
    ap.add_argument("--margin", type=float, default=1.1,
                    help="hetpipe runs a fixed number of waves: the fewest whose simulated time is budget x margin")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="where the PNG and the JSON go")
    ap.add_argument("--keep", type=Path, help="keep device model, plan, jobs, snapshots and raw results here")
    if ap.parse_known_args(argv)[0].quick:      # --quick changes the defaults; explicit options still win
        ap.set_defaults(budget=8.0, lrs="3e-3,1e-2", seeds="0,1", d="0,4", snapshot_every=0.5)
    return ap.parse_args(argv)


def systems(args, plan) -> List[dict]:
    """The systems of the run: key, label, worker script, ranks, per-system job fields."""
    out = []
    only = set(args.only.split(","))
    ndev = None
    if "ddp" in only:
        out.append({"key": "ddp", "label": LABELS["ddp"], "group": "ddp", "script": "train_ddp.py", "ranks": ndev,
                    "job": {}})
    if "pipelining" in only:
        out.append({"key": "pipelining", "label": LABELS["pipelining"], "group": "pipelining",
                    "script": "train_pipelining.py", "ranks": ndev, "job": {}})
    if "hetpipe" in only:
        aggs = args.aggregate.split(",") if args.aggregate != "auto" else (
            ["sum", "mean"] if "aggregate" in inspect.signature(Trainer).parameters else ["sum"])
        for agg in aggs:
            for d in (int(x) for x in args.d.split(",")):
                # Every hetpipe variant runs the same plan on the same ranks: one launch serves them all.
                out.append({"key": f"hetpipe-d{d}-{agg}", "label": f"hetpipe D={d} ({agg})", "group": "hetpipe",
                            "script": "train_hetpipe.py", "ranks": plan.num_ranks, "job": {"d": d, "aggregate": agg}})
    return out


def hetpipe_size(plan, d: int, budget: float, margin: float, snapshot_every: float) -> Tuple[int, int, float]:
    """(minibatches, snapshot every k waves, predicted steady samples/s) of a hetpipe run whose simulated
    length (start-up included, hetpipe.schedule.simulate_plan) is at least ``budget x margin``."""
    pd = dataclasses.replace(plan, d=d)
    rate = predict.hetpipe_rate(pd, waves=8, skip_waves=2)
    per_wave = len(plan.virtual_workers) * plan.nm
    waves = 1
    while simulate_plan(pd, waves=waves).makespan_s < budget * margin:
        waves += 1
    every = max(1, round(snapshot_every * rate / plan.minibatch_size / per_wave))
    return waves * per_wave, every, rate


def shown(path: Path) -> str:
    """``path`` as printed and recorded: relative to the repository when inside it, else its name alone."""
    try:
        return str(Path(path).resolve().relative_to(HERE.parents[1]))
    except ValueError:
        return Path(path).name


def best_lrs(runs: List[dict], syss: List[dict], failed: Dict[str, str], budget: float) -> Dict[str, float]:
    """Per system still running, the learning rate of its sweep run with the lowest validation loss at the budget."""
    return {s["key"]: min((r for r in runs if r["key"] == s["key"] and r["phase"] == "sweep"),
                          key=lambda r: report.loss_at(r["curve"], budget))["lr"]
            for s in syss if s["key"] not in failed}


def extend(lrs: List[float], best: float) -> float:
    """The next learning rate past the grid's edge if ``best`` is at that edge (0.0 otherwise)."""
    if len(lrs) < 2:
        return 0.0
    grid = sorted(lrs)
    if best == grid[0]:
        return grid[0] * grid[0] / grid[1]
    if best == grid[-1]:
        return grid[-1] * grid[-1] / grid[-2]
    return 0.0


def prepare(args, work: Path, nm, policy: str):
    """What every convergence bench starts from: the task, its corpus description, the validation set,
    the emulated device model (profiled here, saved as ``work/devices.json``) and the plan made on it
    (``work/plan.json``) with its planner's description."""
    task = TaskSpec()
    text, val_text, about = corpus(task)
    x0, y0 = MinibatchStream(text, task, 0, 1)[0]
    dm, prof, cluster = profile_device_model(build_layers(task, 0), x0, lambda out: loss_fn(out, y0),
                                             f"bytegpt{task.blocks}x{task.width}", optimizer_factor=2.0,
                                             trials=args.profile_trials, slowdown=args.slowdown)
    dm.save(work / "devices.json")
    plan, planner = make_plan(dm, prof, cluster, nm=nm, policy=policy)
    plan.save(work / "plan.json")
    return task, about, validation_set(val_text, task), dm, plan, planner


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="hetpipe-conv-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    started = time.time()
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} ({os.cpu_count()} cores)", flush=True)
    task, about, (xv, yv), dm, plan, planner = prepare(args, work, nm=args.nm, policy=args.policy)
    ndev = len(dm.devices)
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    syss = systems(args, plan)
    for s in syss:
        s["ranks"] = s["ranks"] or ndev
        if s["key"].startswith("hetpipe"):
            n, every, rate = hetpipe_size(plan, s["job"]["d"], args.budget, args.margin, args.snapshot_every)
            s["job"].update(minibatches=n, snapshot_waves=every, plan=str(work / "plan.json"))
            s["predicted"] = rate

    types = ", ".join(f"{sum(1 for _, u in dm.devices if u == t)}x {t} "
                      f"({dm.minibatch_time(t) / (sum(dm.host_fwd) + sum(dm.host_bwd)):.1f}x host time, "
                      f"{dm.minibatch_time(t) * 1e3:.0f} ms/minibatch)" for t in dm.types)
    vws = "; ".join(f"VW {v.index}: " + " | ".join(f"{st.device_type} L{st.start}-{st.stop - 1}" for st in v.stages)
                    for v in plan.virtual_workers)
    header = [
        f"device model: {dm.source}",
        f"devices: EMULATED (real computation padded to each device type's profiled time; {torch.get_num_threads()} "
        f"torch thread per rank); cluster {CLUSTER}: {types}",
        f"task: byte-level GPT {task.blocks} blocks x {task.width} wide, {task.heads} heads, context {task.context}, "
        f"{sum(p.numel() for l in build_layers(task, 0) for p in l.parameters())} parameters; Adam; minibatch "
        f"{task.minibatch} windows; text: Python {about['stdlib']} standard library ({about['train_files']} files, "
        f"{about['train_bytes']} bytes train; {about['val_files']} held-out files, {task.val_windows} windows of "
        f"{task.context} validated); uniform guess = {uniform_loss():.3f} nats/byte",
        f"plan: {planner}, Nm={plan.nm}, {len(plan.ps_shards)} PS shard(s); {vws}",
        f"device model throughputs (compute only): cluster limit {predict.limit_rate(dm):.0f} samples/s (sum of "
        f"the devices' standalone rates); DDP {predict.ddp_rate(dm, len(dm.fwd[dm.types[0]]), ndev * task.minibatch):.0f} "
        f"(every step waits for the slowest device's minibatch); pipelining "
        f"{predict.pipelining_rate(dm, len(dm.fwd[dm.types[0]]), ndev, '1f1b'):.0f}; hetpipe "
        f"plan {predict.hetpipe_rate(plan, 8, 2):.0f}",
        f"DDP: {ndev} ranks x 1 minibatch per step; pipelining: uniform split over {ndev} stages, {ndev} "
        f"micro-batches (1 minibatch each) per step; budget {args.budget:g} s training wall time per run",
        "validation: weights recorded every ~%g s during training (hetpipe: the PS's global weights W_g at wave "
        "ends), validated after the run (no training time spent on it)" % args.snapshot_every]
    print("\n".join(header), flush=True)

    runs: List[dict] = []
    failed: Dict[str, str] = {}

    def run_batch(batch: List[Tuple[dict, int, float]], phase: str) -> None:
        """One launch training each ``(system, seed, lr)`` of ``batch`` in turn (systems of one launch group:
        same script and ranks); validates each run."""
        if not batch:
            return
        first = batch[0][0]
        tag = f"{first['group']}-{phase}{len(runs)}"
        jobs = [Job(system=s["key"], task=task, seed=seed, lr=lr, budget_s=args.budget,
                    snapshot_every_s=args.snapshot_every, device_model=str(work / "devices.json"),
                    snapshots=str(work / f"{tag}-{k}.npz"), micro=ndev, **s["job"])
                for k, (s, seed, lr) in enumerate(batch)]
        save_jobs(work / f"{tag}.jobs.json", jobs)
        load = os.getloadavg()[0]
        try:
            res = run_worker(HERE / first["script"], first["ranks"], work / f"{tag}.jobs.json",
                             work / f"{tag}.result.json", timeout_s=len(jobs) * (3 * args.budget + 60) + 120)
        except RuntimeError as e:
            # One launch failing must not cost the other systems their measurement: its systems are named
            # and left out.
            lines = str(e).strip().splitlines()
            why = next((l for l in reversed(lines) if "rror" in l), lines[-1])[:200]
            for s, _, _ in batch:
                failed[s["key"]] = why
            print(f"  {', '.join(dict.fromkeys(s['label'] for s, _, _ in batch))} FAILED: {why}", flush=True)
            print(str(e)[-3000:], file=sys.stderr, flush=True)
            return
        for (s, _, _), job, r in zip(batch, jobs, res["runs"]):
            curve = validation_curve(task, job.seed, Path(job.snapshots), xv, yv)
            end = curve[-1][0] if s["key"].startswith("hetpipe") else r["wall_s"]
            over = max(x["overrun_s"] for x in r["ranks"]) / r["wall_s"]
            runs.append({"key": s["key"], "label": s["label"], "seed": job.seed, "lr": job.lr, "phase": phase,
                         "curve": curve, "end_s": end, "samples": r["samples"], "wall_s": r["wall_s"],
                         "overrun_frac": over, "load_at_launch": load, "launch_s": res["elapsed_s"],
                         "note": r.get("note", ""), "ranks": r["ranks"]})
            print(f"  {s['label']:<24} seed {job.seed} lr {job.lr:<6.3g} val loss {curve[-1][1]:.3f} at "
                  f"{curve[-1][0]:5.1f} s, {r['samples'] / r['wall_s']:6.0f} samples/s, overrun {100 * over:4.1f}%",
                  flush=True)
        print(f"    (launch of {len(jobs)} run(s): {res['elapsed_s']:.0f} s, load average {load:.1f} at its start)",
              flush=True)

    def groups() -> List[List[dict]]:
        live = [s for s in syss if s["key"] not in failed]
        return [[s for s in live if s["group"] == g] for g in dict.fromkeys(s["group"] for s in live)]

    print(f"\nseed {seeds[0]}: learning-rate sweep {lrs}", flush=True)
    for g in groups():
        run_batch([(s, seeds[0], lr) for lr in lrs for s in g], "sweep")
    best = best_lrs(runs, syss, failed, args.budget)
    # A best learning rate at the edge of the grid may not be the system's best: one more value past that
    # edge (the grid's ratio), for every system alike.
    edge = {k: extend(lrs, lr) for k, lr in best.items()}
    if any(edge.values()):
        print(f"\nseed {seeds[0]}: sweep extended past its edge where the best learning rate sits there", flush=True)
        for g in groups():
            run_batch([(s, seeds[0], edge[s["key"]]) for s in g if edge[s["key"]]], "sweep")
        best = best_lrs(runs, syss, failed, args.budget)
    for seed in seeds[1:]:
        print(f"\nseed {seed} at each system's best learning rate", flush=True)
        for g in groups():
            run_batch([(s, seed, best[s["key"]]) for s in g], "seed")

    final = [r for r in runs if r["key"] in best and r["lr"] == best[r["key"]]]
    target = args.target if args.target is not None else report.choose_target(final, args.budget)
    order = [s["key"] for s in systems(args, plan)]
    rows = sorted(report.summarize(final, target, args.budget), key=lambda r: order.index(r["key"]))
    load1 = os.getloadavg()
    print()
    print("\n".join(header))
    print(f"\nlearning-rate sweep, seed {seeds[0]}: validation loss at {args.budget:g} s (* = best, used below)")
    print(report.sweep_table([r for r in runs if r["phase"] == "sweep"], best, args.budget))
    still = [s["label"] for s in syss if s["key"] in best and
             extend(sorted({r["lr"] for r in runs if r["key"] == s["key"]}), best[s["key"]])]
    if still:
        print(f"best learning rate still at the edge of the (extended) sweep: {', '.join(still)}")
    how = "given" if args.target is not None else "the lowest loss (rounded up to 0.01) that every run below reaches within the budget"
    print(f"\ntarget validation loss {target:.2f} nats/byte ({how}); seeds {seeds}; times are training wall-clock "
          "seconds on EMULATED devices")
    print(report.summary_table(rows, args.budget))
    print()
    print("\n".join(report.goal_lines(rows)))
    for key, why in failed.items():
        print(f"FAILED and left out: {next(x['label'] for x in systems(args, plan) if x['key'] == key)}: {why}")
    print(f"\nload average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; whole run {time.time() - started:.0f} s")
    stamp = "quick" if args.quick else "full"
    png = args.out / f"convergence-{stamp}.png"
    report.plot(final, target, args.budget, png,
                f"byte-level GPT on the {CLUSTER} cluster (EMULATED devices), best LR per system, mean and range over "
                f"{len(seeds)} seeds")
    raw = {"args": {k: shown(v) if isinstance(v, Path) else str(v) for k, v in vars(args).items()},
           "header": header, "corpus": about,
           "task": task.to_dict(), "device_model": dataclasses.asdict(dm), "plan": json.loads(plan.to_json()),
           "target": target, "best_lr": best, "summary": rows, "runs": runs, "failed": failed,
           "load_start": load0, "load_end": load1, "predicted_hetpipe_samples_per_s":
               {s["key"]: s.get("predicted") for s in syss}}
    (args.out / f"convergence-{stamp}.json").write_text(json.dumps(raw, indent=1))
    print(f"figure: {shown(png)}\nraw results: {shown(args.out / f'convergence-{stamp}.json')}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
