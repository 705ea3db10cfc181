"""Overlapped device↔pinned-host copies of a stage's payloads, on one copy stream per direction.

Every payload a stage sends or receives through pinned slots goes through here when the stage has
copy streams (``transport.link``): activations, gradients and tied gradients to and from peers
without a device channel, wave pushes to the PS shards and their pull replies.

Outgoing: ``copy_out`` enqueues the copy of a tensor into a pinned pool slot on the outgoing stream,
ordered after the compute that produced the tensor, and records a :class:`hetpipe_core.Event` for
that copy; ``ready_sends`` hands out the slots whose copy completed, in enqueue order (so per-peer
message order is the order of ``copy_out`` calls). Incoming: ``copy_in`` enqueues the copy of a
received payload onto the device on the incoming stream and makes torch's compute stream wait for
that copy's own event, or, for a payload taken ahead of its use, leaves that wait to ``order_after``
(compute enqueued meanwhile then does not wait for the copy); the payload's slot goes back to the
pool once the copy completed (``poll``).
Nothing here blocks the host.

Why two streams: work on one stream runs in enqueue order, so on a single copy stream a received
activation or pull reply would wait behind every outgoing push enqueued before it (a push is the
size of the stage's weights). With one stream per direction a receive waits only for earlier
receives, and the compute stream waits for the one copy it needs, not for the stream.

Ordering with torch's compute stream: torch wraps the core's streams
(``torch.cuda.ExternalStream(stream.handle)``) and enqueues the waits on the GPU (the core's own
``Stream.wait_external`` is the route for frameworks without such a wrapper, docs/design.md): the
outgoing stream waits for the point of the compute stream where the tensor was produced (an event
recorded there) before its device→host copy; the compute stream waits for a torch event recorded
after the host→device copy it reads. A tensor copied in is allocated on the incoming stream and
marked as used by the compute stream, so the caching allocator never reuses its memory early.

On CPU tensors the same class runs on the core's CPU streams (a worker thread each; ``copy_in`` then
waits for its copy's event, as CPU compute cannot wait on the queue); the runtime uses it there only
when asked to (``RunSpec.copy_stream``): the default CPU path copies inline, with no thread hop.
Thread role: one thread (the stage's) calls every method.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import hetpipe_core
from hetpipe.transport.protocol import Header, Message
from hetpipe.transport.slots import try_acquire


@dataclass
class _InFlight:
    """One enqueued copy: its completion event, the slot it fills or drains, what must outlive it."""

    event: "hetpipe_core.Event"
    slot: object
    keep: Tuple[object, ...]
    send_to: Optional[Tuple[int, Header]] = None     # outgoing: (destination rank, header)


class _HostOrder:
    """Ordering on the CPU: torch's CPU compute is synchronous, so there is nothing to wait for."""

    def before_copy_out(self) -> None:
        return None

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def after_copy_in(self, t: torch.Tensor, event: "hetpipe_core.Event") -> None:
        # torch's CPU compute cannot wait on the worker thread's queue: wait for this copy here.
        event.synchronize()

    def later(self, t: torch.Tensor, event: "hetpipe_core.Event") -> Callable[[], None]:
        """``after_copy_in`` for the copy just enqueued, to call when ``t`` is first used."""
        return event.synchronize


class _CudaOrder:
    """Ordering between torch's current stream on ``device`` and the core's two copy streams."""

    def __init__(self, outward: "hetpipe_core.Stream", inward: "hetpipe_core.Stream", device: torch.device) -> None:
        self.device = device
        self.outward = torch.cuda.ExternalStream(outward.handle, device=device)
        self.inward = torch.cuda.ExternalStream(inward.handle, device=device)

    def before_copy_out(self) -> None:
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        self.outward.wait_event(produced)

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with torch.cuda.stream(self.inward):
            return torch.empty(tuple(shape), dtype=dtype, device=device)

    def after_copy_in(self, t: torch.Tensor, event: "hetpipe_core.Event") -> None:
        copied = torch.cuda.Event()
        copied.record(self.inward)              # just after this copy: earlier receives only, no push
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copied)
        t.record_stream(compute)

    def later(self, t: torch.Tensor, event: "hetpipe_core.Event") -> Callable[[], None]:
        """``after_copy_in`` for the copy just enqueued, to call when ``t`` is first used: the compute
        stream then waits for that copy only, not for what the copy stream took on since."""
        mark = torch.cuda.Event()
        mark.record(self.inward)                # just after this copy: earlier receives only, no push

        def order() -> None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(mark)
            t.record_stream(compute)
        return order


class CopyStager:
    """A stage's copy streams, one per direction, and its copies in flight (see the module docstring)."""

    def __init__(self, pool, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.out_stream, self.in_stream = hetpipe_core.Stream(index), hetpipe_core.Stream(index)
            self.order = _CudaOrder(self.out_stream, self.in_stream, torch.device("cuda", index))
        else:
            self.out_stream, self.in_stream = hetpipe_core.Stream(-1), hetpipe_core.Stream(-1)
            self.order = _HostOrder()
        self._out: Deque[_InFlight] = collections.deque()
        self._in: List[_InFlight] = []
        # Tensors copied in whose use is not yet ordered after their copy: id -> (tensor, its ordering).
        self._unordered: Dict[int, Tuple[torch.Tensor, Callable[[], None]]] = {}

    @staticmethod
    def _record(stream: "hetpipe_core.Stream") -> "hetpipe_core.Event":
        event = hetpipe_core.Event()
        event.record(stream)
        return event

    def copy_out(self, t: torch.Tensor, dest: int, header: Header) -> bool:
        """Enqueue the copy of ``t`` (``header.nbytes`` bytes) into a fresh slot, to send to ``dest``;
        False (nothing enqueued) while every slot is in use."""
        t = t.detach().contiguous()
        slot = try_acquire(self.pool, header.nbytes)
        if slot is None:
            return False
        self.order.before_copy_out()
        if header.nbytes:
            hetpipe_core.copy_async(slot, t.data_ptr(), header.nbytes, self.out_stream)
        self._out.append(_InFlight(self._record(self.out_stream), slot, (t,), (dest, header)))
        return True

    def ready_sends(self) -> Iterator[Tuple[int, Header, object]]:
        """``(dest, header, slot)`` of the oldest outgoing copies that completed, oldest first; the
        caller takes ownership of each slot."""
        while self._out and self._out[0].event.query():
            done = self._out.popleft()
            dest, header = done.send_to
            yield dest, header, done.slot

    def copy_in(self, msg: Message, dtype: torch.dtype, order: bool = True) -> torch.Tensor:
        """A device tensor of ``msg``'s shape that holds its payload once the enqueued copy completed;
        torch's compute stream is ordered after that copy now, or (``order=False``) by
        :meth:`order_after` before the tensor is read. Takes ownership of ``msg.slot``."""
        t = self.order.empty(msg.header.shape, dtype, self.device)
        src = msg.slot if msg.slot is not None else msg.payload
        if msg.header.nbytes:
            hetpipe_core.copy_async(t.data_ptr(), src, msg.header.nbytes, self.in_stream)
        event = self._record(self.in_stream)
        self._in.append(_InFlight(event, msg.slot, (msg.payload, t)))
        if order:
            self.order.after_copy_in(t, event)
        else:
            self._unordered[id(t)] = (t, self.order.later(t, event))
        return t

    def order_after(self, t: torch.Tensor) -> None:
        """Order torch's compute stream after the copy filling ``t`` (copied in with ``order=False``);
        nothing to do for a tensor already ordered."""
        held = self._unordered.pop(id(t), None)
        if held is not None:
            held[1]()

    def poll(self) -> None:
        """Give the slots of completed incoming copies back to the pool."""
        if not self._in:
            return
        keep = []
        for c in self._in:
            if c.event.query():
                if c.slot is not None:
                    self.pool.release(c.slot)
            else:
                keep.append(c)
        self._in = keep

    def pending(self) -> int:
        """Copies not yet handed out (outgoing) or whose slot is not yet released (incoming)."""
        return len(self._out) + len(self._in)

    def wait(self) -> None:
        """Block (without spinning) until every copy enqueued so far completed: the newest copy's own
        event in each direction (each stream runs its copies in order), not the streams' later work."""
        for pending in (self._out, self._in):
            if pending:
                pending[-1].event.synchronize()

    def close(self) -> None:
        """Wait for every enqueued copy, give all slots back, and release the streams."""
        self.out_stream.synchronize()
        self.in_stream.synchronize()
        for c in [*self._out, *self._in]:
            if c.slot is not None:
                self.pool.release(c.slot)
        self._out.clear()
        self._in.clear()
        self._unordered.clear()
        self.out_stream.close()
        self.in_stream.close()
