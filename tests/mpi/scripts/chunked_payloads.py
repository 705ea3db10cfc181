"""Large payloads cut into chunks between the two endpoints a stage rank may run (see
tests/mpi/test_stage_endpoint.py): mpi4py's MPITransport (chunks of PY_CHUNK bytes) and the core's
StageEndpoint (chunks of CORE_CHUNK bytes), each direction and both mixed, on two ranks.

Rank 0 sends, rank 1 receives, each pairing on its own message kind (an endpoint owns the kinds it
receives): python -> python (ACT), core -> core (GRAD), python -> core (PUSH), core -> python (WEIGHTS).
Every payload is BIG bytes of a seeded generator, an odd size, so the last chunk is short; the
receiver compares it bitwise. Then the wire format itself: one TIED message from each endpoint is
received with plain mpi4py calls, which check that the header's last word is the sender's chunk size
and that the payload arrives as that many MPI messages of those lengths. Prints one JSON line per rank.

Usage: chunked_payloads.py BIG PY_CHUNK CORE_CHUNK
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

import hetpipe_core
from hetpipe_core import _mpi
from hetpipe.transport.mpi import MPITransport
from hetpipe.transport.protocol import ACT, CHUNK_WORD, EVAL, GRAD, HEADER_WORDS, PUSH, TIED, WEIGHTS, Header, chunks

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
big, py_chunk, core_chunk = (int(a) for a in sys.argv[1:4])
GIVE_UP_S = 120.0
pool = hetpipe_core.PinnedBufferPool(8, big, -1)
py = MPITransport(comm, pool, chunk=py_chunk)
core = _mpi.StageEndpoint(pool, MPI._handleof(comm), core_chunk)
CASES = (("python", "python", ACT), ("core", "core", GRAD), ("python", "core", PUSH), ("core", "python", WEIGHTS))


def payload(seed: int, n: int = big) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=n, dtype=np.uint8)


def send(plane: str, kind: int, data: np.ndarray) -> None:
    slot = pool.acquire(data.size, timeout=30)
    np.frombuffer(slot, dtype=np.uint8, count=data.size)[:] = data
    header = Header(kind, 0, 0, kind, -1, "uint8", (data.size,), data.size)
    if plane == "python":
        py.send(1, header, slot)
    else:
        core.send(1, header.encode(), slot)


def receive(plane: str, kind: int) -> np.ndarray:
    end = time.monotonic() + GIVE_UP_S
    while time.monotonic() < end:
        if plane == "python":
            msg = py.try_recv(0, kind)
            if msg is not None:
                return msg.payload
        else:
            got = core.try_recv(0, kind)
            if got is not None:
                _, words, slot = got
                data = np.frombuffer(slot, dtype=np.uint8, count=int(words[7])).copy()
                pool.release(slot)
                return data
        time.sleep(1e-4)
    raise TimeoutError(f"no {plane} message of kind {kind} in {GIVE_UP_S} s")


def raw_lengths(kind: int):
    """Receive one ``kind`` message from rank 0 with plain mpi4py: its chunk word, the lengths of the
    MPI messages its payload came in, and the reassembled payload."""
    words = np.empty(HEADER_WORDS, dtype=np.int64)
    comm.Recv([words, MPI.INT64_T], source=0, tag=2 * kind)
    nbytes, cut = int(words[7]), int(words[CHUNK_WORD])
    out, lengths = np.empty(nbytes, dtype=np.uint8), []
    for off, n in chunks(nbytes, cut):
        status = MPI.Status()
        comm.Recv([out[off:off + n], MPI.BYTE], source=0, tag=2 * kind + 1, status=status)
        lengths.append(status.Get_count(MPI.BYTE))
    return cut, lengths, out


out = {"rank": rank}
if rank == 0:
    for i, (sender, _, kind) in enumerate(CASES):
        send(sender, kind, payload(i))
    send("python", TIED, payload(10, 5 * py_chunk + 3))
    send("core", EVAL, payload(11, 4 * core_chunk + 1))
    while py.pending_sends() or core.pending_sends:
        py.progress()
        time.sleep(1e-3)
else:
    out["equal"] = {f"{s}->{r}": bool(np.array_equal(receive(r, kind), payload(i)))
                    for i, (s, r, kind) in enumerate(CASES)}
    cut, lengths, data = raw_lengths(TIED)
    out["python_wire"] = {"cut": cut, "lengths": lengths, "equal": bool(np.array_equal(data, payload(10, 5 * py_chunk + 3)))}
    cut, lengths, data = raw_lengths(EVAL)
    out["core_wire"] = {"cut": cut, "lengths": lengths, "equal": bool(np.array_equal(data, payload(11, 4 * core_chunk + 1)))}
comm.Barrier()
py.close()
out["lost"] = core.close()
out["free"] = pool.available()
sys.stdout.write("\nRESULT " + json.dumps(out) + "\n")
sys.stdout.flush()
