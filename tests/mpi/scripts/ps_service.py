"""The core's PS service under mpiexec -n 3, driven directly: rank 2 serves one shard of a plan of two
VWs of one stage (ranks 0 and 1, in plan order); rank 0 plays VW 0's stage by sending hand-made messages
over MPITransport, rank 1 plays a forger. Prints ``RESULT {json}`` lines from rank 2.

Cases: a service stopped with nothing received, and one stopped while a push's payload never came
(no hang; the push is listed as lost); a push of the wrong size, a duplicate push and a push beyond
the staleness window, each a WSPViolation from CoreShardServer.step() naming the VW, stage, wave and
bytes; a push and a pull from rank 1 claiming VW 0 stage 0 (rank 0's), and a pull of a far-future wave,
each blamed on its transport source (the exception's ``sender``), not on the rank the header claims.
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

import hetpipe_core
from hetpipe.ps.core_plane import CoreShardServer, CoreShardState
from hetpipe.transport.protocol import PULL, PUSH, Header
from hetpipe.transport.mpi import MPITransport
from hetpipe.transport.slots import slot_bytes

COMM = MPI.COMM_WORLD
NUMEL = 1000   # the shard: one layer of 1000 floats, held by each VW's only stage
SHARD = 2      # the shard's rank: after the stage ranks, as in a run


def close(srv: CoreShardServer) -> None:
    srv.service.stop()
    srv.transport.close()


def server(comm) -> CoreShardServer:
    state = CoreShardState(0, {0: np.zeros(NUMEL, np.float32)}, [[(0, 1)], [(0, 1)]], 0)
    pool = hetpipe_core.PinnedBufferPool(1, 4096, -1)
    return CoreShardServer(state, MPITransport(comm, pool), pool, 2, comm)


def send_push(transport, pool, wave: int, numel: int, payload: bool = True) -> None:
    """A push of wave ``wave`` claiming VW 0 stage 0 with ``numel`` floats (only its header without payload)."""
    nbytes = 4 * numel
    if not payload:
        words = Header(PUSH, 0, 0, -1, wave, "float32", (numel,), nbytes).encode()
        COMM.Send([words, MPI.INT64_T], dest=SHARD, tag=2 * PUSH)
        return
    slot = pool.acquire(nbytes, timeout=10)
    slot_bytes(slot, nbytes).view(np.float32)[:] = 0.5
    transport.send(SHARD, Header(PUSH, 0, 0, -1, wave, "float32", (numel,), nbytes), slot)
    while transport.pending_sends():
        transport.progress()


def send_pull(wave: int) -> None:
    """The header of a pull of wave ``wave`` claiming VW 0 stage 0."""
    COMM.Send([Header(PULL, 0, 0, -1, wave).encode(), MPI.INT64_T], dest=SHARD, tag=2 * PULL)


def expect_failure(srv: CoreShardServer, deadline_s: float = 20.0) -> dict:
    """Step until the service's failure surfaces as an exception; its type and message, and its sender."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            srv.step()
        except Exception as e:  # noqa: BLE001 - the failure under test
            return {"error": f"{type(e).__name__}: {e}", "sender": getattr(e, "sender", None)}
        time.sleep(0.001)
    return {"error": "no failure", "sender": None}


def main() -> int:
    rank = COMM.Get_rank()
    pool = hetpipe_core.PinnedBufferPool(2, 8192, -1)
    transport = MPITransport(COMM, pool)
    results = []
    # 1. Start and stop with nothing received.
    if rank == SHARD:
        srv = server(COMM)
        srv.step()
        srv.service.stop()
        results.append({"case": "idle_stop", "lost": srv.service.lost()})
        close(srv)
    COMM.Barrier()
    # 2. A push header whose payload never comes, then stop.
    if rank == 0:
        send_push(transport, pool, 0, NUMEL, payload=False)
    if rank == SHARD:
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
    if rank == SHARD:
        srv = server(COMM)
        srv.step()
    COMM.Barrier()
    if rank == 0:
        send_push(transport, pool, 1, NUMEL - 1, payload=False)
    if rank == SHARD:
        results.append({"case": "wrong_size", **expect_failure(srv)})
        close(srv)
    COMM.Barrier()
    # 4. A duplicate push (wave 0 twice).
    if rank == SHARD:
        srv = server(COMM)
        srv.step()
    COMM.Barrier()
    if rank == 0:
        send_push(transport, pool, 0, NUMEL)
        send_push(transport, pool, 0, NUMEL)
    if rank == SHARD:
        results.append({"case": "duplicate", **expect_failure(srv)})
        close(srv)
    COMM.Barrier()
    # 5. A push beyond the staleness window (wave 5 at clock 0, D = 0).
    if rank == SHARD:
        srv = server(COMM)
        srv.step()
    COMM.Barrier()
    if rank == 0:
        send_push(transport, pool, 5, NUMEL, payload=False)
    if rank == SHARD:
        results.append({"case": "beyond_window", **expect_failure(srv)})
        close(srv)
    COMM.Barrier()
    # 6-8. Rank 1 (VW 1's stage) forges VW 0 stage 0's push, then its pull; rank 0 pulls a far-future wave.
    for case, who, send in (("forged_push", 1, lambda: send_push(transport, pool, 0, NUMEL, payload=False)),
                            ("forged_pull", 1, lambda: send_pull(1)),
                            ("far_pull", 0, lambda: send_pull(7))):
        if rank == SHARD:
            srv = server(COMM)
            srv.step()
        COMM.Barrier()
        if rank == who:
            send()
        if rank == SHARD:
            results.append({"case": case, **expect_failure(srv)})
            close(srv)
        COMM.Barrier()
    if rank == SHARD:
        drain(COMM)
        for r in results:
            print("RESULT " + json.dumps(r), flush=True)
    return 0


def drain(comm) -> None:
    """Receive what the refused messages left: the duplicate push's payload, sent behind the header the
    service refused. MPI_Finalize fails on a communicator holding an unmatched message; this rank would
    then exit without finalizing, and mpiexec kill the ranks still finalizing (SIGKILL)."""
    status = MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        comm.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE], source=status.Get_source(), tag=status.Get_tag())


if __name__ == "__main__":
    sys.exit(main())
