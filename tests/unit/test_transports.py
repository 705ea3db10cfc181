"""The transport registry: which backend serves which rank (automatic and forced), and that the replay's
endpoints carry messages."""

import numpy as np
import pytest
import torch

import hetpipe_core
from hetpipe.transport import registry as transports
from hetpipe.transport.protocol import ACT, Header
from hetpipe.transport.loopback import LoopbackHub
from hetpipe.transport.mpi import MPITransport
from hetpipe.transport.slots import slot_bytes, try_acquire
from hetpipe.transport.registry import LoopbackPort, TransportChoiceError


def test_the_backends_are_tried_loopback_then_device_to_device_then_pinned_host():
    assert transports.names()[:3] == ("loopback", "torch-p2p", "mpi-host")


def test_an_mpi_communicator_on_cpu_gets_the_pinned_host_backend_with_its_reason():
    from mpi4py import MPI

    backend, reason = transports.choose([torch.device("cpu")], MPI.COMM_SELF)
    assert backend.name == "mpi-host"
    assert isinstance(backend.open(MPI.COMM_SELF, hetpipe_core.PinnedBufferPool(1, 64), None), MPITransport)
    assert reason.startswith("mpi-host: ") and "cpu" in reason
    _, shard_reason = transports.choose([], MPI.COMM_SELF)
    assert "PS shard" in shard_reason


def test_gloo_serves_a_cpu_stage_only_when_forced():
    from mpi4py import MPI

    backend, reason = transports.choose([torch.device("cpu")], MPI.COMM_SELF, forced="torch-p2p")
    assert backend.name == "torch-p2p" and "gloo" in reason and reason.endswith("(forced)")


def test_a_cuda_stage_without_nccl_falls_back_automatically_and_a_forced_torch_p2p_says_why():
    from mpi4py import MPI
    import torch.distributed as dist

    if dist.is_nccl_available():
        pytest.skip("this torch build has NCCL")
    backend, _ = transports.choose([torch.device("cuda", 1)], MPI.COMM_SELF)
    assert backend.name == "mpi-host"
    with pytest.raises(TransportChoiceError, match=r"'torch-p2p' cannot serve it: .*cuda:1 needs NCCL"):
        transports.choose([torch.device("cuda", 1)], MPI.COMM_SELF, forced="torch-p2p")


def test_forcing_a_backend_that_cannot_serve_or_does_not_exist_is_refused():
    from mpi4py import MPI

    with pytest.raises(TransportChoiceError, match="'loopback' cannot serve it: .*single-process replay"):
        transports.choose([torch.device("cpu")], MPI.COMM_SELF, forced="loopback")
    with pytest.raises(TransportChoiceError, match="'torch-p2p' cannot serve it: .*PS shard rank has no device"):
        transports.choose([], MPI.COMM_SELF, forced="torch-p2p")
    with pytest.raises(TransportChoiceError, match=r"no transport backend named 'ib' \(registered: loopback, "):
        transports.choose([torch.device("cpu")], MPI.COMM_SELF, forced="ib")


def test_a_loopback_port_gets_an_endpoint_that_delivers_to_its_peer():
    hub = LoopbackHub()
    pools = [hetpipe_core.PinnedBufferPool(2, 64) for _ in range(2)]
    ends = []
    for rank, pool in enumerate(pools):
        backend, reason = transports.choose([], LoopbackPort(hub, rank))
        assert backend.name == "loopback" and reason.startswith("loopback: ")
        ends.append(backend.open(LoopbackPort(hub, rank), pool, None))
    slot = try_acquire(pools[0], 8)
    slot_bytes(slot, 8)[:] = np.arange(8, dtype=np.uint8)
    ends[0].send(1, Header(ACT, 0, 0, 3, -1, "uint8", (8,), 8), slot)
    msg = ends[1].try_recv(0, ACT)
    assert msg.header.mb == 3 and msg.payload.tolist() == list(range(8))
    assert pools[0].available() == pools[0].num_slots         # the sender's slot went back


def test_a_duplicate_name_is_refused():
    with pytest.raises(ValueError, match="'mpi-host' is already registered"):
        transports.register("mpi-host", MPITransport, lambda devices, comm: transports.Fit(True, ""))


def test_a_channel_uses_torch_p2p_only_between_ranks_of_one_kind_on_different_gpus():
    from hetpipe.transport.registry import RankChoice, unjoinable

    def rank(device: str, host: str = "n0", backend: str = "torch-p2p"):
        flavour = None if backend != "torch-p2p" else ("nccl" if device.startswith("cuda") else "gloo")
        return RankChoice(None, backend, flavour, device, host)

    assert unjoinable(rank("cuda:0"), rank("cuda:1")) == ""
    assert unjoinable(rank("cuda:0"), rank("cuda:0", host="n1")) == ""
    assert unjoinable(rank("cpu"), rank("cpu")) == ""
    assert "one GPU (cuda:0 of n0)" in unjoinable(rank("cuda:0"), rank("cuda:0"))
    assert "not nccl with gloo" in unjoinable(rank("cuda:0"), rank("cpu"))
    assert unjoinable(rank("cuda:0"), rank("cpu", backend="mpi-host")) == "one uses mpi-host"
