"""The transport registry: which backend serves which rank, and that the replay's endpoints carry messages."""

import numpy as np
import pytest
import torch

import hetpipe_core
from hetpipe.runtime import transports
from hetpipe.runtime.transport import ACT, Header, LoopbackHub, MPITransport, slot_bytes, try_acquire
from hetpipe.runtime.transports import LoopbackPort


def test_both_backends_are_registered_and_the_loopback_is_tried_first():
    assert transports.names()[:2] == ("loopback", "mpi-host")


def test_an_mpi_communicator_gets_the_pinned_host_backend_with_its_reason():
    from mpi4py import MPI

    backend, reason = transports.choose([torch.device("cpu")], MPI.COMM_SELF)
    assert backend.name == "mpi-host" and backend.open is MPITransport
    assert reason.startswith("mpi-host: ") and "cpu" in reason
    _, shard_reason = transports.choose([], MPI.COMM_SELF)
    assert "PS shard" in shard_reason


def test_a_loopback_port_gets_an_endpoint_that_delivers_to_its_peer():
    hub = LoopbackHub()
    pools = [hetpipe_core.PinnedBufferPool(2, 64) for _ in range(2)]
    ends = []
    for rank, pool in enumerate(pools):
        backend, reason = transports.choose([], LoopbackPort(hub, rank))
        assert backend.name == "loopback" and reason.startswith("loopback: ")
        ends.append(backend.open(LoopbackPort(hub, rank), pool))
    slot = try_acquire(pools[0], 8)
    slot_bytes(slot, 8)[:] = np.arange(8, dtype=np.uint8)
    ends[0].send(1, Header(ACT, 0, 0, 3, -1, "uint8", (8,), 8), slot)
    msg = ends[1].try_recv(0, ACT)
    assert msg.header.mb == 3 and msg.payload.tolist() == list(range(8))
    assert pools[0].available() == pools[0].num_slots         # the sender's slot went back


def test_a_duplicate_name_is_refused():
    with pytest.raises(ValueError, match="'mpi-host' is already registered"):
        transports.register("mpi-host", MPITransport, lambda devices, comm: None)
