"""torch.distributed initialisation for the stage ranks: one two-member process group per directed channel.

A channel ``(src, dst)`` (MPI ranks of two stages) carries the payloads ``src`` sends ``dst`` and
nothing else; its group has ``src`` as group rank 0 and ``dst`` as group rank 1, built over a
:class:`torch.distributed.PrefixStore` of one job-wide store. No default process group is created (so
several runs may follow each other in one process, and the MPI communicator may be a
sub-communicator): the groups are constructed directly.

Listeners. When every member runs on one host, nothing listens beyond it: the store is a
:class:`torch.distributed.FileStore` in a directory only the job's user can open (created by the
lowest member, removed when it closes), and gloo's pairs bind the loopback address. Across hosts
the store is a :class:`torch.distributed.TCPStore` served by the lowest member at its host name (or
``HETPIPE_STORE_HOST``), and gloo binds the interface of the host's name (or ``GLOO_SOCKET_IFNAME``):
like torch.distributed's own rendezvous, it trusts the cluster's network (docs/clusters.md).

Collective order (docs/design.md, "Transports"): every rank of ``comm`` calls :func:`open_channels`
with the same channel list. The store's address goes from the lowest member rank to all over
``comm.bcast``; then each member constructs its channels' groups, and connects them with one
one-element transfer each, in the list's sorted order. Both steps block a member until the channel's
other member joins; since every member visits its channels in one global order, the smallest
channel not yet connected always has both members waiting on it, so start-up cannot deadlock.
NCCL creates its communicators lazily at a group's first transfer; the connecting transfer makes
that happen here, in order, and not at a first send in the middle of training.

Thread role: the rank's main thread. Lifetime: :meth:`Channels.close` once no transfer is in flight.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

Channel = Tuple[int, int]       # (sending MPI rank, receiving MPI rank)

# The flavours of the torch backend: the torch.distributed backend moving a stage's tensors.
NCCL = "nccl"       # CUDA tensors, GPU to GPU
GLOO = "gloo"       # CPU tensors
STORE_HOST_ENV = "HETPIPE_STORE_HOST"   # the address other ranks reach the store's host at (default: its name)


@dataclass
class Channels:
    """This rank's process groups, by channel; the store they were built over."""

    rank: int
    flavour: str
    device: torch.device
    groups: Dict[Channel, object] = field(default_factory=dict)
    store: Optional[object] = None
    store_dir: Optional[str] = None         # the one-host FileStore's directory, removed by its creator

    def outgoing(self, dst: int):
        """The group of channel (this rank, dst); this rank is its group rank 0."""
        return self.groups[(self.rank, dst)]

    def incoming(self, src: int):
        """The group of channel (src, this rank); this rank is its group rank 1."""
        return self.groups[(src, self.rank)]

    def peers(self) -> List[int]:
        """Ranks this rank has channels to and from (both directions)."""
        out = {b for a, b in self.groups if a == self.rank}
        return sorted(out & {a for a, b in self.groups if b == self.rank})

    def close(self) -> None:
        """Shut the groups down (NCCL's communicators are freed) and drop the store."""
        for group in self.groups.values():
            if self.flavour == NCCL:
                group.shutdown()
        self.groups.clear()
        self.store = None
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None


def flavour_for(device: torch.device) -> Tuple[Optional[str], str]:
    """The torch.distributed backend that moves tensors of ``device`` point to point, with why;
    (None, why not) when this torch build has none."""
    if not dist.is_available():
        return None, "this torch build has no torch.distributed"
    if device.type == "cuda":
        if not dist.is_nccl_available():
            return None, f"{device} needs NCCL, which this torch build ({torch.__version__}) lacks"
        return NCCL, f"NCCL point-to-point, {device} to the peer's GPU with no host staging"
    if device.type == "cpu":
        if not dist.is_gloo_available():
            return None, f"this torch build ({torch.__version__}) lacks gloo for CPU tensors"
        return GLOO, "gloo point-to-point between host tensors"
    return None, f"no torch.distributed point-to-point backend for {device.type} tensors"


def open_channels(comm, channels: Iterable[Channel], flavour: str, device: torch.device,
                  timeout_s: float, one_host: bool = False) -> Channels:
    """Build and connect the groups of ``channels`` this rank is a member of (see the module
    docstring). Collective over ``comm``: every rank calls it with the same ``channels``.
    ``one_host``: all members run on this host, which then serves the store on its loopback address."""
    rank = comm.Get_rank()
    ordered = sorted(set(channels))
    mine = [c for c in ordered if rank in c]
    out = Channels(rank, flavour, device)
    members = sorted({r for c in ordered for r in c})
    if not members:
        return out
    timeout = datetime.timedelta(seconds=timeout_s)
    root = members[0]
    address = None
    if rank == root:
        if one_host:
            # A directory of the user's alone (mode 0700): the store's file is no listener, and no other
            # user's process can read or write the job's rendezvous.
            out.store_dir = tempfile.mkdtemp(prefix="hetpipe-store-")
            address = ("file", os.path.join(out.store_dir, "store"))
        else:
            host = os.environ.get(STORE_HOST_ENV) or socket.gethostname()
            out.store = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
            address = ("tcp", host, out.store.port)
    address = comm.bcast(address, root=root)
    if not mine:
        return out
    if out.store is None:
        out.store = dist.FileStore(address[1], -1) if address[0] == "file" else \
            dist.TCPStore(address[1], address[2], is_master=False, timeout=timeout)
    for src, dst in mine:
        name = f"hetpipe/channel/{src}/{dst}"
        out.groups[(src, dst)] = _group(flavour, dist.PrefixStore(name, out.store), name, 0 if rank == src else 1,
                                        timeout, loopback=address[0] == "file")
        _connect(out.groups[(src, dst)], rank == src, device)
    return out


def _group(flavour: str, store, name: str, group_rank: int, timeout: datetime.timedelta, loopback: bool = False):
    if flavour == GLOO:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # One host: the pair's sockets bind loopback, not the interface of the host's name.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback else
                            dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, group_rank, 2, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.group_name = name
    return dist.ProcessGroupNCCL(store, group_rank, 2, options)


def _connect(group, sender: bool, device: torch.device) -> None:
    """One blocking one-element transfer over a fresh group: both members have joined when it returns."""
    t = torch.ones(1, device=device) if sender else torch.empty(1, device=device)
    work = group.send([t], 1, 0) if sender else group.recv([t], 0, 0)
    work.wait()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def job_channels(pairs: Sequence[Tuple[int, int]]) -> List[Channel]:
    """Both directions of each pair of communicating ranks, sorted and without repeats."""
    return sorted({c for a, b in pairs for c in ((a, b), (b, a))})
