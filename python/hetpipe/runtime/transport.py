"""Message transport between ranks: fixed int64 headers plus raw bytes staged in pinned buffer slots.

Every message is a :class:`Header` (16 int64 words) followed, when ``nbytes > 0``, by the payload
bytes. The payload travels from and to :class:`hetpipe_core.PinnedBufferPool` slots; nothing on the
data path is pickled. Two implementations share one interface:

* :class:`MPITransport` — mpi4py buffer-based ``Isend``/``Irecv``; header and payload use two tags
  per message kind (``2 * kind`` and ``2 * kind + 1``). MPI's non-overtaking rule between one
  sender and one receiver on one tag keeps payloads paired with their headers.
* :class:`LoopbackTransport` — endpoints of one in-process :class:`LoopbackHub`, used by the
  single-process replay, so the replay runs the very same executor and parameter-server code.

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

import collections
import time
from dataclasses import dataclass
from typing import Deque, Dict, FrozenSet, List, Optional, Tuple

import numpy as np

ANY = -1
HEADER_WORDS = 16
MAX_NDIM = HEADER_WORDS - 8

# Message kinds. Each kind has its own tags, so receives of different kinds never steal each other's messages.
ACT = 1         # stage s -> s + 1: output activation of minibatch mb
GRAD = 2        # stage s -> s - 1: gradient of the input activation of minibatch mb
PUSH = 3        # stage -> PS shard: the stage's wave delta for the shard's layers (aux = wave)
PULL = 4        # stage -> PS shard: request the global weights for wave aux (no payload)
WEIGHTS = 5     # PS shard -> stage: reply to PULL; mb = the pulled wave, aux = the shard's global clock g,
                # payload = W_g
DONE = 6        # stage -> PS shard: the stage finished its stream (no payload)
TIED = 7        # stage -> stage of its VW: the gradients of the tied parameters both hold, for minibatch mb
KIND_NAMES = {ACT: "activation", GRAD: "gradient", PUSH: "push", PULL: "pull", WEIGHTS: "weights", DONE: "done",
              TIED: "tied gradient"}

# Wire dtypes, by torch's names (``getattr(torch, name)``); a header carries the index + 1.
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(DTYPES)}


class TransportError(RuntimeError):
    """A message was lost or cannot be delivered."""


@dataclass(frozen=True)
class Header:
    """What a message is: kind, sender's (vw, stage), minibatch, an auxiliary word, dtype and shape."""

    kind: int
    vw: int
    stage: int
    mb: int = -1
    aux: int = -1
    dtype: str = "uint8"
    shape: Tuple[int, ...] = ()
    nbytes: int = 0

    def encode(self) -> np.ndarray:
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"transport: tensors of rank > {MAX_NDIM} are not supported, got shape {self.shape}")
        words = np.zeros(HEADER_WORDS, dtype=np.int64)
        words[:8] = (self.kind, self.vw, self.stage, self.mb, self.aux, _DTYPE_CODE[self.dtype],
                     len(self.shape), self.nbytes)
        words[8:8 + len(self.shape)] = self.shape
        return words

    @classmethod
    def decode(cls, words: np.ndarray) -> "Header":
        kind, vw, stage, mb, aux, code, ndim, nbytes = (int(x) for x in words[:8])
        if not (1 <= code <= len(DTYPES)) or not (0 <= ndim <= MAX_NDIM) or nbytes < 0:
            raise ValueError(f"transport: corrupt header {words.tolist()}")
        return cls(kind, vw, stage, mb, aux, DTYPES[code - 1], tuple(int(x) for x in words[8:8 + ndim]), nbytes)


@dataclass
class Message:
    """A received message. ``payload`` is a private copy of the bytes (the slot is already released),
    or, when ``slot`` is set, a view of that pool slot, owned by the receiver."""

    src: int
    header: Header
    payload: np.ndarray     # uint8, length header.nbytes
    slot: object = None


def try_acquire(pool, nbytes: int):
    """A free slot of ``pool`` for ``nbytes`` bytes, or None when every slot is in use; never blocks.

    Slots are released by the thread that acquires them (as its transfers and copies complete), so
    waiting inside ``acquire`` would wait for itself: callers report the shortage and retry."""
    try:
        return pool.acquire(max(nbytes, 1), timeout=0)
    except TimeoutError:
        return None


def slot_shortage(pool) -> str:
    """What a caller that got no slot from ``try_acquire`` waits for, with the pool's occupancy."""
    total = pool.num_slots
    return f"a free pinned slot ({total - pool.available()} of {total} in use)"


def slot_bytes(slot, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of the first ``nbytes`` of a pool slot (shares its memory)."""
    return np.frombuffer(slot, dtype=np.uint8, count=nbytes)


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


class MPITransport(Transport):
    """Point-to-point transport over an mpi4py communicator with non-blocking buffer-based calls."""

    def __init__(self, comm, pool) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.pool = pool
        self._sends: List[Tuple[list, object]] = []     # ([requests], slot or None)
        self._recvs: Dict[Tuple[int, int], "_PendingRecv"] = {}     # (src, kind) -> receive in progress
        self.slot_wait = ""

    def send(self, dest: int, header: Header, slot=None) -> None:
        words = header.encode()
        reqs = [self.comm.Isend([words, self._MPI.INT64_T], dest=dest, tag=2 * header.kind)]
        if header.nbytes:
            reqs.append(self.comm.Isend([slot_bytes(slot, header.nbytes), self._MPI.BYTE], dest=dest,
                                        tag=2 * header.kind + 1))
        # The header array must outlive its Isend: keep it with the requests.
        self._sends.append((reqs + [words], slot))

    def progress(self) -> None:
        if not self._sends:
            return
        keep = []
        for entry in self._sends:
            reqs, slot = entry
            if all(r.Test() for r in reqs[:-1]):
                if slot is not None:
                    self.pool.release(slot)
            else:
                keep.append(entry)
        self._sends = keep

    def pending_sends(self) -> int:
        return len(self._sends)

    def try_recv(self, src: int, kind: int, keep_slot: bool = False) -> Optional[Message]:
        MPI = self._MPI
        key = (src, kind)
        rv = self._recvs.get(key)
        if rv is None:
            rv = _PendingRecv(np.empty(HEADER_WORDS, dtype=np.int64), MPI.Status())
            source = MPI.ANY_SOURCE if src == ANY else src
            rv.header_req = self.comm.Irecv([rv.words, MPI.INT64_T], source=source, tag=2 * kind)
            self._recvs[key] = rv
        if rv.header is None:
            if not rv.header_req.Test(rv.status):
                return None
            rv.header_req = None
            rv.header = Header.decode(rv.words)
            rv.src = rv.status.Get_source()
        if rv.header.nbytes and rv.slot is None:
            rv.slot = try_acquire(self.pool, rv.header.nbytes)
            if rv.slot is None:
                self.slot_wait = (f"{slot_shortage(self.pool)} for the payload of a {KIND_NAMES.get(kind, kind)} "
                                  f"message from rank {rv.src}")
                return None
            self.slot_wait = ""
            rv.payload_req = self.comm.Irecv([slot_bytes(rv.slot, rv.header.nbytes), MPI.BYTE],
                                             source=rv.src, tag=2 * kind + 1)
        if rv.payload_req is not None and not rv.payload_req.Test():
            return None
        del self._recvs[key]
        if rv.slot is not None and keep_slot:
            return Message(rv.src, rv.header, slot_bytes(rv.slot, rv.header.nbytes), rv.slot)
        if rv.slot is not None:
            payload = slot_bytes(rv.slot, rv.header.nbytes).copy()
            self.pool.release(rv.slot)
        else:
            payload = np.empty(0, dtype=np.uint8)
        return Message(rv.src, rv.header, payload)

    def close(self) -> None:
        """Cancel the receives in progress and give their slots back (each only once its request is
        complete, so no transfer still targets a released slot). Raises :class:`TransportError` if one of
        them had already consumed a message, whose content is then lost."""
        lost = []
        for (src, kind), rv in self._recvs.items():
            consumed = rv.header is not None
            for req in (rv.header_req, rv.payload_req):
                if req is not None:
                    req.Cancel()
                    status = self._MPI.Status()
                    req.Wait(status)
                    consumed = consumed or not status.Is_cancelled()
            if rv.slot is not None:
                self.pool.release(rv.slot)
            if consumed:
                what = f"{rv.header}" if rv.header is not None else "a header"
                lost.append(f"{KIND_NAMES.get(kind, kind)} message {what} from rank {rv.src if rv.src >= 0 else src}")
        self._recvs.clear()
        if lost:
            raise TransportError(f"transport: rank {self.rank} closed with unfinished receive(s) that had consumed "
                                 f"a message: {'; '.join(lost)}")


@dataclass
class _PendingRecv:
    """State of one receive in progress: header first, then the payload into a pool slot."""

    words: np.ndarray
    status: object
    header_req: object = None
    header: Optional[Header] = None
    src: int = -1
    slot: object = None
    payload_req: object = None


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


class Backoff:
    """Polling pause for a rank waiting on messages: 20 µs doubling up to 1 ms; reset on progress.

    Never busy-waits: several ranks share few cores, and a spinning rank would starve its peers."""

    def __init__(self, first_s: float = 20e-6, max_s: float = 1e-3) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.delay = first_s

    def reset(self) -> None:
        self.delay = self.first_s

    def wait(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, self.max_s)
