"""A core StageEndpoint whose MPI call fails (a send to a rank outside the communicator: MPI_ERR_RANK
under mpi4py's MPI_ERRORS_RETURN, what a rank sees when a peer is gone) raises MPITransferError, and
the failure report is one line with no traceback, as for mpi4py's own MPI.Exception. An endpoint that
has not failed keeps error_kind ''. Prints one JSON line (see tests/mpi/test_stage_endpoint.py).
"""

import contextlib
import io
import json
import sys
import time

from mpi4py import MPI

import hetpipe_core
from hetpipe.job import failure
from hetpipe.transport.core import CoreTransport
from hetpipe.transport.protocol import ACT, Header

GIVE_UP_S = 30.0                     # a hang guard for the progress thread's failure, not a bound under test
comm = MPI.COMM_WORLD
pool = hetpipe_core.PinnedBufferPool(2, 1 << 12, -1)
transport = CoreTransport(comm, pool)
out = {"kind_before": transport.endpoint.error_kind}
transport.send(comm.Get_size(), Header(ACT, 0, 0, 0, -1, "uint8", (0,), 0))
error = None
end = time.monotonic() + GIVE_UP_S
while error is None and time.monotonic() < end:
    try:
        transport.progress()
        time.sleep(1e-3)
    except Exception as e:  # noqa: BLE001 - the test reports whatever was raised
        error = e
stderr = io.StringIO()
with contextlib.redirect_stderr(stderr):
    failure.report("rank 0 (vw 0 stage 0)", error)
out.update(kind_after=transport.endpoint.error_kind, raised=type(error).__name__, message=str(error),
           transport_failure=failure.transport_failure(error), report=stderr.getvalue())
transport.endpoint.close()
sys.stdout.write("\nRESULT " + json.dumps(out) + "\n")
sys.stdout.flush()
