"""The host's MPI bandwidth between two ranks, with and without MPICH's CMA single-copy path.

    python bench/mpi_bandwidth.py [--sizes 1,8,32,128,330] [--reps 3] [--chunk-mb 16] [--budget-s 10]

Runs itself under ``mpiexec -n 2`` once per setting of ``MPIR_CVAR_CH4_CMA_ENABLE`` (MPICH's switch of
cross-memory attach for messages of at least ``MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD`` bytes between ranks
of one host): with it, the receiver copies a matched message straight out of the sender's memory with
``process_vm_readv``; without it, MPICH's shared-memory module moves it through a ring of 64 cells of
8 KiB, two copies, both ranks progressing. Rank 1 times rank 0's message from a barrier to its
completion; each size's best of ``--reps``. Modes:

- ``wait``: one message, both ranks in MPI_Wait (MPI progresses without pause);
- ``chunks``: the message cut at ``--chunk-mb`` as hetpipe's transports cut payloads, MPI_Waitall;
- ``nap``: one message, each rank testing it every 1 ms (a progress thread that naps while bytes are in
  flight, as the stage endpoint did before it polled promptly).

Which path ran is read back twice: the CVARs MPICH applied, through MPI_T on rank 1, and, where strace
is installed, the bytes ``process_vm_readv`` moved during one 8 MiB transfer traced separately (the
timed runs are not traced). A size whose transfer took more than ``--budget-s`` ends its mode's row
(the larger sizes are skipped), so the slow path does not hold the shared host for minutes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve()
MB = 1 << 20
MODES = ("wait", "chunks", "nap")
TRACED = 8 * MB             # the size of the transfer traced to see which path ran
CVARS = ("MPIR_CVAR_CH4_CMA_ENABLE", "MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD", "MPIR_CVAR_NOLOCAL")


def cvars() -> Dict[str, int]:
    """The integer CVARs of :data:`CVARS` as this process's MPICH applied them (MPI_T), or {} if unreadable."""
    try:
        lib = ctypes.CDLL("libmpi.so.12")
        provided = ctypes.c_int()
        if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
            return {}
        out = {}
        for name in CVARS:
            index, handle, count, value = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if (lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) == 0
                    and lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) == 0
                    and lib.MPI_T_cvar_read(handle, ctypes.byref(value)) == 0):
                out[name] = value.value
        return out
    except OSError:
        return {}


def transfer(comm, buf, mode: str, chunk: int) -> float:
    """Seconds from a barrier until rank 1 received ``buf`` from rank 0 in ``mode``."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    n = buf.size
    pieces = [(off, min(chunk, n - off)) for off in range(0, n, chunk)] if mode == "chunks" else [(0, n)]
    comm.Barrier()
    t0 = time.perf_counter()
    if rank == 0:
        reqs = [comm.Isend([buf[a:a + k], MPI.BYTE], dest=1, tag=7) for a, k in pieces]
    else:
        reqs = [comm.Irecv([buf[a:a + k], MPI.BYTE], source=0, tag=7) for a, k in pieces]
    if mode == "nap":
        while not MPI.Request.Testall(reqs):
            time.sleep(1e-3)
    else:
        MPI.Request.Waitall(reqs)
    took = time.perf_counter() - t0
    comm.Barrier()
    return took


def rank_main(args) -> None:
    """One rank of a run under mpiexec: rank 1 prints a RESULT line with the times and the CVARs."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    sizes = [int(float(s) * MB) for s in args.sizes.split(",")] if args.sizes else []
    buf = np.ones(max(sizes, default=1), dtype=np.uint8)
    rows: List[Dict[str, object]] = []
    for mode in args.modes.split(","):
        for size in sizes:
            times = [transfer(comm, buf[:size], mode, int(args.chunk_mb * MB)) for _ in range(args.reps)]
            best = comm.bcast(min(times) if comm.Get_rank() == 1 else None, root=1)
            rows.append({"mode": mode, "bytes": size, "s": best})
            if best > args.budget_s:
                break
    if comm.Get_rank() == 1:
        print("RESULT " + json.dumps({"rows": rows, "cvars": cvars()}), flush=True)


def run(cma: int, args, extra: List[str], traced: bool = False) -> subprocess.CompletedProcess:
    from hetpipe.launch.mpiexec import mpiexec_path

    env = {**os.environ, "MPIR_CVAR_CH4_CMA_ENABLE": str(cma)}
    cmd = [mpiexec_path(), "-n", "2", sys.executable, str(HERE), "--rank", *extra]
    if traced:
        cmd = [shutil.which("strace"), "-f", "-qq", "-e", "trace=process_vm_readv", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)


def result_of(proc: subprocess.CompletedProcess) -> Dict[str, object]:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"mpi_bandwidth: the run failed:\n{proc.stdout}\n{proc.stderr}")


def cma_bytes(args) -> int:
    """Bytes ``process_vm_readv`` returned during one 8 MiB transfer (strace), -1 without strace."""
    if shutil.which("strace") is None:
        return -1
    proc = run(args.cma_now, args, ["--sizes", str(TRACED // MB), "--reps", "1", "--modes", "wait"], traced=True)
    result_of(proc)
    return sum(int(n) for n in re.findall(r"process_vm_readv\(.*\) = (\d+)", proc.stderr))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="1,8,32,128,330", help="message sizes in MiB, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk-mb", type=float, default=16.0, help="the chunk size of mode 'chunks' (MiB)")
    ap.add_argument("--budget-s", type=float, default=10.0,
                    help="a transfer slower than this ends its mode's sizes (seconds)")
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return
    passed = ["--sizes", args.sizes, "--reps", str(args.reps), "--chunk-mb", str(args.chunk_mb),
              "--budget-s", str(args.budget_s)]
    lines = [f"MPI bandwidth, 2 ranks on this host ({os.cpu_count()} cores), best of {args.reps}; "
             f"chunks of {args.chunk_mb:g} MiB",
             f"{'CMA':>4} {'applied CVARs (MPI_T)':>30} {'process_vm_readv':>17} {'path':>6} {'mode':>7} "
             f"{'MiB':>5} {'seconds':>9} {'GB/s':>6}"]
    for cma in (1, 0):
        got = result_of(run(cma, args, passed))
        args.cma_now = cma
        moved = cma_bytes(args)
        applied = got["cvars"]
        on = applied.get("MPIR_CVAR_CH4_CMA_ENABLE", cma) and not applied.get("MPIR_CVAR_NOLOCAL", 0)
        # MPICH's start-up reads a few bytes with process_vm_readv either way; the data path moves the message.
        path = "cma" if (moved >= TRACED // 2 if moved >= 0 else on) else "cells"
        shown = (f"enable={applied.get('MPIR_CVAR_CH4_CMA_ENABLE', '?')} "
                 f"threshold={applied.get('MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD', '?')}")
        traced = f"{moved / MB:.1f} of 8 MiB" if moved >= 0 else "no strace"
        for r in got["rows"]:
            lines.append(f"{cma:>4} {shown:>30} {traced:>17} {path:>6} {r['mode']:>7} {r['bytes'] / MB:>5.0f} "
                         f"{r['s']:>9.4f} {r['bytes'] / r['s'] / 1e9:>6.2f}")
    lines.append("path: cma when the traced 8 MiB transfer moved its bytes with process_vm_readv (single copy), "
                 "cells otherwise (MPICH's shared-memory cells, two copies); a missing size exceeded --budget-s")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
