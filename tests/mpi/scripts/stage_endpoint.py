"""Two ranks exchange messages through hetpipe_core._mpi.StageEndpoint (see tests/mpi/test_stage_endpoint.py).

Rank 0 sends rank 1 `count` ACT messages of varying sizes and one large PUSH-like payload, then sleeps
in Python, making no MPI call, until rank 1 says through a file (DIR/arrived) that the payload arrived;
rank 1 answers each ACT with a GRAD of the same bytes reversed. Checks: every payload arrives intact
and in order, and the large payload arrives in full while rank 0 sleeps (no Python call on rank 0
progressed it: without the core's own progress it would arrive only after rank 0 gave up waiting).
Prints one JSON line per rank.

Usage: stage_endpoint.py COUNT BIG DIR
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import hetpipe_core
from hetpipe_core import _mpi
from hetpipe.transport.protocol import ACT, GRAD, PUSH, Header

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
count = int(sys.argv[1])
big = int(sys.argv[2])
arrived = Path(sys.argv[3]) / "arrived"
GIVE_UP_S = 60.0                     # a hang guard for rank 0's sleep, not a bound under test
pool = hetpipe_core.PinnedBufferPool(8, max(big, 1 << 16), -1)
ep = _mpi.StageEndpoint(pool, MPI._handleof(comm))


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, size=100 + 997 * i % 60000, dtype=np.uint8)


def send(dest: int, header: Header, data: np.ndarray) -> None:
    while True:
        try:
            slot = pool.acquire(max(header.nbytes, 1), timeout=0)
            break
        except TimeoutError:
            time.sleep(1e-4)
    np.frombuffer(slot, dtype=np.uint8, count=header.nbytes)[:] = data
    ep.send(dest, header.encode(), slot)


def recv(src: int, kind: int):
    while True:
        got = ep.try_recv(src, kind)
        if got is not None:
            s, words, slot = got
            h = Header.decode(words)
            data = np.frombuffer(slot, dtype=np.uint8, count=h.nbytes).copy() if slot is not None else None
            if slot is not None:
                pool.release(slot)
            return h, data
        time.sleep(1e-5)


out = {"rank": rank}
if rank == 0:
    for i in range(count):
        d = payload(i)
        send(1, Header(ACT, 0, 0, i, -1, "uint8", (d.size,), d.size), d)
        h, back = recv(1, GRAD)
        assert h.mb == i and np.array_equal(back, d[::-1]), f"GRAD {i} differs"
    blob = np.random.default_rng(99).integers(0, 255, size=big, dtype=np.uint8)
    send(1, Header(PUSH, 0, 0, -1, 7, "uint8", (big,), big), blob)
    end = time.monotonic() + GIVE_UP_S
    while not arrived.exists() and time.monotonic() < end:
        time.sleep(0.01)                         # Python busy: only the core's thread can move the push
    out.update(arrived_while_asleep=arrived.exists())
    while ep.pending_sends:
        time.sleep(1e-3)
else:
    for i in range(count):
        h, d = recv(0, ACT)
        assert h.mb == i and np.array_equal(d, payload(i)), f"ACT {i} differs"
        send(0, Header(GRAD, 0, 1, i, -1, "uint8", (d.size,), d.size), d[::-1].copy())
    h, blob = recv(0, PUSH)
    out.update(ok=bool(np.array_equal(blob, np.random.default_rng(99).integers(0, 255, size=big, dtype=np.uint8))))
    arrived.touch()
    while ep.pending_sends:
        time.sleep(1e-3)
comm.Barrier()
out["lost"] = ep.close()
out["free"] = pool.available()
sys.stdout.write("\nRESULT " + json.dumps(out) + "\n")
sys.stdout.flush()
