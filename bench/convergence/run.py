"""Time to accuracy: hetpipe (D and aggregation rules) beside data-parallel baselines and torch pipelining.

Usage: python bench/convergence/run.py [--quick] [--task small|large] [--out DIR] [--keep DIR]

The baselines: DDP on every device, DDP on the fastest devices that hold the model (the subset with the
highest predicted throughput, baselines.fast_subset), heterogeneity-aware data parallelism (per-device
batch proportional to speed, loss weighted by share, baselines.batch_split) and torch pipelining.
Every system trains the same byte-level GPT (task.py) on the same emulated heterogeneous cluster
(bench/e2e's device model and launch machinery), for the same wall-clock budget. Each system's
learning rate is the best of a sweep (seed 0, lowest validation loss at the sweep's budget,
``--sweep-budget``); the best is then run on every seed at ``--budget`` (on the other seeds only when
the two budgets are equal: the sweep's run is then seed 0's). Runs share launches (a launch's
start-up costs tens of seconds of a loaded host): the sweep is one launch per launch group (DDP and
heterogeneity-aware DP, 6 ranks of one script; DDP on the fastest devices; pipelining; every hetpipe
variant, which all run the same plan on the same ranks, alternating within the launch), each later
seed another pass over the groups, so load changes on the host fall on every system alike. Weights
are recorded during training and validated after each run (snapshots.py). Prints the sweep, the
summary (time to target, loss at the budget, spread over seeds), the goal lines; writes a PNG and the
raw JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from baselines import batch_split, fast_subset, step_time  # noqa: E402
from cluster_setup import CLUSTER, make_plan, memory_notes, profile_device_model  # noqa: E402
from curves import validation_curve  # noqa: E402
from hetpipe.plan.waves import with_waves  # noqa: E402
from hetpipe.schedule import simulate_plan  # noqa: E402
from job import Job, save_jobs  # noqa: E402
from launch import run_worker  # noqa: E402
from task import PRESETS, MinibatchStream, build_layers, corpus, loss_fn, uniform_loss, validation_set  # noqa: E402

LABELS = {"ddp": "DDP (gloo)", "ddp-fast": "DDP, fastest devices", "hetero-dp": "hetero-aware DP",
          "pipelining": "torch pipelining 1F1B"}
SYSTEMS = "ddp,ddp-fast,hetero-dp,pipelining,hetpipe"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 s budget, 2 learning rates, 2 seeds, D in {0, 4} (figures not meaningful)")
    ap.add_argument("--task", choices=sorted(PRESETS), default="small",
                    help="small: the 196k-parameter GPT; large: 2.05M parameters (other defaults: see README)")
    ap.add_argument("--budget", type=float, default=18.0, help="seconds of training wall time per run")
    ap.add_argument("--sweep-budget", type=float,
                    help="seconds of training per run of the learning-rate sweep (default: --budget)")
    ap.add_argument("--lrs", default="3e-3,1e-2,3e-2", help="learning rates of the sweep (every system)")
    ap.add_argument("--seeds", default="0,1,2", help="seeds; the sweep runs on the first")
    ap.add_argument("--d", default="0,1,4", help="hetpipe staleness bounds")
    ap.add_argument("--aggregate", default="auto",
                    help="hetpipe aggregation rules, comma separated (auto: sum and mean)")
    ap.add_argument("--only", default=SYSTEMS, help=f"systems to run (of {SYSTEMS})")
    ap.add_argument("--nm", type=int, help="hetpipe minibatches in flight per VW (default: the planner's choice)")
    ap.add_argument("--policy", default="auto", help="hetpipe VW formation policy (NP, ED, HD, auto)")
    ap.add_argument("--waves", choices=("equal", "speed"), default="equal",
                    help="hetpipe's waves: equal (Nm each) or speed (each VW's proportional to its speed)")
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
    known = ap.parse_known_args(argv)[0]
    if known.task == "large":                   # --task and --quick change the defaults; explicit options win
        ap.set_defaults(lrs="1e-3,3e-3,1e-2", snapshot_every=3.0)
    if known.quick:
        ap.set_defaults(budget=8.0, lrs="3e-3,1e-2", seeds="0,1", d="0,4", snapshot_every=0.5)
    args = ap.parse_args(argv)
    if args.sweep_budget is None:
        args.sweep_budget = args.budget
    unknown = set(args.only.split(",")) - set(SYSTEMS.split(","))
    if unknown:
        ap.error(f"--only: unknown system(s) {sorted(unknown)} (known: {SYSTEMS})")
    return args


def systems(args, plan, choice: dict) -> List[dict]:
    """The systems of the run: key, label, worker script, ranks, per-system job fields. ``choice`` holds
    the data-parallel baselines' device subset and batch split (:func:`dp_choices`)."""
    out = []
    only = set(args.only.split(","))
    ndev = None
    if "ddp" in only:
        out.append({"key": "ddp", "label": LABELS["ddp"], "group": "ddp", "script": "train_ddp.py", "ranks": ndev,
                    "job": {}})
    if "hetero-dp" in only:
        # Same script and ranks as DDP: one launch serves both.
        out.append({"key": "hetero-dp", "label": LABELS["hetero-dp"], "group": "ddp", "script": "train_ddp.py",
                    "ranks": ndev, "job": {"windows": choice["windows"]}})
    if "ddp-fast" in only:
        out.append({"key": "ddp-fast", "label": LABELS["ddp-fast"], "group": "ddp-fast", "script": "train_ddp.py",
                    "ranks": len(choice["subset"].devices), "job": {"devices": list(choice["subset"].devices)}})
    if "pipelining" in only:
        out.append({"key": "pipelining", "label": LABELS["pipelining"], "group": "pipelining",
                    "script": "train_pipelining.py", "ranks": ndev, "job": {}})
    if "hetpipe" in only:
        aggs = args.aggregate.split(",") if args.aggregate != "auto" else ["sum", "mean"]
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
    per_wave = plan.minibatches_per_wave
    waves = 1
    while simulate_plan(pd, waves=waves).makespan_s < budget * margin:
        waves += 1
    every = max(1, round(snapshot_every * rate / plan.minibatch_size / per_wave))
    return waves * per_wave, every, rate


def dp_choices(dm, prof, cluster, minibatch: int) -> dict:
    """The data-parallel baselines' choices from the device model: the fastest-devices subset (devices
    whose memory holds the model with one minibatch), the speed-proportional batch split of DDP's step
    (one minibatch per device), and lines saying what was chosen and why."""
    ndev = len(dm.devices)
    times = [dm.minibatch_time(t) for _, t in dm.devices]
    misfit = memory_notes(dm, prof, cluster, minibatch)
    fits = [t not in misfit for _, t in dm.devices]
    sub = fast_subset(times, fits, minibatch)
    windows = batch_split(times, ndev * minibatch)
    heavy = {t: max(w for w, (_, u) in zip(windows, dm.devices) if u == t) for t in dm.types}
    misfit_h = {t: why for t in dm.types for why in [memory_notes(dm, prof, cluster, heavy[t]).get(t)] if why}
    names = [f"{dm.devices[i][0]} ({dm.devices[i][1]})" for i in sub.devices]
    lines = [
        "DDP on the fastest devices: " + ", ".join(names) + f"; predicted {sub.rate:.0f} samples/s, the highest of "
        "the k fastest devices holding the model, k x minibatch / slowest member's minibatch time: "
        + ", ".join(f"k={k} {r:.0f}" for k, r in sub.candidates) + " (ties: fewer devices); memory: "
        + ("; ".join(misfit.values()) if misfit else "every device holds the whole model"),
        f"hetero-aware DP: windows per step {dict(zip((d for d, _ in dm.devices), windows))} ({ndev * minibatch} in "
        f"all, as DDP's {ndev} minibatches; shares proportional to device speed, largest remainder, each >= 1); "
        f"each rank padded to its type's time for its windows (per-window linear); loss weighted by share; "
        f"predicted {ndev * minibatch / step_time(times, windows, minibatch):.0f} samples/s; memory: "
        + ("; ".join(misfit_h.values()) if misfit_h else "every device holds the model with its share")]
    return {"subset": sub, "windows": windows, "lines": lines, "fits": fits}


def shown(path: Path) -> str:
    """``path`` as printed and recorded: relative to the repository when inside it, else its name alone."""
    try:
        return str(Path(path).resolve().relative_to(HERE.parents[1]))
    except ValueError:
        return Path(path).name


def best_lrs(runs: List[dict], syss: List[dict], failed: Dict[str, str], budget: float) -> Dict[str, float]:
    """Per system still running, the learning rate of its sweep run with the lowest validation loss at
    ``budget`` (the sweep's)."""
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
    the emulated device model (profiled here, saved as ``work/devices.json``), the plan made on it
    (``work/plan.json``) with its planner's description, and the profile and cluster spec behind them."""
    task = PRESETS[getattr(args, "task", "small")]
    text, val_text, about = corpus(task)
    x0, y0 = MinibatchStream(text, task, 0, 1)[0]
    dm, prof, cluster = profile_device_model(build_layers(task, 0), x0, lambda out: loss_fn(out, y0),
                                             f"bytegpt{task.blocks}x{task.width}", optimizer_factor=2.0,
                                             trials=args.profile_trials, slowdown=args.slowdown,
                                             profile_file=getattr(args, "profile_file", None))
    dm.save(work / "devices.json")
    plan, planner = make_plan(dm, prof, cluster, nm=nm, policy=policy)
    plan = with_waves(plan, getattr(args, "waves", "equal"))
    plan.save(work / "plan.json")
    return task, about, validation_set(val_text, task), dm, plan, planner, prof, cluster


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="hetpipe-conv-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    started = time.time()
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} ({os.cpu_count()} cores)", flush=True)
    task, about, (xv, yv), dm, plan, planner, prof, cluster = prepare(args, work, nm=args.nm, policy=args.policy)
    ndev = len(dm.devices)
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    choice = dp_choices(dm, prof, cluster, task.minibatch)
    syss = systems(args, plan, choice)
    for s in syss:
        s["ranks"] = s["ranks"] or ndev
        if s["key"].startswith("hetpipe"):
            s["job"]["plan"] = str(work / "plan.json")
            s["predicted"] = hetpipe_size(plan, s["job"]["d"], args.budget, args.margin, args.snapshot_every)[2]
    same_budget = args.sweep_budget == args.budget

    types = ", ".join(f"{sum(1 for _, u in dm.devices if u == t)}x {t} "
                      f"({dm.minibatch_time(t) / (sum(dm.host_fwd) + sum(dm.host_bwd)):.1f}x host time, "
                      f"{dm.minibatch_time(t) * 1e3:.0f} ms/minibatch)" for t in dm.types)
    vws = "; ".join(f"VW {v.index}: " + " | ".join(f"{st.device_type} L{st.start}-{st.stop - 1}" for st in v.stages)
                    for v in plan.virtual_workers)
    header = [
        f"device model: {dm.source}",
        f"devices: EMULATED (real computation padded to each device type's profiled time; {torch.get_num_threads()} "
        f"torch thread per rank); cluster {CLUSTER}: {types}",
        f"task ({args.task}): byte-level GPT {task.blocks} blocks x {task.width} wide, {task.heads} heads, context {task.context}, "
        f"{sum(p.numel() for l in build_layers(task, 0) for p in l.parameters())} parameters; Adam; minibatch "
        f"{task.minibatch} windows; text: Python {about['stdlib']} standard library ({about['train_files']} files, "
        f"{about['train_bytes']} bytes train; {about['val_files']} held-out files, {task.val_windows} windows of "
        f"{task.context} validated); uniform guess = {uniform_loss():.3f} nats/byte",
        f"plan: {planner}, Nm={plan.nm if plan.equal_waves else list(plan.wave_minibatches)}, "
        f"{len(plan.ps_shards)} PS shard(s); {vws}",
        f"device model throughputs (compute only): cluster limit {predict.limit_rate(dm):.0f} samples/s (sum of "
        f"the devices' standalone rates); DDP {predict.ddp_rate(dm, len(dm.fwd[dm.types[0]]), ndev * task.minibatch):.0f} "
        f"(every step waits for the slowest device's minibatch); pipelining "
        f"{predict.pipelining_rate(dm, len(dm.fwd[dm.types[0]]), ndev, '1f1b'):.0f}; hetpipe "
        f"plan {predict.hetpipe_rate(plan, 8, 2):.0f}",
        *choice["lines"],
        f"DDP: {ndev} ranks x 1 minibatch per step; pipelining: uniform split over {ndev} stages, {ndev} "
        f"micro-batches (1 minibatch each) per step; budget {args.budget:g} s training wall time per run "
        f"(learning-rate sweep: {args.sweep_budget:g} s per run" + (", seed 0's sweep run is its final run)" if
                                                                   same_budget else "; every seed rerun at the budget)"),
        "validation: weights recorded every ~%g s during training (hetpipe: the PS's global weights W_g at wave "
        "ends), validated after the run (no training time spent on it)" % args.snapshot_every]
    print("\n".join(header), flush=True)

    runs: List[dict] = []
    failed: Dict[str, str] = {}

    def job_fields(s: dict, budget: float) -> dict:
        """The system's job fields; hetpipe's run length and snapshot interval depend on the budget."""
        if not s["key"].startswith("hetpipe"):
            return s["job"]
        n, every, _ = hetpipe_size(plan, s["job"]["d"], budget, args.margin, args.snapshot_every)
        return {**s["job"], "minibatches": n, "snapshot_waves": every}

    def run_batch(batch: List[Tuple[dict, int, float]], phase: str, budget: float) -> None:
        """One launch training each ``(system, seed, lr)`` of ``batch`` in turn for ``budget`` seconds
        (systems of one launch group: same script and ranks); validates each run."""
        if not batch:
            return
        first = batch[0][0]
        tag = f"{first['group']}-{phase}{len(runs)}"
        jobs = [Job(system=s["key"], task=task, seed=seed, lr=lr, budget_s=budget,
                    snapshot_every_s=args.snapshot_every, device_model=str(work / "devices.json"),
                    snapshots=str(work / f"{tag}-{k}.npz"), micro=ndev,
                    record=str(work / f"{tag}-{k}.record.json") if s["key"].startswith("hetpipe") else "",
                    **job_fields(s, budget))
                for k, (s, seed, lr) in enumerate(batch)]
        save_jobs(work / f"{tag}.jobs.json", jobs)
        load = os.getloadavg()[0]
        try:
            res = run_worker(HERE / first["script"], first["ranks"], work / f"{tag}.jobs.json",
                             work / f"{tag}.result.json", timeout_s=len(jobs) * (3 * budget + 60) + 120)
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
                         "budget_s": budget,
                         "curve": curve, "end_s": end, "samples": r["samples"], "wall_s": r["wall_s"],
                         "overrun_frac": over, "load_at_launch": load, "launch_s": res["elapsed_s"],
                         "note": r.get("note", ""), "ranks": r["ranks"],
                         **{k: r[k] for k in ("snapshot_steps", "snapshot_versions") if k in r},
                         **({"record": job.record} if job.record else {})})
            print(f"  {s['label']:<24} seed {job.seed} lr {job.lr:<6.3g} val loss {curve[-1][1]:.3f} at "
                  f"{curve[-1][0]:5.1f} s, {r['samples'] / r['wall_s']:6.0f} samples/s, overrun {100 * over:4.1f}%",
                  flush=True)
        print(f"    (launch of {len(jobs)} run(s): {res['elapsed_s']:.0f} s, load average {load:.1f} at its start)",
              flush=True)

    def groups() -> List[List[dict]]:
        live = [s for s in syss if s["key"] not in failed]
        return [[s for s in live if s["group"] == g] for g in dict.fromkeys(s["group"] for s in live)]

    print(f"\nseed {seeds[0]}: learning-rate sweep {lrs}, {args.sweep_budget:g} s per run", flush=True)
    for g in groups():
        run_batch([(s, seeds[0], lr) for lr in lrs for s in g], "sweep", args.sweep_budget)
    best = best_lrs(runs, syss, failed, args.sweep_budget)
    # A best learning rate at the edge of the grid may not be the system's best: one more value past that
    # edge (the grid's ratio), for every system alike.
    edge = {k: extend(lrs, lr) for k, lr in best.items()}
    if any(edge.values()):
        print(f"\nseed {seeds[0]}: sweep extended past its edge where the best learning rate sits there", flush=True)
        for g in groups():
            run_batch([(s, seeds[0], edge[s["key"]]) for s in g if edge[s["key"]]], "sweep", args.sweep_budget)
        best = best_lrs(runs, syss, failed, args.sweep_budget)
    for seed in (seeds[1:] if same_budget else seeds):
        print(f"\nseed {seed} at each system's best learning rate, {args.budget:g} s per run", flush=True)
        for g in groups():
            run_batch([(s, seed, best[s["key"]]) for s in g if s["key"] in best], "seed", args.budget)

    final = [r for r in runs if r["key"] in best and r["lr"] == best[r["key"]] and r["budget_s"] == args.budget]
    target = args.target if args.target is not None else report.choose_target(final, args.budget)
    order = [s["key"] for s in syss]
    rows = sorted(report.summarize(final, target, args.budget), key=lambda r: order.index(r["key"]))
    load1 = os.getloadavg()
    print()
    print("\n".join(header))
    print(f"\nlearning-rate sweep, seed {seeds[0]}, {args.sweep_budget:g} s per run: validation loss at "
          f"{args.sweep_budget:g} s (* = best, used below)")
    print(report.sweep_table([r for r in runs if r["phase"] == "sweep"], best, args.sweep_budget))
    still = [s["label"] for s in syss if s["key"] in best and
             extend(sorted({r["lr"] for r in runs if r["key"] == s["key"]}), best[s["key"]])]
    if still:
        print(f"best learning rate still at the edge of the (extended) sweep: {', '.join(still)}")
    how = "given" if args.target is not None else "the lowest loss (rounded up to 0.01) that every run below reaches within the budget"
    print(f"\ntarget validation loss {target:.2f} nats/byte ({how}); seeds {seeds}, {args.budget:g} s per run "
          f"(the sweep above: {args.sweep_budget:g} s per run); times are training wall-clock seconds on EMULATED "
          "devices")
    print(report.summary_table(rows, args.budget))
    print()
    print("\n".join(report.goal_lines(rows)))
    for key, why in failed.items():
        print(f"FAILED and left out: {next(x['label'] for x in syss if x['key'] == key)}: {why}")
    print(f"\nload average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; whole run {time.time() - started:.0f} s")
    stamp = ("quick" if args.quick else "full") + ("-large" if args.task == "large" else "")
    png = args.out / f"convergence-{stamp}.png"
    report.plot(final, target, args.budget, png,
                f"byte-level GPT ({args.task}) on the {CLUSTER} cluster (EMULATED devices), best LR per system, mean and range over "
                f"{len(seeds)} seeds")
    raw = {"args": {k: shown(v) if isinstance(v, Path) else str(v) for k, v in vars(args).items()},
           "header": header, "corpus": about,
           "task": task.to_dict(), "device_model": dataclasses.asdict(dm), "plan": json.loads(plan.to_json()),
           "target": target, "best_lr": best, "budgets": {"sweep_s": args.sweep_budget, "final_s": args.budget},
           "dp_choices": {"fast_subset": list(choice["subset"].devices), "fast_subset_rate": choice["subset"].rate,
                          "hetero_windows": choice["windows"], "lines": choice["lines"]}, "summary": rows, "runs": runs, "failed": failed,
           "load_start": load0, "load_end": load1, "predicted_hetpipe_samples_per_s":
               {s["key"]: s.get("predicted") for s in syss}}
    (args.out / f"convergence-{stamp}.json").write_text(json.dumps(raw, indent=1))
    print(f"figure: {shown(png)}\nraw results: {shown(args.out / f'convergence-{stamp}.json')}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
