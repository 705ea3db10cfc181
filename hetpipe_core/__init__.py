"""The compiled core of hetpipe: pinned buffers, streams, WSP clocks, parameter-shard arithmetic.

Framework-agnostic: importing it needs no torch, no MPI and no GPU. The PS shard's MPI service lives in
the separate extension ``hetpipe_core._mpi`` (built when MPI was found, ``build_info()["mpi_built"]``;
import mpi4py first, which loads the MPI library it links). Memory leaves through DLPack and
the buffer protocol, so torch, numpy or any other framework can view it without a copy, and enters
the same way: copy_async and the shard arithmetic take numpy, torch, JAX or CuPy arrays directly.
"""

from hetpipe_core._C import (
    ClockTable,
    Event,
    PinnedBufferPool,
    ShardPlane,
    Slot,
    Stream,
    accumulate_change,
    apply_delta,
    build_info,
    copy_async,
    cuda_context_active,
    shard_threads,
    snapshot,
    wire_protocol,
)

# The API. The compiled module's benchmark and stress helpers are reachable from hetpipe_core.bench only.
__all__ = [
    "ClockTable", "Event", "PinnedBufferPool", "ShardPlane", "Slot", "Stream", "accumulate_change", "apply_delta",
    "build_info", "copy_async", "cuda_context_active", "shard_threads", "snapshot", "wire_protocol",
]

__version__ = build_info()["version"]
