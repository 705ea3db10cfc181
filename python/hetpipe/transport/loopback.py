"""The in-process transport of a single-process replay: per destination, a FIFO of delivered messages."""

from __future__ import annotations

import collections
from typing import Deque, Dict, Optional

import numpy as np

from hetpipe.transport.base import Transport
from hetpipe.transport.protocol import ANY, Header, Message
from hetpipe.transport.slots import slot_bytes


class LoopbackHub:
    """The in-process "network" of a replay: per destination, a FIFO of delivered messages."""

    def __init__(self) -> None:
        self.queues: Dict[int, Deque[Message]] = collections.defaultdict(collections.deque)

    def endpoint(self, rank: int, pool) -> "LoopbackTransport":
        return LoopbackTransport(self, rank, pool)


class LoopbackTransport(Transport):
    """An endpoint of a :class:`LoopbackHub`. Delivery is immediate and FIFO per (sender, kind)."""

    def __init__(self, hub: LoopbackHub, rank: int, pool) -> None:
        self.hub = hub
        self.rank = rank
        self.pool = pool
        self.slot_wait = ""

    def send(self, dest: int, header: Header, slot=None) -> None:
        payload = slot_bytes(slot, header.nbytes).copy() if header.nbytes else np.empty(0, dtype=np.uint8)
        if slot is not None:
            self.pool.release(slot)
        self.hub.queues[dest].append(Message(self.rank, header, payload))

    def try_recv(self, src: int, kind: int, keep_slot: bool = False) -> Optional[Message]:
        q = self.hub.queues[self.rank]
        for i, msg in enumerate(q):
            if msg.header.kind == kind and (src == ANY or msg.src == src):
                del q[i]
                return msg
        return None

    def progress(self) -> None:
        return None

    def pending_sends(self) -> int:
        return 0
