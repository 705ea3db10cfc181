"""Stage-to-stage transport backends: mpi-host against torch-p2p, message round trips and training steps.

Round trips: two ranks bounce one float32 tensor through the stage's own send and receive path
(``StageLink``, the code the executor runs): mpi-host copies it into a pinned slot and sends it over
MPI, torch-p2p sends the tensor itself over its channel's process group (header over MPI). The
median over ROUNDS round trips per size, after WARMUP, is shown as one-way latency and bandwidth.
Training: the same 2-stage plan plus one PS rank, trained with each backend forced (the PS traffic
is mpi-host in both); samples/s of the whole run, the best of REPEAT launches.
Ratios are torch-p2p over mpi-host (> 1: torch-p2p faster). On a host without a GPU torch-p2p runs
on gloo between CPU tensors, so this measures the backend's overheads, not NVLink or PCIe.

    .venv/bin/python bench/transport.py [--sizes 4096,65536,1048576,16777216] [--rounds 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from hetpipe.launch.mpiexec import mpiexec_path
from hetpipe.transport.backoff import Backoff
from hetpipe import Reporting, Runtime

BACKENDS = ("mpi-host", "torch-p2p")
WARMUP = 10
REPEAT = 3


def _link(comm, backend: str, nbytes: int):
    """This rank's StageLink to the other rank over ``backend`` (collective over the 2 ranks)."""
    import hetpipe_core
    from hetpipe.transport.link import StageLink
    from hetpipe.transport.torch_groups import GLOO, open_channels
    from hetpipe.transport.torch_p2p import TorchP2PTransport
    from hetpipe.transport.mpi import MPITransport

    pool = hetpipe_core.PinnedBufferPool(8, nbytes, -1)
    if backend == "torch-p2p":
        channels = open_channels(comm, [(0, 1), (1, 0)], GLOO, torch.device("cpu"), 60.0, one_host=True)
        transport = TorchP2PTransport(comm, pool, channels)
    else:
        transport = MPITransport(comm, pool)
    return StageLink(transport, pool, torch.device("cpu")), transport


def _recv(link, src: int, kind: int):
    """Poll for the message as the runtime's driver does: with its back-off, not spinning."""
    backoff = Backoff()
    while True:
        link.progress()
        got = link.try_recv(src, kind)
        if got is not None:
            return got
        backoff.wait()


def _flush(link) -> None:
    backoff = Backoff()
    while link.pending_sends():
        backoff.wait()
        link.progress()


def pingpong_worker(args) -> None:
    from mpi4py import MPI

    from hetpipe.transport.protocol import ACT, Header

    comm = MPI.COMM_WORLD
    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    out = {}
    for nbytes in (int(s) for s in args.sizes.split(",")):
        n = nbytes // 4
        header = Header(ACT, 0, rank, 0, -1, "float32", (n,), 4 * n)
        for backend in BACKENDS:
            link, transport = _link(comm, backend, nbytes)
            t = torch.randn(n)
            times = []
            for i in range(WARMUP + args.rounds):
                comm.Barrier()
                start = time.perf_counter()
                if rank == 0:
                    while not link.send(peer, header, t):
                        link.progress()
                    _, t = _recv(link, peer, ACT)
                else:
                    _, got = _recv(link, peer, ACT)
                    while not link.send(peer, header, got):
                        link.progress()
                _flush(link)
                if i >= WARMUP:
                    times.append(time.perf_counter() - start)
            comm.Barrier()
            transport.close()
            out[f"{backend}/{nbytes}"] = statistics.median(times)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.Linear(width, 10))


def train_worker(args) -> None:
    from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
    from hetpipe.run.data import Batches
    from hetpipe.run.trainer import Trainer

    g = torch.Generator().manual_seed(1)
    n = args.minibatch * args.minibatches
    data = Batches(torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g),
                   args.minibatch, seed=1)
    stages = (StagePlan("cpu", "cpu", 0, 3, 0.0, 0.0), StagePlan("cpu", "cpu", 3, 6, 0.0, 0.0))
    plan = Plan(6, 2, 0, "manual", (VirtualWorkerPlan(0, stages),), (ShardPlan(0, "n0", tuple(range(6))),))
    run = Trainer(list(_model(args.width)), nn.functional.cross_entropy,
                  lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), data, plan=plan, epochs=1,
                  reporting=Reporting(progress=False), runtime=Runtime(transport=args.worker_backend)).fit()
    if run.rank == 0:
        print("RESULT " + json.dumps({"samples_per_s": run.samples_per_s, "transport": run.transport}), flush=True)


def _launch(args, n: int, *extra: str) -> dict:
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ)
    found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"transport bench {extra} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return found[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216", help="message bytes, comma separated")
    ap.add_argument("--rounds", type=int, default=200, help="timed round trips per size and backend")
    ap.add_argument("--width", type=int, default=512, help="training: the MLP's width")
    ap.add_argument("--minibatch", type=int, default=64)
    ap.add_argument("--minibatches", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", choices=("pingpong", "train"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-backend", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "pingpong":
        pingpong_worker(args)
        return
    if args.worker == "train":
        train_worker(args)
        return
    print("stage-to-stage transports, mpi-host vs torch-p2p (gloo); devices: real, host CPU, no GPU: "
          "device-to-device not exercised")
    rt = _launch(args, 2, "--worker", "pingpong")
    header = f"{'message':>10}{'mpi-host us':>13}{'torch-p2p us':>14}{'mpi-host MB/s':>15}{'torch-p2p MB/s':>16}" \
             f"{'p2p speed':>11}"
    print(f"\none-way latency (median round trip / 2, {args.rounds} round trips)")
    print(header)
    print("-" * len(header))
    for nbytes in (int(s) for s in args.sizes.split(",")):
        a, b = (rt[f"{k}/{nbytes}"] / 2 for k in BACKENDS)
        print(f"{_size(nbytes):>10}{a * 1e6:>13.1f}{b * 1e6:>14.1f}{nbytes / a / 1e6:>15.1f}{nbytes / b / 1e6:>16.1f}"
              f"{a / b:>10.2f}x")
    print(f"\ntraining: 1 VW x 2 stages + 1 PS, MLP width {args.width}, minibatch {args.minibatch}, "
          f"{args.minibatches} minibatches, Nm=2, D=0 (best of {REPEAT})")
    header = f"{'backend':<12}{'samples/s':>12}{'vs mpi-host':>13}  reported"
    print(header)
    print("-" * len(header))
    best = {}
    for backend in BACKENDS:
        runs = [_launch(args, 3, "--worker", "train", "--worker-backend", backend) for _ in range(REPEAT)]
        best[backend] = max(runs, key=lambda r: r["samples_per_s"])
    for backend in BACKENDS:
        sps = best[backend]["samples_per_s"]
        print(f"{backend:<12}{sps:>12.1f}{sps / best['mpi-host']['samples_per_s']:>12.2f}x  "
              f"{best[backend]['transport']}")


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    main()
