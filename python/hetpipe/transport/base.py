"""The interface of a rank's message endpoint (the wire format: :mod:`hetpipe.transport.protocol`).

Two implementations: :class:`~hetpipe.transport.mpi.MPITransport` (mpi4py's non-blocking buffer calls)
and :class:`~hetpipe.transport.loopback.LoopbackTransport` (the single-process replay's in-process
hub, so the replay runs the very same executor and parameter-server code).

Calling contract (both): one thread per endpoint (the rank's main thread). ``send`` never blocks: it
takes ownership of the slot and releases it once the transfer completed (``progress``).
``try_recv`` never blocks: it returns a :class:`Message` once one from ``src`` (or any source with
``ANY``) of that kind has fully arrived, else ``None``; calling it again continues the same receive.
A payload waits for a free pool slot without blocking: ``slot_wait`` then says so (else it is "").
With ``keep_slot`` the message may instead hand over the pool slot the payload arrived in (``slot``
set, ``payload`` a view of it): the caller then releases the slot, e.g. after an asynchronous
host→device copy out of it.
"""

from __future__ import annotations

from typing import Any, FrozenSet, Optional, Protocol, Tuple

from hetpipe.transport.protocol import Header, Message, TransportError


class Link(Protocol):
    """A stage's array-level endpoint, what the PS client (:mod:`hetpipe.ps.client`) sends through.

    Implemented by the torch stage's ``StageLink`` (tensors on its device, through the copy stream)
    and by ``ArrayLink`` (NumPy arrays). Calling contract: one thread; neither call blocks. ``send``
    returns False (nothing sent) while no pool slot is free, ``try_recv`` None until the message is
    there; ``waiting_for`` then says why (else ""). A payload is a flat array of the front end's
    family; it must not change until its message arrived. A payload taken with ``deferred=True`` may
    still be filling (a copy onto the device in flight): ``use(payload)`` before reading it."""

    waiting_for: str

    def send(self, dest: int, header: Header, payload: Any) -> bool: ...

    def send_header(self, dest: int, header: Header) -> None: ...

    def try_recv(self, src: int, kind: int, deferred: bool = False) -> Optional[Tuple[Header, Any]]: ...

    def use(self, payload: Any) -> None: ...


class Transport:
    """Interface of a rank's endpoint. ``pool`` stages payloads; ``rank`` is this endpoint's address.

    ``device_peers``: the ranks this endpoint sends and receives tensors to and from directly
    (``send_tensor`` / ``try_recv_tensor``, no pool slot); empty for a transport of pinned slots only."""

    rank: int
    slot_wait: str = ""
    device_peers: FrozenSet[int] = frozenset()

    def send(self, dest: int, header: Header, slot=None) -> None:
        """Start sending ``header`` (and the first ``header.nbytes`` of ``slot``) to ``dest``; never blocks.

        Takes ownership of ``slot``: it goes back to the pool when the transfer has completed."""
        raise NotImplementedError

    def try_recv(self, src: int, kind: int, keep_slot: bool = False) -> Optional[Message]:
        """Progress the receive of the next ``kind`` message from ``src`` (or ``ANY``); never blocks.

        ``keep_slot``: the message may hand its payload's slot to the caller (see the module docstring)."""
        raise NotImplementedError

    def progress(self) -> None:
        """Complete finished sends and release their slots."""
        raise NotImplementedError

    def pending_sends(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Give back everything still held. Call after ``pending_sends() == 0``."""

    def send_tensor(self, dest: int, header: Header, t) -> None:
        """Start sending tensor ``t`` to ``dest``, one of ``device_peers``; never blocks."""
        raise TransportError(f"transport: rank {self.rank} has no tensor channel to rank {dest}")

    def try_recv_tensor(self, src: int, kind: int):
        """The next ``kind`` message from ``src`` (one of ``device_peers``) as ``(header, tensor)``, or None."""
        raise TransportError(f"transport: rank {self.rank} has no tensor channel from rank {src}")
