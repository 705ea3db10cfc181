"""A PS shard rank's server: what every shard server shares (DONE bookkeeping, the timeline, the end
condition's inputs) and :class:`ShardServer`, which drives the Python shard over a transport.

The core plane's server (:class:`hetpipe.ps.core_plane.CoreShardServer`) shares :class:`ShardServerBase`
and steps the compiled service instead. Thread role: one thread (the shard rank's main thread, or the
replay loop) calls ``step()``, which never blocks.
"""

from __future__ import annotations

import collections
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from hetpipe.ps.shard import ShardState, ShardView, WSPViolation, check_source
from hetpipe.schedule.trace import PS_VW, TraceEvent
from hetpipe.transport.base import Transport
from hetpipe.transport.protocol import ANY, DONE, PULL, PUSH, STOPPED, WEIGHTS, Header
from hetpipe.transport.slots import slot_bytes, slot_shortage


class ShardServerBase:
    """A shard's server without its data path: the state it serves, the DONE messages received, the
    timeline rows (``PS_VW``), and ``finished`` / ``blocked_on`` for the driver. Subclasses define ``step()``."""

    def __init__(self, state: ShardView, transport: Transport, pool, num_stage_ranks: int, *,
                 trace: Optional[List[TraceEvent]] = None, t0: float = 0.0) -> None:
        self.state = state
        # Timeline rows of this shard (``PS_VW``): pushes received and applied, pulls served.
        self.trace, self.t0 = trace, t0
        self.transport = transport
        self.pool = pool
        self.num_stage_ranks = num_stage_ranks
        self.done: Dict[Tuple[int, int], int] = {}         # (vw, stage) -> pushes it announced
        self.received: Dict[Tuple[int, int], int] = collections.Counter()
        self.finished = False
        self.blocked_on = "messages from the stages"

    def _receive_done(self) -> bool:
        """Take the DONE messages that arrived; whether there was one."""
        got = False
        while True:
            msg = self.transport.try_recv(ANY, DONE)
            if msg is None:
                return got
            check_source(self.state.index, self.state.stage_ranks, msg.header.vw, msg.header.stage, msg.src, "DONE",
                         msg.header.aux)
            self.done[(msg.header.vw, msg.header.stage)] = msg.header.aux
            got = True

    def _record(self, kind: str, started: float, wave: int, label: str) -> None:
        self.trace.append(TraceEvent(PS_VW, self.state.index, kind, started - self.t0,
                                     time.perf_counter() - started, -1, wave, label))

    @property
    def weights(self) -> Dict[int, np.ndarray]:
        return self.state.W

    def step(self) -> bool:
        """Handle what has arrived; True if anything moved. Never blocks."""
        raise NotImplementedError


class ShardServer(ShardServerBase):
    """Drives a Python :class:`ShardState` over a transport; ``step()`` handles what has arrived, never blocks."""

    state: ShardState

    def step(self) -> bool:
        t = self.transport
        t.progress()
        progressed = False
        while True:
            msg = t.try_recv(ANY, PUSH)
            if msg is None:
                break
            h = msg.header
            self.state.check_source(h.vw, h.stage, msg.src, "push", h.aux)
            # A push from a stage holding none of the shard's layers is left to ShardState.push to name.
            known = h.stage in self.state.stage_layers[h.vw]
            want = self.state.stage_numel(h.vw, h.stage) if known else 0
            if known and (h.dtype != "float32" or h.nbytes != 4 * want):
                raise WSPViolation(f"PS shard {self.state.index}: push from VW {h.vw} stage {h.stage} wave {h.aux} "
                                   f"(rank {msg.src}) is {h.dtype}{list(h.shape)} ({h.nbytes} bytes), expected "
                                   f"float32[{want}] ({4 * want} bytes)", sender=msg.src)
            started, applied = time.perf_counter(), self.state.applied
            if h.mb >= 0:
                self.state.announce_stop(h.vw, h.stage, h.mb)
            self.state.push(h.vw, h.stage, h.aux, msg.payload.view(np.float32), src=msg.src)
            self.received[(h.vw, h.stage)] += 1
            if self.trace is not None:
                label = f"push w{h.aux} VW {h.vw}.{h.stage}"
                if self.state.applied > applied:
                    label += f"; applied wave(s) {applied}..{self.state.applied - 1}"
                self._record("PUSH", started, h.aux, label)
            progressed = True
        while True:
            msg = t.try_recv(ANY, PULL)
            if msg is None:
                break
            h = msg.header
            self.state.pull(msg.src, h.vw, h.stage, h.aux)
            progressed = True
        progressed = self._receive_done() or progressed
        for src, vw, stage, wave in self.state.stopped_pulls():
            t.send(src, Header(WEIGHTS, vw, stage, wave, STOPPED, "float32", (0,), 0))
            progressed = True
        g, version = self.state.global_clock, self.state.applied
        # Each reply takes a slot; pulls beyond the free slots stay queued until sends complete.
        ready = self.state.ready_pulls(limit=self.pool.available())
        for src, vw, stage, wave in ready:
            started = time.perf_counter()
            n = self.state.reply_numel(vw, stage)
            slot = self.pool.acquire(max(4 * n, 1), timeout=0)
            self.state.snapshot_into(vw, stage, slot_bytes(slot, 4 * n).view(np.float32))
            t.send(src, Header(WEIGHTS, vw, stage, wave, version, "float32", (n,), 4 * n), slot)
            if self.trace is not None:
                self._record("PULL", started, wave, f"pull w{wave} VW {vw}.{stage} (g={version})")
            progressed = True
        self.state.answered(ready)
        t.progress()
        if (len(self.done) == self.num_stage_ranks and not self.state.queued and t.pending_sends() == 0
                and all(self.received[k] == n for k, n in self.done.items())):
            if not self.finished:
                self.finished = True
                progressed = True
        else:
            waiting = self.num_stage_ranks - len(self.done)
            self.blocked_on = (f"messages from the stages ({waiting} not done, global clock {g}, "
                               f"{len(self.state.queued)} pull(s) queued)")
            if self.state.queued and self.pool.available() == 0:
                self.blocked_on += f", blocked on {slot_shortage(self.pool)} for pull replies"
            if t.slot_wait:
                self.blocked_on += f", blocked on {t.slot_wait}"
            gated = self.state.gate.waiting(self.state.applied)
            if gated:
                self.blocked_on += f", {gated}"
        return progressed
