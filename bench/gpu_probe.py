"""The link speeds a GPU run stands on, measured before it: host<->device copy bandwidth from pinned and
pageable memory (each direction alone, and both at once on the two copy streams a stage uses), whether
a stage-sized pinned pool really is page-locked and how long pinning it takes, and MPI point-to-point
bandwidth between two ranks (from ordinary host memory and from pinned slots).

    python bench/gpu_probe.py --out $OUT                    # on a CUDA device; MPI when mpiexec starts 2 ranks
    python bench/gpu_probe.py --device cpu --out /tmp/p     # dry run of the same code on the CPU

Copies go through the core's own path (``hetpipe_core.copy_async`` on a ``hetpipe_core.Stream``, what
the stage's copy streams run), beside torch's ``copy_(non_blocking=True)`` from its own pinned memory
as the reference. Each figure is the median over 5 timed rounds of back-to-back copies, after one
untimed round. On the CPU (``--device cpu``) the "device" is host memory and the copies are the CPU
stream's memcpy: that checks the code, not a link.

Every figure is appended to ``probe.jsonl`` in ``--out`` the moment it is measured, and ``probe.txt``
(the table) is rewritten after each, so a run stopped early keeps what it measured.
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
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

import hetpipe_core

MIB = 1 << 20
RESULT = "RESULT "


class Log:
    """probe.jsonl (one JSON object per measurement, appended as it is taken) and probe.txt (its table)."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.txt = out / "probe.jsonl", out / "probe.txt"
        self.rows: List[Dict[str, Any]] = []

    def add(self, row: Dict[str, Any]) -> None:
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.txt.write_text(table(self.rows) + "\n")
        print(json.dumps(row), flush=True)


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """The measurements so far, one line each."""
    lines = []
    for r in rows:
        kind = r["probe"]
        if kind == "env":
            lines.append(f"device {r['device_name']}; torch {r['torch']}; hetpipe_core {r['build']}")
        elif kind == "pinning":
            state = "page-locked" if r["pinned"] else f"PAGEABLE ({r['pin_error']})"
            lines.append(f"pool of {r['bytes'] / MIB:.0f} MiB through device {r['device']}: {state}, "
                         f"allocated in {r['alloc_s']:.3f} s")
        elif kind == "copy":
            lines.append(f"copy {r['direction']:<9} {r['host']:<13} {r['bytes'] / MIB:>7.0f} MiB  {r['gb_s']:>8.2f} GB/s")
        elif kind == "mpi":
            if "error" in r:
                lines.append(f"mpi point-to-point: not measured ({r['error']})")
            else:
                lines.append(f"mpi ping-pong {r['host']:<13} {r['bytes'] / MIB:>7.0f} MiB  {r['gb_s']:>8.2f} GB/s "
                             f"one way, {r['latency_us']:.1f} us per message of 8 bytes")
    return "\n".join(lines)


def timed(issue: Callable[[], None], finish: Callable[[], None], reps: int, rounds: int = 5) -> float:
    """Median seconds per call of ``issue`` over ``rounds`` rounds of ``reps`` calls, each round ended by
    ``finish`` (the wait for the device), after one untimed round."""
    for _ in range(reps):
        issue()
    finish()
    per = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            issue()
        finish()
        per.append((time.perf_counter() - start) / reps)
    return statistics.median(per)


def probe_copies(log: Log, device: str, sizes: Sequence[int]) -> None:
    """Host<->device bandwidth per size: pinned slots and pageable memory through the core's streams,
    torch's pinned copies as the reference, and both directions at once on two streams."""
    import torch

    cuda = device.startswith("cuda")
    index = (torch.device(device).index or 0) if cuda else -1
    out_stream, in_stream = hetpipe_core.Stream(index), hetpipe_core.Stream(index)
    for n in sizes:
        pool = hetpipe_core.PinnedBufferPool(2, n, index)
        up, down = pool.acquire(n), pool.acquire(n)
        up.numpy("uint8")[:] = 1
        pageable = np.ones(n, np.uint8)
        if cuda:
            dev_a = torch.empty(n, dtype=torch.uint8, device=device)
            dev_b = torch.empty(n, dtype=torch.uint8, device=device)
            a, b = dev_a.data_ptr(), dev_b.data_ptr()
        else:
            dev_a, dev_b = np.empty(n, np.uint8), np.empty(n, np.uint8)
            a, b = dev_a, dev_b
        reps = max(1, min(50, (512 * MIB) // n))

        def rate(issue, streams) -> float:
            return n / timed(issue, lambda: [s.synchronize() for s in streams], reps) / 1e9

        def add(direction: str, host: str, gb_s: float) -> None:
            log.add({"probe": "copy", "direction": direction, "host": host, "bytes": n, "gb_s": gb_s})

        add("h2d", "pinned" if pool.pinned else "unpinned-pool",
            rate(lambda: hetpipe_core.copy_async(a, up, n, in_stream), [in_stream]))
        add("d2h", "pinned" if pool.pinned else "unpinned-pool",
            rate(lambda: hetpipe_core.copy_async(down, b, n, out_stream), [out_stream]))
        add("h2d", "pageable", rate(lambda: hetpipe_core.copy_async(a, pageable, n, in_stream), [in_stream]))
        add("d2h", "pageable", rate(lambda: hetpipe_core.copy_async(pageable, b, n, out_stream), [out_stream]))

        def both():
            hetpipe_core.copy_async(a, up, n, in_stream)
            hetpipe_core.copy_async(down, b, n, out_stream)

        # Bytes of both directions together per round, over the two streams a stage's copies use.
        add("h2d+d2h", "pinned" if pool.pinned else "unpinned-pool", 2 * rate(both, [in_stream, out_stream]))
        if cuda:
            ref_host = torch.ones(n, dtype=torch.uint8, pin_memory=True)
            ref = torch.cuda.Stream(device=device)

            def torch_h2d():
                with torch.cuda.stream(ref):
                    dev_a.copy_(ref_host, non_blocking=True)

            def torch_d2h():
                with torch.cuda.stream(ref):
                    ref_host.copy_(dev_b, non_blocking=True)

            add("h2d", "torch-pinned", n / timed(torch_h2d, ref.synchronize, reps) / 1e9)
            add("d2h", "torch-pinned", n / timed(torch_d2h, ref.synchronize, reps) / 1e9)
        pool.release(up)
        pool.release(down)
    out_stream.close()
    in_stream.close()


def probe_pinning(log: Log, device: str, nbytes: int) -> None:
    """Whether a pool of ``nbytes`` (about a stage's) pinned through the device (device 0 in a dry run)
    is page-locked, why not, and the time it takes."""
    index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
    start = time.perf_counter()
    pool = hetpipe_core.PinnedBufferPool(1, nbytes, index)
    alloc = time.perf_counter() - start
    log.add({"probe": "pinning", "device": index, "bytes": nbytes, "pinned": pool.pinned,
             "pin_error": pool.pin_error, "alloc_s": alloc})


def probe_mpi(log: Log, out: Path, sizes: Sequence[int], timeout: float) -> None:
    """Ping-pong between two ranks under mpiexec (the child writes its figures to probe.jsonl itself)."""
    try:
        from hetpipe.launch.mpiexec import mpiexec_path

        mpiexec = mpiexec_path()
    except Exception as e:  # noqa: BLE001 - recorded: the probe goes on without MPI
        log.add({"probe": "mpi", "error": f"no mpiexec: {e}"})
        return
    cmd = [mpiexec, "-n", "2", sys.executable, str(Path(__file__).resolve()), "--role", "mpi", "--out", str(out),
           "--mpi-sizes", ",".join(str(s) for s in sizes)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log.add({"probe": "mpi", "error": f"mpiexec -n 2 did not finish within {timeout:.0f} s"})
        return
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            row = json.loads(line[len(RESULT):])
            log.rows.append(row)          # the child appended it to probe.jsonl already
    log.txt.write_text(table(log.rows) + "\n")
    if proc.returncode != 0:
        log.add({"probe": "mpi", "error": f"mpiexec -n 2 exited {proc.returncode}: {proc.stderr[-2000:]}"})


def role_mpi(out: Path, sizes: Sequence[int]) -> None:
    """Rank 0 and 1 bounce messages; rank 0 appends each figure to probe.jsonl and prints it."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("gpu_probe --role mpi: run under mpiexec -n 2")
    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    small = np.zeros(1, np.float64)
    rounds = 200
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            comm.Send(small, dest=peer)
            comm.Recv(small, source=peer)
        else:
            comm.Recv(small, source=peer)
            comm.Send(small, dest=peer)
    latency = (time.perf_counter() - start) / (2 * rounds)
    log = Log(out) if rank == 0 else None
    # A stage rank's slots are pinned through its GPU; a PS rank's are ordinary host memory.
    device = 0 if hetpipe_core.build_info()["cuda_available"] else -1
    for n in sizes:
        pool = hetpipe_core.PinnedBufferPool(1, n, device)
        slot = pool.acquire(n)
        pooled = "pinned-slot" if pool.pinned else "host-slot"
        for host, buf in (("numpy", np.ones(n, np.uint8)), (pooled, slot.numpy("uint8", n))):
            reps = max(2, min(20, (256 * MIB) // n))
            per = []
            for trial in range(4):
                comm.Barrier()
                t = time.perf_counter()
                for _ in range(reps):
                    if rank == 0:
                        comm.Send([buf, MPI.BYTE], dest=peer)
                        comm.Recv([buf, MPI.BYTE], source=peer)
                    else:
                        comm.Recv([buf, MPI.BYTE], source=peer)
                        comm.Send([buf, MPI.BYTE], dest=peer)
                if trial:
                    per.append((time.perf_counter() - t) / (2 * reps))
            if log is not None:
                row = {"probe": "mpi", "host": host, "bytes": n, "gb_s": n / statistics.median(per) / 1e9,
                       "latency_us": latency * 1e6, "library": MPI.Get_library_version().splitlines()[0]}
                with log.jsonl.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(RESULT + json.dumps(row), flush=True)
        pool.release(slot)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a dry run of the same code")
    ap.add_argument("--out", default="out/gpu_probe", help="folder for probe.jsonl and probe.txt")
    ap.add_argument("--sizes", default="1,16,256", help="copy sizes in MiB, comma separated")
    ap.add_argument("--mpi-sizes", default="", help=argparse.SUPPRESS)
    ap.add_argument("--pool-mib", type=int, default=1024, help="the pinned pool probed, MiB (about a stage's)")
    ap.add_argument("--timeout", type=float, default=180, help="seconds for the MPI child")
    ap.add_argument("--role", choices=("mpi",), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.role == "mpi":
        role_mpi(out, [int(s) for s in args.mpi_sizes.split(",")])
        return
    import torch

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_probe: torch sees no CUDA device (run with --device cpu for a dry run)")
    sizes = [int(s) * MIB for s in args.sizes.split(",")]
    log = Log(out)
    log.add({"probe": "env", "device_name": torch.cuda.get_device_name(args.device) if cuda else "CPU (dry run)",
             "torch": torch.__version__, "build": hetpipe_core.build_info(),
             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
    probe_pinning(log, args.device, args.pool_mib * MIB)
    probe_mpi(log, out, sizes, args.timeout)
    probe_copies(log, args.device, sizes)
    print(table(log.rows), flush=True)


if __name__ == "__main__":
    main()
