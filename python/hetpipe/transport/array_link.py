"""A host-array endpoint: the :class:`~hetpipe.transport.base.Link` of the NumPy and JAX front ends.

``send`` copies a NumPy array (or anything exposing the buffer protocol in host memory, a CPU JAX
array through ``np.asarray`` among them) into a pinned pool slot of the rank's transport and sends
it; ``try_recv`` returns the payload as a NumPy array of the header's dtype and shape, a private copy
the caller owns. No torch import.

Thread role: one thread (the rank's main thread) calls every method.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from hetpipe.transport.base import Transport
from hetpipe.transport.protocol import Header
from hetpipe.transport.slots import slot_bytes, slot_shortage, try_acquire


class ArrayLink:
    """``transport`` with its slots from ``pool``, moving host arrays."""

    def __init__(self, transport: Transport, pool) -> None:
        self.transport, self.pool = transport, pool
        self.waiting_for = ""

    def send(self, dest: int, header: Header, payload: Any) -> bool:
        """Start sending ``payload`` (``header.nbytes`` bytes of it) to ``dest``; False while no slot is free.

        The bytes are copied into the slot before this returns: the caller may reuse ``payload``."""
        data = np.ascontiguousarray(np.asarray(payload)).reshape(-1).view(np.uint8)
        if data.size != header.nbytes:
            raise ValueError(f"transport: a {header.dtype}{list(header.shape)} message to rank {dest} announces "
                             f"{header.nbytes} bytes, its payload holds {data.size}")
        slot = try_acquire(self.pool, header.nbytes)
        if slot is None:
            self.waiting_for = slot_shortage(self.pool)
            return False
        if header.nbytes:
            slot_bytes(slot, header.nbytes)[:] = data
        self.transport.send(dest, header, slot)
        self.waiting_for = ""
        return True

    def send_header(self, dest: int, header: Header) -> None:
        """Send a message without payload (a pull request, DONE)."""
        self.transport.send(dest, header)

    def try_recv(self, src: int, kind: int, deferred: bool = False) -> Optional[Tuple[Header, np.ndarray]]:
        """The next ``kind`` message from ``src``: its header and payload as an array, or None. The array is
        complete when returned, ``deferred`` or not."""
        msg = self.transport.try_recv(src, kind)
        self.waiting_for = self.transport.slot_wait
        if msg is None:
            return None
        h = msg.header
        return h, msg.payload.view(np.dtype(h.dtype)).reshape(h.shape)

    def use(self, payload: np.ndarray) -> None:
        """Nothing to wait for: a received array is complete when ``try_recv`` returns it."""

    def progress(self) -> None:
        self.transport.progress()

    def pending_sends(self) -> int:
        return self.transport.pending_sends()
