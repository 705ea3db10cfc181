"""The TCP listeners a rank holds once torch-p2p's channels are open: between ranks 0 and 1, both
ways, on one host (``one_host`` as the registry decides it) or as across hosts (the control).

Each rank reads its own listening sockets from /proc (the kernel's table, matched to this process's
file descriptors) before and after opening the channels, and prints ``RESULT {"rank", "one_host",
"listening": [address, ...], "moved"}``: the addresses of the sockets the channels added (MPI's own
listeners, there before, are MPI's); ``moved``: a tensor crossed the channel after the listing.

Usage: mpiexec -n 2 python listeners.py one-host|several-hosts
"""

import json
import os
import socket
import struct
import sys

import torch
from mpi4py import MPI

from hetpipe.transport.torch_groups import GLOO, open_channels


def _address(hex_addr: str) -> str:
    ip, _ = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack("<I", w) for w in struct.unpack(">4I", raw)))


def listening() -> list:
    """This process's TCP sockets in state LISTEN, as (inode, local address) pairs."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:
                found.append((f[9], _address(f[1])))
    return sorted(set(found))


def main() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    one_host = sys.argv[1] == "one-host"
    before = set(listening())
    channels = open_channels(comm, [(0, 1), (1, 0)], GLOO, torch.device("cpu"), 30.0, one_host=one_host)
    held = sorted({address for inode, address in set(listening()) - before})
    t = torch.full((4,), 7.0) if rank == 0 else torch.zeros(4)
    if rank == 0:
        channels.outgoing(1).send([t], 1, 0).wait()
    else:
        channels.incoming(0).recv([t], 0, 0).wait()
    moved = bool((t == 7.0).all())
    comm.Barrier()
    channels.close()
    got = comm.gather({"rank": rank, "one_host": one_host, "listening": held, "moved": moved}, root=0)
    if rank == 0:                   # one writer: the ranks' lines never interleave
        for r in got:
            print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
