"""End-to-end benchmark: hetpipe (D = 0 and D > 0) beside DDP, torch.distributed.pipelining and the limit.

Usage: python bench/e2e/run.py [--quick] [--keep DIR]

Every system trains the same MLP on the same emulated heterogeneous cluster in this one run, each
launched under mpiexec with one rank per device (hetpipe adds its PS ranks). Devices are emulated:
each rank runs the real computation and pads it to its device type's profiled time (see README.md).
Prints one table of measured samples/s beside predicted samples/s, then per-rank padding figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import predict  # noqa: E402
from config import RunConfig  # noqa: E402
from launch import run_worker  # noqa: E402
from model import ModelSpec  # noqa: E402
from cluster_setup import CLUSTER, make_device_model, make_plan, memory_notes  # noqa: E402
from table import main_table, rank_table  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and waves (a smoke run, noisier figures)")
    ap.add_argument("--depth", type=int, default=18)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--minibatch", type=int, default=256)
    ap.add_argument("--nm", type=int, default=6, help="hetpipe minibatches in flight per VW")
    ap.add_argument("--d", default="0,2", help="hetpipe staleness bounds to run, comma separated")
    ap.add_argument("--policy", default="auto", help="hetpipe VW formation policy (NP, ED, HD, auto)")
    ap.add_argument("--only", default="limit,ddp,pipelining,hetpipe", help="systems to run, comma separated")
    ap.add_argument("--pp-schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per system launch")
    ap.add_argument("--keep", type=Path, help="keep the device model, plans and raw results here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="hetpipe-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec(depth=args.depth, width=args.width, minibatch=args.minibatch)
    dm, prof, cluster = make_device_model(spec)
    dm.save(work / "devices.json")
    plan, planner = make_plan(dm, prof, cluster, nm=args.nm, policy=args.policy)
    plan.save(work / "plan.json")
    per_wave = len(plan.virtual_workers) * plan.nm          # minibatches per wave, whole cluster
    waves, skip = (4, 1) if args.quick else (8, 2)
    cfg = RunConfig(spec=spec, device_model=str(work / "devices.json"), global_batch=per_wave * spec.minibatch,
                    microbatches=per_wave, pp_schedule=args.pp_schedule,
                    warmup=1 if args.quick else 2, steps=2 if args.quick else 5,
                    extra={"plan": str(work / "plan.json"), "waves": waves, "skip_waves": skip})

    ndev = len(dm.devices)
    systems = [("limit", "standalone limit", "standalone_worker.py", None, predict.limit_rate(dm), {}),
               ("ddp", "DDP (gloo)", "ddp_worker.py", ndev, predict.ddp_rate(dm, spec.depth, cfg.global_batch), {}),
               ("pipelining", f"torch pipelining {args.pp_schedule}", "pipelining_worker.py", ndev,
                predict.pipelining_rate(dm, spec.depth, cfg.microbatches, args.pp_schedule), {})]
    for d in [int(x) for x in args.d.split(",")]:
        pd = dataclasses.replace(plan, d=d)
        systems.append((f"hetpipe{d}", f"hetpipe D={d}", "hetpipe_worker.py", plan.num_ranks,
                        predict.hetpipe_rate(pd, waves, skip), {"d": d}))

    only = set(args.only.split(","))
    systems = [s for s in systems if s[0].rstrip("0123456789") in only]
    rows, raw = [], {}
    for key, label, script, ranks, predicted, extra in systems:
        c = RunConfig(**{**cfg.__dict__, "extra": {**cfg.extra, **extra}})
        c.save(work / f"{key}.cfg.json")
        print(f"running {label} ({ranks or 1} process{'es' if ranks else ''}) ...", flush=True)
        row = {"key": key, "system": label, "predicted": predicted}
        try:
            res = run_worker(script, ranks, work / f"{key}.cfg.json", work / f"{key}.result.json", args.timeout)
            raw[label] = res
            row.update(measured=res["samples_per_s"], note=res.get("note", ""))
        except RuntimeError as e:
            lines = str(e).strip().splitlines()
            row["error"] = next((l for l in reversed(lines) if "failed:" in l), lines[-1])[:140]
            print(str(e)[-2000:], file=sys.stderr)
        rows.append(row)

    mem = memory_notes(dm, prof, cluster, cfg.global_batch // ndev)
    nranks = max(ndev, plan.num_ranks)
    where = ("emulated" if not torch.cuda.is_available() else
             "emulated (CUDA present, but the real-device path is not implemented)")
    types = ", ".join(f"{sum(1 for _, u in dm.devices if u == t)}x {t} "
                      f"({dm.minibatch_time(t) / (sum(dm.host_fwd) + sum(dm.host_bwd)):.1f}x host time)"
                      for t in dm.types)
    header = "\n".join([
        f"devices: {where} ({nranks} ranks on this host, {torch.get_num_threads()} torch thread each); {types}",
        f"cluster: {CLUSTER}; device model: {dm.source}; plan: {planner}; model: MLP {spec.depth} layers x {spec.width}, "
        f"minibatch {spec.minibatch}; global batch {cfg.global_batch} (= {per_wave} minibatches = one hetpipe wave)",
        "measured: steady state (warm-up excluded); predicted: simulator (hetpipe, pipelining) or device model "
        "(DDP, limit), compute and links only"])
    print()
    print(main_table(rows, header))
    print()
    print(rank_table(raw))
    for t, why in mem.items():
        print(f"memory: {why}: DDP and the standalone limit would not fit there on real devices; "
              "they run here on compute time only")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.get("measured") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
