"""The Quick start's demo: an MLP on scikit-learn's digits, planned for an emulated heterogeneous cluster on
this machine and trained on several MPI ranks (each emulating a GPU type) under that plan.

    python examples/demo.py [--epochs 12] [--cluster cpu-emulated] [--nm 2] [--d 1] [--out hetpipe-demo-out]

It profiles the model on the cluster preset, plans it, prints the plan table and writes ``OUT/plan.json``
(``--plan FILE`` uses a plan instead), then starts itself on the plan's ranks under mpiexec with
``--rank``: ``mpiexec -n N python examples/demo.py --rank --plan plan.json --out DIR`` runs that part
alone. Rank 0 prints the test accuracy and the measured throughput beside two predictions for the
same plan (the planner's cost model and ``hetpipe.schedule.simulate_plan``), and writes
``DIR/result.json`` and the run's WSP record ``DIR/record.json`` (for ``Trainer.replay(record=...)``);
the last stage of VW 0 shows progress and writes ``DIR/metrics.jsonl`` and ``DIR/trace.json``. Exits
non-zero if training fails or the accuracy is below ``--min-accuracy``; bad options and an unwritable
``--out`` are one line on stderr and exit status 2.

The demo's emulated devices are slowed down (``slowed``) so that their padded instruction times
dominate the Python and polling overheads of many ranks sharing a few host cores; otherwise the
measurement would mostly show the host, not the schedule.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

from hetpipe.util.numbers import arg_fraction, arg_seconds, arg_whole


def digits_model(seed: int = 0, hidden: int = 128) -> nn.Sequential:
    """The demo model: 64 -> hidden -> hidden -> 10, as 6 layers a plan can partition."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden // 2), nn.Linear(hidden // 2, 10))


def slowed(cluster, factor: float):
    """``cluster`` with every device type ``factor`` times slower (emulated clusters only)."""
    import dataclasses

    if factor <= 0:
        raise ValueError(f"the slow-down factor must be > 0, got {factor}")
    if not cluster.emulated:
        raise ValueError(f"cluster {cluster.name!r} has real devices; only emulated devices can be slowed down")
    types = {n: dataclasses.replace(t, speed=t.speed / factor) for n, t in cluster.device_types.items()}
    return dataclasses.replace(cluster, device_types=types)


def predictions(plan, minibatches_per_vw: int, batch: int) -> dict:
    """Predicted samples/s of ``plan``: the planner's cost model, and a simulation of the waves run."""
    from hetpipe.schedule import simulate_plan

    waves = max(1, -(-minibatches_per_vw // plan.nm))
    return {"cost_model": plan.throughput * batch, "simulated": simulate_plan(plan, waves).throughput * batch,
            "simulated_waves": waves}


def _vs(measured: float, predicted: float) -> str:
    """``"<predicted> (measured/predicted <ratio>)"``, or why there is no prediction."""
    if predicted <= 0:
        return "nothing (the plan carries no stage times)"
    return f"{predicted:.0f} (measured/predicted {measured / predicted:.2f})"


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="hetpipe-demo-out", help="output directory (default ./hetpipe-demo-out)")
    p.add_argument("--epochs", type=arg_whole("--epochs"), default=12, help="training epochs (default 12)")
    p.add_argument("--cluster", default="cpu-emulated", help="cluster preset to plan for (default cpu-emulated)")
    p.add_argument("--policy", default="auto", help="VW formation policy (default auto)")
    p.add_argument("--nm", type=arg_whole("--nm"), default=2, help="minibatches in flight per VW (default 2)")
    p.add_argument("--d", type=arg_whole("--d", 0), default=1, help="WSP staleness bound D (default 1)")
    p.add_argument("--batch", type=arg_whole("--batch"), default=32, help="minibatch size (default 32)")
    p.add_argument("--plan", help="use this plan JSON instead of planning")
    p.add_argument("--slowdown", type=arg_seconds("--slowdown"), default=12.0,
                   help="plan for emulated devices this many times slower than the preset, so that device "
                        "time dominates host overheads (default 12)")
    p.add_argument("--emulation-scale", type=arg_seconds("--emulation-scale"), default=1.0,
                   help="multiply emulated device times at run time only (the plan's predictions do not follow)")
    p.add_argument("--min-accuracy", type=arg_fraction("--min-accuracy"), default=0.9,
                   help="fail below this test accuracy (default 0.9)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--rank", action="store_true", help="run one rank's part of the training under mpiexec "
                                                       "(needs --plan; without it, the demo plans and starts them)")
    args = p.parse_args(argv)
    if args.rank:
        if not args.plan:
            p.error("--rank needs --plan")
        return train(args)
    return plan_and_launch(args)


def plan_and_launch(args) -> int:
    """Plan (or load ``--plan``), write ``OUT/plan.json``, run :func:`train` on the plan's ranks."""
    from hetpipe.job.world import MPIUnavailable
    from hetpipe.launch.mpiexec import launch
    from hetpipe.util.outputs import OutputError, check_dir, write_file

    try:
        out = check_dir("--out", args.out)
    except OutputError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    plan_path = out / "plan.json"
    try:
        plan = make_demo_plan(args)
    except ValueError as e:
        print(f"demo: planning failed: {e}", file=sys.stderr)
        return 2
    try:
        write_file("--out", plan_path, plan.save)
    except OutputError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    print(f"launching {plan.num_ranks} ranks ({plan.num_stage_ranks} stages, {len(plan.ps_shards)} PS shard(s))")
    rank_argv = [str(Path(__file__).resolve()), "--rank", "--plan", str(plan_path), "--out", str(out),
                 "--epochs", str(args.epochs), "--batch", str(args.batch),
                 "--emulation-scale", str(args.emulation_scale), "--min-accuracy", str(args.min_accuracy)]
    try:
        rc = launch(plan.num_ranks, rank_argv + (["--no-progress"] if args.no_progress else []))
    except MPIUnavailable as e:
        print(e, file=sys.stderr)
        return 2
    if rc == 0:
        print(f"metrics: {out / 'metrics.jsonl'}  trace: {out / 'trace.json'}  plan: {plan_path}")
    else:
        print(f"demo: the run failed (exit status {rc})", file=sys.stderr)
    return rc


def make_demo_plan(args):
    """Profile the digits model on the cluster preset (slowed down), plan it, print the plan table."""
    from hetpipe.plan import format_plan, make_plan
    from hetpipe.plan.types import Plan

    if args.plan:
        plan = Plan.load(args.plan)
    else:
        from hetpipe.model.measure import profile_model
        from hetpipe.plan.cluster import load_cluster
        from hetpipe.run.data import digits

        torch.set_num_threads(1)
        cluster = slowed(load_cluster(args.cluster), args.slowdown)
        x, y, _, _ = digits()
        sample = x[:args.batch]
        profile = profile_model(digits_model(), sample, cluster, loss_fn=lambda out: loss_fn(out, y[:args.batch]))
        plan = make_plan(cluster, profile, policy=args.policy, nm=args.nm, d=args.d, minibatch_size=args.batch)
    print(format_plan(plan))
    return plan


def train(args) -> int:
    """One rank's part: train under ``args.plan``; rank 0 reports and writes ``result.json``."""
    from mpi4py import MPI

    from hetpipe.run.data import Batches, digits
    from hetpipe import Reporting, Runtime, Trainer

    out = Path(args.out)
    x_tr, y_tr, x_te, y_te = digits()
    model = digits_model()
    trainer = Trainer(model, loss_fn, optimizer, Batches(x_tr, y_tr, args.batch, seed=0), plan=args.plan,
                      epochs=args.epochs, runtime=Runtime(emulation_scale=args.emulation_scale),
                      reporting=Reporting(metrics=out / "metrics.jsonl", trace=out / "trace.json",
                                          progress=not args.no_progress, record=out / "record.json"))
    result = trainer.fit()
    acc = accuracy(model, x_te, y_te)
    if MPI.COMM_WORLD.Get_rank() == 0:
        per_vw = len(next(iter(result.losses.values()), {}))
        pred = predictions(result.plan, per_vw, args.batch)
        summary = {"test_accuracy": acc, "final_loss": result.final_loss(), "samples": result.samples,
                   "elapsed_s": result.elapsed_s, "samples_per_s": result.samples_per_s,
                   "emulated_devices": result.emulated, "nm": result.plan.nm, "d": result.plan.d,
                   "virtual_workers": len(result.plan.virtual_workers),
                   "predicted_samples_per_s": pred}
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(summary, indent=2))
        emu = "devices emulated" if result.emulated else "real devices"
        rate = result.samples_per_s
        print(f"trained {result.samples} samples in {result.elapsed_s:.1f} s; final loss {summary['final_loss']:.4f}")
        print(f"throughput ({emu}): measured {rate:.0f} samples/s; predicted {_vs(rate, pred['cost_model'])} by "
              f"the plan's cost model, {_vs(rate, pred['simulated'])} by simulate_plan over "
              f"{pred['simulated_waves']} waves")
        print(f"test accuracy: {100 * acc:.2f}%", flush=True)
    return 0 if acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
