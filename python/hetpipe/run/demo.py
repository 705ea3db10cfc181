"""The demo's per-rank program: train an MLP on scikit-learn's digits under a given plan, report accuracy.

Run on every rank: ``mpiexec -n N python -m hetpipe.run.demo --plan plan.json --out DIR``
(``hetpipe demo`` plans, then starts this). Rank 0 prints the test accuracy and the measured
throughput beside two predictions for the same plan (the planner's cost model and
``hetpipe.schedule.simulate_plan``), and writes ``DIR/result.json`` and the run's WSP record
``DIR/record.json`` (for ``Trainer.replay(record=...)``); the last stage of VW 0 shows
progress and writes ``DIR/metrics.jsonl`` and ``DIR/trace.json``. Exits non-zero if training fails
or the accuracy is below ``--min-accuracy``.

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
from hetpipe.run.config import Reporting, Runtime


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
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--plan", required=True)
    p.add_argument("--out", default="hetpipe-demo-out")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--emulation-scale", type=float, default=1.0)
    p.add_argument("--min-accuracy", type=float, default=0.0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from mpi4py import MPI

    from hetpipe.run.data import Batches, digits
    from hetpipe.run.trainer import Trainer

    out = Path(args.out)
    x_tr, y_tr, x_te, y_te = digits()
    model = digits_model()
    trainer = Trainer(model, loss_fn, optimizer, Batches(x_tr, y_tr, args.batch, seed=0), plan=args.plan,
                      epochs=args.epochs,
                      reporting=Reporting(metrics=out / "metrics.jsonl", trace=out / "trace.json", progress=not args.no_progress, record=out / "record.json"),
                      runtime=Runtime(emulation_scale=args.emulation_scale))
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
