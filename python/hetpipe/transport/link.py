"""A stage's tensor-level endpoint: the one interface its executor and PS client send and receive through.

``send(dest, header, t)`` and ``try_recv(src, kind)`` move tensors; how is the backend's business:
to a peer of a device channel (``Transport.device_peers``, the torch-p2p backend) the tensor goes
as it is, device to device; to every other rank (the PS shards always) it goes through a pinned pool
slot of the rank's slot transport — copied device→slot on the outgoing copy stream and sent once the
copy completed when the stage has a :class:`CopyStager`, else copied inline — and a received payload
comes back slot→device on the incoming copy stream (or inline). Neither call blocks: ``send`` returns False
while no pool slot is free, ``try_recv`` None until the message is there; ``waiting_for`` then says why.

Thread role: the stage's executor thread calls every method.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from hetpipe.transport.base import Transport
from hetpipe.transport.codec import payload_tensor, tensor_to_slot
from hetpipe.transport.device_copy import CopyStager
from hetpipe.transport.protocol import Header
from hetpipe.transport.slots import slot_shortage


class StageLink:
    """``transport`` (slots over ``pool``) and, when given, ``stager`` (the copy streams), as tensors on ``device``."""

    def __init__(self, transport: Transport, pool, device: torch.device, stager: Optional[CopyStager] = None) -> None:
        self.transport, self.pool, self.device, self.stager = transport, pool, device, stager
        self.device_peers = transport.device_peers
        self.waiting_for = ""

    def send(self, dest: int, header: Header, t: torch.Tensor) -> bool:
        """Start sending ``t`` (``header.nbytes`` bytes) to ``dest``; False (nothing sent) while no slot is free.

        ``t`` must not change until its message arrived: the executor sends tensors it no longer
        writes (outputs, input gradients, tied gradients, a finished wave's delta)."""
        if dest in self.device_peers:
            self.transport.send_tensor(dest, header, t)
            return True
        if self.stager is not None:
            sent = self.stager.copy_out(t, dest, header)
        else:
            slot, _ = tensor_to_slot(self.pool, t)
            sent = slot is not None
            if sent:
                self.transport.send(dest, header, slot)
        self.waiting_for = "" if sent else slot_shortage(self.pool)
        return sent

    def send_header(self, dest: int, header: Header) -> None:
        """Send a message without payload (a pull request, DONE)."""
        self.transport.send(dest, header)

    def try_recv(self, src: int, kind: int, deferred: bool = False) -> Optional[Tuple[Header, torch.Tensor]]:
        """The next ``kind`` message from ``src``: its header and its payload as a ``header.dtype`` tensor
        of ``header.shape`` on this stage's device (torch's current stream ordered after its copy), or None.

        ``deferred``: the payload is taken ahead of its use (an early pull reply): its copy onto the
        device is enqueued now, but torch's stream is ordered after it only by :meth:`use`, so compute
        enqueued meanwhile does not wait for it."""
        if src in self.device_peers:
            self.waiting_for = ""
            return self.transport.try_recv_tensor(src, kind)
        msg = self.transport.try_recv(src, kind, keep_slot=self.stager is not None)
        self.waiting_for = self.transport.slot_wait
        if msg is None:
            return None
        h = msg.header
        if self.stager is not None:
            return h, self.stager.copy_in(msg, getattr(torch, h.dtype), order=not deferred)
        return h, payload_tensor(msg.payload, h.dtype, h.shape, self.device)

    def use(self, t: torch.Tensor) -> None:
        """Order torch's current stream after the copy that fills ``t``, a payload taken with
        ``deferred=True``; nothing to do for any other tensor."""
        if self.stager is not None:
            self.stager.order_after(t)

    def slot_limit(self, dest: int) -> Optional[int]:
        """The most bytes one message to ``dest`` may carry (a pool slot), None when unbounded."""
        return None if dest in self.device_peers else self.pool.slot_bytes

    def progress(self) -> bool:
        """Progress the transport; send the outgoing copies that completed, release the slots of finished
        incoming ones. True if a message was sent."""
        self.transport.progress()
        if self.stager is None:
            return False
        sent = False
        for dest, header, slot in self.stager.ready_sends():
            self.transport.send(dest, header, slot)
            sent = True
        self.stager.poll()
        return sent

    def copies_pending(self) -> int:
        """Copies enqueued on the copy streams and not yet handed to the transport or released."""
        return self.stager.pending() if self.stager is not None else 0

    def wait_for_copies(self) -> bool:
        """Block (without spinning) until the enqueued copies completed; False if there were none."""
        if not self.copies_pending():
            return False
        self.stager.wait()
        return True

    def pending_sends(self) -> int:
        return self.transport.pending_sends()
