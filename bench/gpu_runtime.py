"""hetpipe's runtime on a real CUDA device beside plain PyTorch training on that same device.

One GPU cannot form a heterogeneous cluster, so this measures what the runtime costs on real
hardware rather than what heterogeneity gains (bench/e2e does that, emulated): one VW whose stages
all live on ``cuda:0`` (one rank per stage sharing the GPU, activations through pinned slots and
the copy stream) plus one parameter-server rank (host memory, WSP pushes and pulls every wave),
against one process training the whole model on the GPU with the same optimizer and minibatches.
The ideal ratio is 1.0: the GPU does the same arithmetic either way.

    .venv/bin/python bench/gpu_runtime.py                  # needs a CUDA device and mpiexec
    .venv/bin/python bench/gpu_runtime.py --device cpu     # smoke run of the same code on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from hetpipe.launch.mpi import mpiexec_path
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.runtime.data import Batches


def model(depth: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def data(args) -> Batches:
    g = torch.Generator().manual_seed(1)
    n = args.minibatch * args.minibatches
    return Batches(torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g),
                   args.minibatch, seed=1)


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def plan(args, d: int) -> Plan:
    n = 2 * args.depth + 1
    cuts = [round(n * k / args.stages) for k in range(args.stages + 1)]
    stages = tuple(StagePlan(args.device, "real", a, b, 0.0, 0.0) for a, b in zip(cuts, cuts[1:]))
    return Plan(n, args.nm, d, "manual", (VirtualWorkerPlan(0, stages),), (ShardPlan(0, "n0", tuple(range(n))),))


def plain(args) -> float:
    """Samples/s of one process training the whole model on the device, timed from its first step
    (hetpipe's time also starts before its first step: it includes moving the stages' layers to
    the device and the first pulls, so the comparison leans, slightly, against hetpipe)."""
    device = torch.device(args.device)
    net = model(args.depth, args.width).to(device)
    opt = sgd(net.parameters())
    batches = data(args)

    def step(x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x.to(device)), y.to(device)).backward()
        opt.step()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    samples = 0
    for e in range(args.epochs):
        batches.set_epoch(e)
        for x, y in batches:
            step(x, y)
            samples += len(x)
    sync()
    return samples / (time.perf_counter() - start)


def worker(args) -> None:
    """One rank of a hetpipe run (under mpiexec); the plan's rank 0 prints the result."""
    from hetpipe.runtime.trainer import Trainer

    run = Trainer(list(model(args.depth, args.width)), nn.functional.cross_entropy, sgd, data(args),
                  plan=plan(args, args.worker_d), epochs=args.epochs, progress=False).fit()
    if run.rank == 0:
        print("RESULT " + json.dumps({"samples_per_s": run.samples_per_s, "samples": run.samples,
                                      "elapsed_s": run.elapsed_s}), flush=True)


def hetpipe(args, d: int) -> dict:
    cmd = [mpiexec_path(), "-n", str(args.stages + 1), sys.executable, str(Path(__file__).resolve()), *sys.argv[1:],
           "--worker-d", str(d)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ)
    found = [json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"hetpipe D={d} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return found[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--depth", type=int, default=12, help="Linear+ReLU pairs")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--minibatch", type=int, default=512)
    ap.add_argument("--minibatches", type=int, default=64, help="minibatches per epoch")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--nm", type=int, default=4)
    ap.add_argument("--d", default="0,2", help="staleness bounds to run, comma separated")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker-d", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_d is not None:
        worker(args)
        return
    real = args.device.startswith("cuda")
    if real and not torch.cuda.is_available():
        raise SystemExit("gpu_runtime: no CUDA device (run with --device cpu for a smoke run)")
    what = torch.cuda.get_device_name(0) if real else "CPU (smoke run, not a GPU figure)"
    params = sum(p.numel() for p in model(args.depth, args.width).parameters())
    print(f"hetpipe runtime vs plain PyTorch on one device; devices: real, {what}")
    print(f"MLP {args.depth}x{args.width} ({params * 4 / 2**20:.0f} MiB fp32), minibatch {args.minibatch}, "
          f"{args.minibatches * args.epochs} minibatches; hetpipe: 1 VW x {args.stages} stages sharing the "
          f"device + 1 PS rank, Nm={args.nm}")
    header = f"{'system':<28}{'samples/s':>12}{'vs plain':>10}"
    print(header)
    print("-" * len(header), flush=True)
    base = plain(args)
    print(f"{'plain PyTorch (1 process)':<28}{base:>12.1f}{1.0:>9.2f}x", flush=True)
    for d in (int(x) for x in args.d.split(",")):
        sps = hetpipe(args, d)["samples_per_s"]
        print(f"{'hetpipe D=' + str(d):<28}{sps:>12.1f}{sps / base:>9.2f}x", flush=True)

if __name__ == "__main__":
    main()
