"""MPITransport.close() with a receive whose header arrived and whose payload has not.

Usage: mpiexec -n 1 python close_pending.py. Prints ``RESULT {...}``: the error close() raised (None
if none), and whether the pool got its slot back.
"""

import json
import time

import numpy as np
from mpi4py import MPI

import hetpipe_core
from hetpipe.transport.protocol import ACT, Header, TransportError
from hetpipe.transport.mpi import MPITransport

comm = MPI.COMM_SELF
pool = hetpipe_core.PinnedBufferPool(2, 4096)
transport = MPITransport(comm, pool)
# A header announcing 64 payload bytes whose payload is never sent.
words = Header(ACT, 0, 0, 3, -1, "float32", (16,), 64).encode()
sent = comm.Isend([words, MPI.INT64_T], dest=0, tag=2 * ACT)
deadline = time.monotonic() + 60
while transport._recvs.get((0, ACT)) is None or transport._recvs[(0, ACT)].header is None:
    assert transport.try_recv(0, ACT) is None
    assert time.monotonic() < deadline, "the header never arrived"
    time.sleep(0.001)
sent.Wait()
assert pool.available() == 1, "the payload's receive holds a slot"
error = None
try:
    transport.close()
except TransportError as e:
    error = str(e)
# The cancelled payload receive no longer targets the slot: a late payload must not land in it.
slot = pool.acquire(64, timeout=0)
np.frombuffer(slot, dtype=np.uint8, count=64)[:] = 7
late = np.zeros(64, dtype=np.uint8)
late_send = comm.Isend([late, MPI.BYTE], dest=0, tag=2 * ACT + 1)
arrived = False
while not arrived and time.monotonic() < deadline:
    arrived = comm.Iprobe(source=0, tag=2 * ACT + 1)
    time.sleep(0.001)
untouched = bool((np.frombuffer(slot, dtype=np.uint8, count=64) == 7).all())
if arrived:
    comm.Recv([np.empty(64, dtype=np.uint8), MPI.BYTE], source=0, tag=2 * ACT + 1)
late_send.Wait()
print("RESULT " + json.dumps({"error": error, "available": pool.available() + 1, "late_unclaimed": bool(arrived),
                              "slot_untouched": untouched}), flush=True)
