"""hetpipe's host overhead: one VW of 2 stages + 1 PS shard, no device emulation, beside a plain loop.

Both run here, on the host CPU, one torch thread per process, on the same model, minibatches and
optimizer (SGD). hetpipe runs under ``mpiexec -n 3`` (two stage ranks, one PS rank) with pacing off
(``Trainer(emulate=False)``): what it adds to the plain step is the runtime's own cost (instruction
dispatch, weight stashes, message headers and copies, MPI progress, the PS round trip per wave).

Steady state: each configuration trains ``--short`` and ``--long`` minibatches and the time per
minibatch is the difference of the two training times over the difference of their lengths, so
start-up, pipeline fill and drain cancel out. The plain loop is timed the same way (two lengths).

Rows, each for both stage data planes (``core``: the core's StageEndpoint moves the messages;
``python``: mpi4py requests progressed between instructions, ``HETPIPE_STAGE_PLANE``):
- tiny: an MLP whose plain step is well under a millisecond. ``overhead/stage`` = hetpipe's time per
  minibatch minus the plain step's share per stage (plain / 2): the fixed cost a stage adds per
  minibatch. Goal: <= 0.3 ms.
- compute: an MLP whose plain step is ~10 ms. ``speed-up`` = hetpipe samples/s over the plain
  single-thread loop's. Goal: >= 1.6x on 2 cores (two stages computing at once; ideal 2x).

    python bench/host_overhead.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve()
MODELS = {"tiny": {"width": 32, "depth": 6, "batch": 16},
          "compute": {"width": 448, "depth": 6, "batch": 64}}
GOAL_OVERHEAD_MS = 0.3
GOAL_SPEEDUP = 1.6


def _model(name: str):
    import torch
    from torch import nn

    m = MODELS[name]
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for i in range(m["depth"] - 1):
        layers += [nn.Sequential(nn.Linear(m["width"], m["width"]), nn.ReLU())]
    layers.append(nn.Linear(m["width"], 10))
    return layers


def _data(name: str, n: int):
    import torch

    from hetpipe import Batches

    m = MODELS[name]
    g = torch.Generator().manual_seed(1)
    return Batches(torch.randn(n * m["batch"], m["width"], generator=g),
                   torch.randint(0, 10, (n * m["batch"],), generator=g), m["batch"], seed=1)


def worker(args) -> None:
    """One rank of a hetpipe run: train ``args.n`` minibatches, rank 0 prints the training time."""
    import torch
    from torch import nn

    from hetpipe import Trainer
    from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan

    torch.set_num_threads(1)
    layers = _model(args.model)
    cut = len(layers) // 2
    stages = (StagePlan("cpu", "cpu", 0, cut, 0.0, 0.0), StagePlan("cpu", "cpu", cut, len(layers), 0.0, 0.0))
    plan = Plan(len(layers), args.nm, 0, "manual", (VirtualWorkerPlan(0, stages),),
                (ShardPlan(0, "n0", tuple(range(len(layers)))),))
    r = Trainer(layers, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.01), _data(args.model, args.n),
                plan=plan, epochs=1, progress=False, emulate=False).fit()
    if r.rank == 0:
        print("RESULT " + json.dumps({"elapsed_s": r.elapsed_s, "samples": r.samples}), flush=True)


def plain(name: str, n: int) -> float:
    """Seconds of ``n`` plain training steps (after a warm-up), one thread."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    model = nn.Sequential(*_model(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = list(_data(name, n + 5))
    for i, (x, y) in enumerate(batches):
        if i == 5:
            t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return time.perf_counter() - t0


def _run(model: str, nm: int, n: int, plane: str) -> float:
    from hetpipe.launch.mpiexec import mpiexec_path

    env = {**os.environ, "HETPIPE_STAGE_PLANE": plane, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([mpiexec_path(), "-n", "3", sys.executable, str(HERE), "--worker", "--model", model,
                           "--nm", str(nm), "--n", str(n)], capture_output=True, text=True, timeout=600, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["elapsed_s"]
    raise RuntimeError(f"host_overhead: the {model} run (Nm {nm}, {plane}) failed:\n{proc.stdout}\n{proc.stderr}")


def measure(model: str, nm: int, short: int, long: int, reps: int) -> Dict[str, float]:
    """ms per minibatch (best of ``reps``) of the plain loop and of hetpipe on each stage plane."""
    out = {"model": model, "nm": nm, "plain_ms": min((plain(model, long) - plain(model, short)) / (long - short)
                                                     for _ in range(reps)) * 1e3}
    for plane in ("python", "core"):
        out[f"{plane}_ms"] = min((_run(model, nm, long, plane) - _run(model, nm, short, plane)) / (long - short)
                                 for _ in range(reps)) * 1e3
    return out


def table(rows: List[Dict[str, float]]) -> str:
    cores = os.cpu_count()
    lines = [f"hetpipe host overhead: 1 VW x 2 stages + 1 PS (3 ranks), no emulation; devices: host CPU (real), "
             f"{cores} cores, 1 torch thread per process; steady state (two lengths), best of reps",
             f"{'model':8} {'Nm':>3} {'plain ms/mb':>11} {'plane':>7} {'hetpipe ms/mb':>13} {'overhead/stage':>14} "
             f"{'speed-up':>9} {'goal':>16} {'met':>4}"]
    for r in rows:
        for plane in ("python", "core"):
            ms = r[f"{plane}_ms"]
            over = ms - r["plain_ms"] / 2
            speed = r["plain_ms"] / ms
            if r["model"] == "tiny":
                goal, met = f"<= {GOAL_OVERHEAD_MS} ms/stage", over <= GOAL_OVERHEAD_MS
            else:
                goal, met = f">= {GOAL_SPEEDUP}x plain", speed >= GOAL_SPEEDUP
            lines.append(f"{r['model']:8} {r['nm']:>3} {r['plain_ms']:>11.3f} {plane:>7} {ms:>13.3f} {over:>11.3f} ms "
                         f"{speed:>8.2f}x {goal:>16} {'yes' if met else 'no':>4}")
    lines.append("overhead/stage = hetpipe ms/mb - plain ms/mb / 2; speed-up = plain ms/mb / hetpipe ms/mb")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--nm", type=int, default=4)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="short runs, one repetition (a smoke test)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    reps = 1 if args.quick else 3
    rows = []
    for nm in (1, 4):
        rows.append(measure("tiny", nm, *((20, 60) if args.quick else (100, 400)), reps))
    rows.append(measure("compute", 4, *((8, 16) if args.quick else (40, 120)), reps))
    print(table(rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
