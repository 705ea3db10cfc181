"""One PS shard's data plane: applied bytes/s of the core's plane beside the host's memcpy bandwidth
and the Python shard (hetpipe.ps.shard.ShardState), in the same run.

Workload: a shard of SHARD_MIB MiB in 4 layers, 2 VWs x 2 stages (each stage holds 2 layers), D = 1,
WAVES waves. "Applied bytes" are the delta bytes that reached the weights (every pushed byte, once).
In process (the data plane alone, no transport):
- core ShardPlane: one Python thread per stage pulls wave w (waits for w - D applied waves) and pushes
  its wave-w delta; push and pull run in C++ without the GIL, so the four stages overlap.
- Python shard: ShardState.push / snapshot_into for the same pushes and pulls, from one thread (the
  shard rank's main thread).
Over MPI (``mpiexec -n 5``: one shard rank, four stage ranks that pull wave w, then push their wave-w
delta from a pool slot, with the runtime's own wire format and transport):
- core plane: the shard rank runs hetpipe.ps.core_plane.CoreShardServer (the core's threads receive
  each push straight into its pending buffer, apply, and send replies in place from the weights);
- Python plane: the shard rank runs hetpipe.ps.shard.ShardServer over MPITransport (today's path).
The MPI rows time the shard rank from a barrier to its last wave applied: they include the transport.
memcpy: np.copyto of the shard's size (one thread) and hetpipe_core.snapshot (all threads).
Devices: host CPU only (real; no GPU involved). Each figure is the best of REPEAT runs.
Memory traffic per applied byte: in process, the pull's copy of W (2 bytes), the push's copy into a
pending buffer (2) and apply_delta (3: read W, read delta, write W) = 7 bytes against memcpy's 2, so
applied/memcpy cannot exceed 2/7 when memory bandwidth is the limit. The core plane over MPI skips
the pull's copy (replies are sent from W in place) and the push's (MPI receives into the pending
buffer), leaving the transport's own copy (2) and apply_delta (3): at most 2/5 of memcpy, and at
most 2/3 for apply_delta alone.

    .venv/bin/python bench/ps_shard.py [--shard-mib 32] [--waves 24] [--no-mpi]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

import hetpipe_core
from hetpipe.ps.shard import ShardState

MIB = 1 << 20
REPEAT = 3
CUTS = [[(0, 2), (2, 4)], [(0, 2), (2, 4)]]   # per VW: the stages' layer ranges; the shard owns layers 0..3
D = 1


def deltas(layer_numel: int, waves: int):
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal(2 * layer_numel).astype(np.float32) * 1e-3 for _ in range(4)]
    return {(vw, s, w): pool[(vw + s + w) % 4] for vw in range(2) for s in range(2) for w in range(waves)}


def run_plane(layer_numel: int, waves: int, d: dict) -> float:
    plane = hetpipe_core.ShardPlane([layer_numel] * 4, [[[0, 1], [2, 3]], [[0, 1], [2, 3]]], D, 0)

    def stage(vw: int, s: int) -> None:
        out = np.empty(2 * layer_numel, np.float32)
        for w in range(waves):
            plane.pull(vw, s, w, out, timeout=60)
            plane.push(vw, s, w, d[(vw, s, w)])

    threads = [threading.Thread(target=stage, args=(vw, s)) for vw in range(2) for s in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    assert plane.applied == waves
    return elapsed


def run_python(layer_numel: int, waves: int, d: dict) -> float:
    init = {l: np.zeros(layer_numel, np.float32) for l in range(4)}
    state = ShardState(0, init, CUTS, D)
    out = np.empty(2 * layer_numel, np.float32)
    start = time.perf_counter()
    for w in range(waves):
        for vw in range(2):
            for s in range(2):
                state.snapshot_into(vw, s, out)
                state.push(vw, s, w, d[(vw, s, w)])
    elapsed = time.perf_counter() - start
    assert state.applied >= waves - 1
    return elapsed


def mpi_rates(shard_mib: int, waves: int) -> dict:
    """Applied bytes/s of the core and the Python plane over MPI (best of REPEAT), from an mpiexec run
    of this script's worker; {} when no mpiexec is found."""
    from hetpipe.job.world import MPIUnavailable
    from hetpipe.launch.mpiexec import mpiexec_path

    try:
        mpiexec = mpiexec_path()
    except MPIUnavailable:
        return {}
    cmd = [mpiexec, "-n", "5", sys.executable, os.path.abspath(__file__), "--mpi-worker",
           "--shard-mib", str(shard_mib), "--waves", str(waves)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"bench/ps_shard.py: the MPI run failed:\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RATES "))
    return json.loads(line[len("RATES "):])


def mpi_worker(shard_mib: int, waves: int) -> None:
    """Rank 0 serves the shard (core, then Python plane, REPEAT times each); ranks 1-4 are the stages."""
    from mpi4py import MPI

    from hetpipe.transport.drive import drive
    from hetpipe.ps.server import ShardServer
    from hetpipe.ps.core_plane import CoreShardServer, CoreShardState, choose_plane
    from hetpipe.transport.protocol import DONE, PULL, PUSH, WEIGHTS, Header
    from hetpipe.transport.mpi import MPITransport
    from hetpipe.transport.slots import slot_bytes

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    layer_numel = shard_mib * MIB // 16
    n = 2 * layer_numel
    rates = {"core": 0.0, "python": 0.0}
    if rank == 0:
        if choose_plane(comm)[0] != "core":
            raise SystemExit(f"bench/ps_shard.py: the core plane cannot run here: {choose_plane(comm)[1]}")
        init = {l: np.zeros(layer_numel, np.float32) for l in range(4)}
    for plane in ("core", "python") * REPEAT:
        if rank == 0:
            pool = hetpipe_core.PinnedBufferPool(1 if plane == "core" else 16, 4 * n, -1)
            transport = MPITransport(comm, pool)
            if plane == "core":
                server = CoreShardServer(CoreShardState(0, init, CUTS, D), transport, pool, 4, comm)
            else:
                server = ShardServer(ShardState(0, init, CUTS, D), transport, pool, 4)
            comm.Barrier()
            start = time.perf_counter()
            drive(server, 600, "bench shard")
            elapsed = time.perf_counter() - start
            assert server.state.applied == waves
            transport.close()
            rates[plane] = max(rates[plane], 4 * n * 4 * waves / elapsed)
        else:
            vw, s = divmod(rank - 1, 2)
            delta = deltas(layer_numel, 1)[(vw, s, 0)]
            pool = hetpipe_core.PinnedBufferPool(2, 4 * n, -1)
            transport = MPITransport(comm, pool)
            comm.Barrier()
            for w in range(waves):
                transport.send(0, Header(PULL, vw, s, -1, w))
                while transport.try_recv(0, WEIGHTS) is None:
                    transport.progress()        # releases the slots of completed pushes
                    time.sleep(20e-6)
                slot = pool.acquire(4 * n, timeout=60)
                np.copyto(slot_bytes(slot, 4 * n).view(np.float32), delta)
                transport.send(0, Header(PUSH, vw, s, -1, w, "float32", (n,), 4 * n), slot)
            transport.send(0, Header(DONE, vw, s, aux=waves))
            while transport.pending_sends():
                transport.progress()
                time.sleep(20e-6)
            transport.close()
        comm.Barrier()
    if rank == 0:
        print("RATES " + json.dumps(rates), flush=True)


def best(fn) -> float:
    return min(fn() for _ in range(REPEAT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard-mib", type=int, default=32)
    ap.add_argument("--waves", type=int, default=24)
    ap.add_argument("--no-mpi", action="store_true", help="skip the rows over MPI")
    ap.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mpi_worker:
        mpi_worker(args.shard_mib, args.waves)
        return
    layer_numel = args.shard_mib * MIB // 16
    d = deltas(layer_numel, args.waves)
    pushed = 4 * 2 * layer_numel * 4 * args.waves            # VWs*stages x 2 layers x 4 B x waves
    src = np.ones(args.shard_mib * MIB // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    memcpy_1 = src.nbytes / best(lambda: _timed(lambda: np.copyto(dst, src)))
    memcpy_all = src.nbytes / best(lambda: _timed(lambda: hetpipe_core.snapshot(src, dst)))
    memcpy = max(memcpy_1, memcpy_all)
    plane = pushed / best(lambda: run_plane(layer_numel, args.waves, d))
    python = pushed / best(lambda: run_python(layer_numel, args.waves, d))
    over_mpi = {} if args.no_mpi else mpi_rates(args.shard_mib, args.waves)
    print(f"PS shard data plane, {args.shard_mib} MiB shard, 2 VWs x 2 stages, D = {D}, {args.waves} waves; "
          f"{os.cpu_count()} CPU cores; devices: host CPU only (real, no GPU); best of {REPEAT}")
    header = f"{'what':<44}{'GB/s':>8}{'vs memcpy':>11}{'vs Python shard':>17}"
    print(header)
    print("-" * len(header))
    rows = [("memcpy, np.copyto (1 thread)", memcpy_1), ("memcpy, core snapshot (all threads)", memcpy_all),
            ("Python shard (ShardState), in process", python), ("core ShardPlane, in process", plane)]
    if over_mpi:
        rows += [("Python plane over MPI (4 stage ranks)", over_mpi["python"]),
                 ("core plane over MPI (4 stage ranks)", over_mpi["core"])]
    for name, rate in rows:
        print(f"{name:<44}{rate / 1e9:>8.2f}{rate / memcpy:>10.0%}{rate / python:>16.1f}x")
    # Bytes moved: memcpy moves 2 per byte copied (read, write); the planes 7 (in process) or 5 (over MPI).
    print(f"goal: one shard's applied bytes/s >= 70% of memcpy -> in process {plane / memcpy:.0%} (7 B of memory "
          f"traffic per applied byte: {7 * plane / (2 * memcpy):.0%} of memcpy's bytes moved/s)", end="")
    if over_mpi:
        core = over_mpi["core"]
        print(f"; over MPI {core / memcpy:.0%} (5 B per applied byte: {5 * core / (2 * memcpy):.0%} of memcpy's)"
              f" -> {'met' if max(core, plane) >= 0.7 * memcpy else 'not met'}")
    else:
        print(f" -> {'met' if plane >= 0.7 * memcpy else 'not met'} (no MPI rows)")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
