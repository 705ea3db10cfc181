"""The torch-p2p transport: stage-to-stage payloads over torch.distributed channels, the rest over MPI.

A stage rank with channels (``transport.torch_groups``) to some peers sends those peers its payloads
as tensors, device to device with NCCL (CUDA tensors) or host to host with gloo (CPU tensors), with
no pinned-host staging; the 16-word :class:`Header` of each still goes over MPI, on one tag per
sender (``HEADER_TAG``), so a receiver sees a channel's headers in the order they were sent (MPI's
non-overtaking rule). Everything else — the PS pushes, pulls and replies, DONE — goes over MPI from
pinned slots exactly as :class:`MPITransport`, whose interface this class keeps.

Ordering (docs/design.md, "Transports"): a channel's payloads are sent in header order, and the
receiver posts the receive of each as soon as its header arrives, in header order, whatever kind it
is; so the k-th send of a channel always meets the k-th receive. NCCL blocks a channel's stream
until the matching receive is posted; each channel has its own group (own communicator and stream),
and the receiver posts its receives on every ``progress``, never waiting for an instruction that
wants the payload: a send is never stuck behind a receive that waits for it.

Completion: NCCL work is polled (``Work.is_completed`` queries its CUDA event). Gloo's work only
completes inside ``Work.wait``: a gloo receive is waited for once its header arrived (its payload was
posted before the header, so the wait lasts the transfer, and needs nothing from the sender's
thread); gloo sends are waited for by one waiter thread per peer, whose futures are polled.
Thread role: one thread (the rank's) calls every method; the waiter threads only call ``wait``.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

import numpy as np
import torch

from hetpipe.transport.mpi import MPITransport
from hetpipe.transport.protocol import HEADER_WORDS, KIND_NAMES, Header, TransportError
from hetpipe.transport.torch_groups import GLOO, Channels

# The MPI tag of every channel payload's header: above the 2 * kind (+ 1) tags of ``transport.protocol``.
HEADER_TAG = 64


class _Done:
    """Completion of a transfer that moved nothing (a zero-byte payload)."""

    def done(self) -> bool:
        return True


class _Waited:
    """Completion of a gloo receive whose payload is under way: waited for when asked."""

    def __init__(self, work) -> None:
        self.work = work

    def done(self) -> bool:
        self.work.wait()
        return True


class _Polled:
    """Completion of NCCL work: its CUDA event, queried without blocking."""

    def __init__(self, work) -> None:
        self.work = work

    def done(self) -> bool:
        return self.work.is_completed()


@dataclass
class _Transfer:
    """A payload in flight on a channel: its header, its tensor (kept alive until done), its completion."""

    header: Header
    tensor: torch.Tensor
    completion: object
    work: object = None


class TorchP2PTransport(MPITransport):
    """MPI (pinned slots) to every rank, plus tensor channels to ``channels.peers()``."""

    def __init__(self, comm, pool, channels: Channels) -> None:
        super().__init__(comm, pool)
        self.channels = channels
        self.device = channels.device
        self.device_peers = frozenset(channels.peers())
        self._waiters: Dict[int, ThreadPoolExecutor] = {}
        self._out: List[_Transfer] = []
        self._arrived: Dict[Tuple[int, int], Deque[_Transfer]] = collections.defaultdict(collections.deque)
        self._headers: Dict[int, Tuple[np.ndarray, object]] = {}
        for peer in sorted(self.device_peers):
            self._post_header(peer)

    # --- completion -------------------------------------------------------------------------------
    def _completion(self, direction: str, peer: int, work):
        if self.channels.flavour != GLOO:
            return _Polled(work)
        if direction == "recv":
            return _Waited(work)
        if peer not in self._waiters:
            self._waiters[peer] = ThreadPoolExecutor(1, thread_name_prefix=f"hetpipe-send-{peer}")
        return self._waiters[peer].submit(work.wait)

    # --- sending ----------------------------------------------------------------------------------
    def send_tensor(self, dest: int, header: Header, t: torch.Tensor) -> None:
        """Start sending ``t`` (contiguous, on this rank's device, ``header.nbytes`` bytes) to ``dest``
        over their channel; never blocks. The payload is posted before its header, so a receiver that
        has the header finds the payload under way."""
        t = t.detach().contiguous()
        if header.nbytes:
            work = self.channels.outgoing(dest).send([t], 1, 0)
            self._out.append(_Transfer(header, t, self._completion("send", dest, work), work))
        words = header.encode()
        self._sends.append(([self.comm.Isend([words, self._MPI.INT64_T], dest=dest, tag=HEADER_TAG), words], None))

    def progress(self) -> None:
        super().progress()
        if self._out:
            self._out = [x for x in self._out if not x.completion.done()]
        for peer in sorted(self.device_peers):
            self._pump(peer)

    def pending_sends(self) -> int:
        return super().pending_sends() + len(self._out)

    # --- receiving --------------------------------------------------------------------------------
    def _post_header(self, peer: int) -> None:
        words = np.empty(HEADER_WORDS, dtype=np.int64)
        self._headers[peer] = (words, self.comm.Irecv([words, self._MPI.INT64_T], source=peer, tag=HEADER_TAG))

    def _pump(self, peer: int) -> None:
        """Post the payload receive of every header arrived from ``peer``, in header order."""
        while True:
            words, req = self._headers[peer]
            if not req.Test():
                return
            header = Header.decode(words)
            t = torch.empty(header.shape, dtype=getattr(torch, header.dtype), device=self.device)
            if header.nbytes:
                work = self.channels.incoming(peer).recv([t], 0, 0)
                self._arrived[(peer, header.kind)].append(_Transfer(header, t, self._completion("recv", peer, work),
                                                                    work))
            else:
                self._arrived[(peer, header.kind)].append(_Transfer(header, t, _Done()))
            self._post_header(peer)

    def try_recv_tensor(self, src: int, kind: int) -> Optional[Tuple[Header, torch.Tensor]]:
        """The next ``kind`` payload from channel peer ``src`` as a tensor on this rank's device, once it
        arrived; never blocks. On CUDA torch's current stream is ordered after the transfer."""
        self._pump(src)
        queue = self._arrived.get((src, kind))
        if not queue or not queue[0].completion.done():
            return None
        got = queue.popleft()
        if got.work is not None and self.channels.flavour != GLOO:
            got.work.wait()     # NCCL: the current stream waits for the channel's stream (no host wait)
        return got.header, got.tensor

    # --- teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel the header receives, wait for the transfers in flight, shut the channels down, then
        close the MPI part. Raises :class:`TransportError` if a payload arrived that nobody took."""
        lost = [f"{KIND_NAMES.get(x.header.kind, x.header.kind)} message {x.header} from rank {src}"
                for (src, _), queue in self._arrived.items() for x in queue]
        for peer, (_, req) in self._headers.items():
            req.Cancel()
            status = self._MPI.Status()
            req.Wait(status)
            if not status.Is_cancelled():
                lost.append(f"a header from rank {peer}")
        if self.channels.flavour == GLOO:
            for waiter in self._waiters.values():
                waiter.shutdown(wait=True)      # each waits for its sends in flight
            for x in (x for q in self._arrived.values() for x in q):
                x.completion.done()
        else:
            for x in [*self._out, *(x for q in self._arrived.values() for x in q)]:
                if x.work is not None:
                    x.work.wait()
            torch.cuda.synchronize(self.device)
        self._headers.clear()
        self._arrived.clear()
        self._out.clear()
        self.channels.close()
        try:
            super().close()
        finally:
            if lost:
                raise TransportError(f"transport: rank {self.rank} closed with channel message(s) nobody received: "
                                     f"{'; '.join(lost)}")
