"""Point-to-point transport over an mpi4py communicator: non-blocking Isend/Irecv of headers and pinned-slot
payloads, a payload above the chunk size as consecutive chunks (:func:`hetpipe.transport.protocol.chunks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from hetpipe.transport.base import Transport
from hetpipe.transport.protocol import (ANY, CHUNK_WORD, HEADER_WORDS, KIND_NAMES, Header, Message, TransportError,
                                       chunk_bytes, chunks, cut)
from hetpipe.transport.slots import slot_bytes, slot_shortage, try_acquire


class MPITransport(Transport):
    """Point-to-point transport over an mpi4py communicator with non-blocking buffer-based calls; payloads
    above ``chunk`` bytes (None: :func:`~hetpipe.transport.protocol.chunk_bytes`) go in chunks."""

    def __init__(self, comm, pool, chunk: Optional[int] = None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.pool = pool
        self.chunk = chunk_bytes() if chunk is None else chunk
        self._sends: List[Tuple[list, object]] = []     # ([requests], slot or None)
        self._recvs: Dict[Tuple[int, int], "_PendingRecv"] = {}     # (src, kind) -> receive in progress
        self.slot_wait = ""

    def send(self, dest: int, header: Header, slot=None) -> None:
        words = header.encode()
        at = cut(words, self.chunk)
        reqs = [self.comm.Isend([words, self._MPI.INT64_T], dest=dest, tag=2 * header.kind)]
        if header.nbytes:
            data = slot_bytes(slot, header.nbytes)
            reqs += [self.comm.Isend([data[off:off + n], self._MPI.BYTE], dest=dest, tag=2 * header.kind + 1)
                     for off, n in chunks(header.nbytes, at)]
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
            data = slot_bytes(rv.slot, rv.header.nbytes)
            rv.payload_req = [self.comm.Irecv([data[off:off + n], MPI.BYTE], source=rv.src, tag=2 * kind + 1)
                              for off, n in chunks(rv.header.nbytes, int(rv.words[CHUNK_WORD]))]
        if rv.payload_req is not None and not MPI.Request.Testall(rv.payload_req):
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
            for req in [rv.header_req, *(rv.payload_req or ())]:
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
    payload_req: Optional[List[object]] = None     # one receive per chunk
