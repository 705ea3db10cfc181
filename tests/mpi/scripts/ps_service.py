"""The core's PS service under mpiexec -n 2, driven directly: rank 0 serves one shard, rank 1 plays a
stage by sending hand-made messages over MPITransport. Prints ``RESULT {json}`` lines from rank 0.

Cases: a service stopped with nothing received, and one stopped while a push's payload never came
(no hang; the push is listed as lost); a push of the wrong size and a duplicate push, each a
WSPViolation from CoreShardServer.step() naming the VW, stage, wave and bytes.
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

import hetpipe_core
from hetpipe.ps.core_plane import CoreShardServer, CoreShardState
from hetpipe.transport.protocol import PUSH, Header
from hetpipe.transport.mpi import MPITransport
from hetpipe.transport.slots import slot_bytes

COMM = MPI.COMM_WORLD
NUMEL = 1000   # the shard: one layer of 1000 floats, held by VW 0's only stage


def close(srv: CoreShardServer) -> None:
    srv.service.stop()
    srv.transport.close()


def server(comm) -> CoreShardServer:
    state = CoreShardState(0, {0: np.zeros(NUMEL, np.float32)}, [[(0, 1)]], 0)
    pool = hetpipe_core.PinnedBufferPool(1, 4096, -1)
    return CoreShardServer(state, MPITransport(comm, pool), pool, 1, comm)


def send_push(transport, pool, wave: int, numel: int, payload: bool = True) -> None:
    """A push of wave ``wave`` from VW 0 stage 0 with ``numel`` floats (only its header without payload)."""
    nbytes = 4 * numel
    if not payload:
        words = Header(PUSH, 0, 0, -1, wave, "float32", (numel,), nbytes).encode()
        COMM.Send([words, MPI.INT64_T], dest=0, tag=2 * PUSH)
        return
    slot = pool.acquire(nbytes, timeout=10)
    slot_bytes(slot, nbytes).view(np.float32)[:] = 0.5
    transport.send(0, Header(PUSH, 0, 0, -1, wave, "float32", (numel,), nbytes), slot)
    while transport.pending_sends():
        transport.progress()


def expect_failure(srv: CoreShardServer, deadline_s: float = 20.0) -> str:
    """Step until the service's failure surfaces as an exception; its type and message."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            srv.step()
        except Exception as e:  # noqa: BLE001 - the failure under test
            return f"{type(e).__name__}: {e}"
        time.sleep(0.001)
    return "no failure"


def main() -> int:
    rank = COMM.Get_rank()
    pool = hetpipe_core.PinnedBufferPool(2, 8192, -1)
    transport = MPITransport(COMM, pool)
    results = []
    # 1. Start and stop with nothing received.
    if rank == 0:
        srv = server(COMM)
        srv.step()
        srv.service.stop()
        results.append({"case": "idle_stop", "lost": srv.service.lost()})
        close(srv)
    COMM.Barrier()
    # 2. A push header whose payload never comes, then stop.
    if rank == 1:
        send_push(transport, pool, 0, NUMEL, payload=False)
    if rank == 0:
        srv = server(COMM)
        srv.step()
        end = time.monotonic() + 20
        while srv.service.events == 0 and time.monotonic() < end:     # until the header is in
            time.sleep(0.001)
        srv.service.stop()
        results.append({"case": "stop_mid_push", "lost": srv.service.lost()})
        close(srv)
    COMM.Barrier()
    # 3. A push of the wrong size.
    if rank == 0:
        srv = server(COMM)
        srv.step()
    COMM.Barrier()
    if rank == 1:
        send_push(transport, pool, 1, NUMEL - 1, payload=False)
    if rank == 0:
        results.append({"case": "wrong_size", "error": expect_failure(srv)})
        close(srv)
    COMM.Barrier()
    # 4. A duplicate push (wave 0 twice).
    if rank == 0:
        srv = server(COMM)
        srv.step()
    COMM.Barrier()
    if rank == 1:
        send_push(transport, pool, 0, NUMEL)
        send_push(transport, pool, 0, NUMEL)
    if rank == 0:
        results.append({"case": "duplicate", "error": expect_failure(srv)})
        close(srv)
    COMM.Barrier()
    # 5. A push beyond the staleness window (wave 5 at clock 0, D = 0).
    if rank == 0:
        srv = server(COMM)
        srv.step()
    COMM.Barrier()
    if rank == 1:
        send_push(transport, pool, 5, NUMEL, payload=False)
    if rank == 0:
        results.append({"case": "beyond_window", "error": expect_failure(srv)})
        close(srv)
        for r in results:
            print("RESULT " + json.dumps(r), flush=True)
    COMM.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
