"""Parameter-server shard: WSP clocks, deterministic wave aggregation, staleness-gated pulls.

A shard owns some layers' weights ``W`` (float32, one flat array per layer). Protocol (our WSP spec):

* Push ``(vw, stage, wave, delta)``: the stage's wave delta for the shard's layers inside the stage.
  A VW's clock at the shard becomes ``c + 1`` once every stage of that VW holding layers of this shard
  has pushed wave ``c`` (waves complete in order). A duplicate push is an error.
* Wave ``c``'s deltas are applied (``hetpipe_core.apply_delta``; VW 0 first, then 1, ..., each VW's
  stages in order) exactly when the global clock (min over VWs) passes ``c``; hence ``W`` is always
  ``W_g``, ``g`` = global clock (the version: every wave ``< g`` applied). The order is logged.
  ``aggregate="sum"`` adds every VW's delta (HetPipe's rule); ``"mean"`` adds each divided by the
  number of VWs (the step of one VW, as data-parallel SGD averages gradients).
* Synced buffers (BatchNorm running statistics) ride at the end of each push as the stage's current
  values ``P``; when wave ``c`` is applied, ``B`` becomes the VWs' average of their wave-``c`` values
  (computed as ``B + mean(P - B)``, so a buffer no VW changed stays bitwise the same).
* Replicas: a stage holding a tied parameter owned by a layer of this shard outside the stage pulls
  the parameter's slice too (``replicas``), after its own layers' weights; it never pushes it.
* Pull ``(vw, stage, w)``: queued until ``g >= w - D``, then answered with ``(g, W_g)`` restricted to
  the stage's layers, then its replica slices, then ``B_g`` of its layers. With ``D = 0`` every pull
  gets ``g = w``: runs are reproducible. With ``D >= 1`` the ``g`` a pull gets depends on timing; it is
  logged, and a replay following a run's record (:mod:`hetpipe.runtime.record`, ``ShardState.script``)
  gives every pull the recorded ``g`` by holding back the application of wave ``g`` until the pulls
  recorded at ``g`` are answered.
* DONE ``(vw, stage, n)``: the stage finished and sent ``n`` pushes here; the shard is finished once
  every stage said DONE and all announced pushes have arrived.

Invariant, checked at every clock change: ``0 <= clock_vw - global <= D + 1``.
Thread role: :class:`ShardState` is pure logic for one thread; :class:`ShardServer` drives it over a
transport from the shard rank's main thread (or from the replay loop). Over MPI a shard rank runs the
compiled core's data plane instead (:mod:`hetpipe.runtime.ps_core`, same protocol, same bits).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

import hetpipe_core
from hetpipe.runtime.transport import ANY, DONE, PULL, PUSH, WEIGHTS, Header, Transport, slot_bytes, slot_shortage
from hetpipe.schedule.trace import PS_VW, TraceEvent

if TYPE_CHECKING:
    from hetpipe.runtime.record import ShardScript


class WSPViolation(RuntimeError):
    """The PS saw something WSP forbids: a duplicate push, a broken clock bound, a malformed push."""


@dataclass
class ShardLog:
    """What happened at a shard, for run-time checks and tests."""

    pushes: List[Tuple[int, int, int]] = field(default_factory=list)      # (vw, stage, wave), arrival order
    clocks: List[Tuple[int, int, int]] = field(default_factory=list)      # (vw, clock_vw, global) after each change
    pulls: List[Tuple[int, int, int, int]] = field(default_factory=list)  # (vw, stage, wave, g) as answered
    pull_clocks: List[int] = field(default_factory=list)                 # clock_vw of the puller, per pull
    applied: List[Tuple[int, int, int]] = field(default_factory=list)     # (vw, stage, wave), as applied
    pushed_sum: Dict[int, np.ndarray] = field(default_factory=dict)       # layer -> float64 sum of applied deltas


def held_layers(weights: Dict[int, np.ndarray], buffers: Dict[int, np.ndarray],
                stage_layers: Sequence[Sequence[Tuple[int, int]]]) -> List[Dict[int, List[int]]]:
    """Per VW, the stages holding layers of the shard (with weights or synced buffers), and which,
    from each stage's ``[start, stop)`` layer range."""
    out: List[Dict[int, List[int]]] = []
    for vw_stages in stage_layers:
        per = {}
        for s, (a, b) in enumerate(vw_stages):
            mine = [l for l in sorted(weights) if a <= l < b and (weights[l].size > 0 or buffers[l].size > 0)]
            if mine:
                per[s] = mine
        out.append(per)
    return out


def check_aggregate(index: int, aggregate: str) -> None:
    """ValueError naming the shard unless ``aggregate`` is "sum" or "mean"."""
    if aggregate not in ("sum", "mean"):
        raise ValueError(f"PS shard {index}: aggregate must be 'sum' or 'mean', got {aggregate!r}")


class ShardState:
    """One shard's weights, clocks and pending wave deltas (no I/O)."""

    def __init__(self, index: int, weights: Dict[int, np.ndarray], stage_layers: Sequence[Sequence[Tuple[int, int]]],
                 d: int, *, log_sums: bool = False, buffers: Optional[Dict[int, np.ndarray]] = None,
                 replicas: Optional[Dict[Tuple[int, int], Sequence[Tuple[int, int, int]]]] = None,
                 aggregate: str = "sum") -> None:
        check_aggregate(index, aggregate)
        self.index = index
        self.d = d
        self.aggregate = aggregate
        self.layers = sorted(weights)
        self.W = {l: np.ascontiguousarray(weights[l], dtype=np.float32).copy() for l in self.layers}
        buffers = buffers or {}
        self.B = {l: np.ascontiguousarray(buffers.get(l, np.zeros(0)), dtype=np.float32).copy() for l in self.layers}
        self.num_vws = len(stage_layers)
        self.stage_layers = held_layers(self.W, self.B, stage_layers)
        # (vw, stage) -> (layer, offset, numel) slices of W it pulls as replicas of tied parameters.
        self.replicas = {k: list(v) for k, v in (replicas or {}).items() if v}
        self.clock = hetpipe_core.ClockTable(self.num_vws)
        self.applied = 0                                            # waves < applied are in W
        # Called with ``applied`` each time a wave is applied (checkpoints: W is then the global W_applied).
        self.on_applied: Optional[Callable[[int], None]] = None
        self.pending: Dict[int, Dict[int, Dict[int, np.ndarray]]] = collections.defaultdict(dict)  # wave->vw->layer
        self.pending_buffers: Dict[int, Dict[int, Dict[int, np.ndarray]]] = collections.defaultdict(dict)
        self.arrived: Dict[Tuple[int, int], Set[int]] = collections.defaultdict(set)  # (vw, wave) -> stages
        self.seen: Set[Tuple[int, int, int]] = set()
        self.queued: List[Tuple[int, int, int, int]] = []           # (src, vw, stage, wave) waiting for the clock
        self.log = ShardLog()
        # Per-layer buffers of applied waves, reused for the next pushes (fresh pages of this size
        # cost as much to fault in as the copy itself).
        self.spare: Dict[int, List[np.ndarray]] = collections.defaultdict(list)
        self.log_sums = log_sums
        # A replay following a run's record (runtime.record.ShardScript): the version each pull gets and
        # the order each wave is applied in. None: this shard's own rules (a run, or a plain replay).
        self.script: Optional["ShardScript"] = None
        if log_sums:
            self.log.pushed_sum = {l: np.zeros(self.W[l].size, dtype=np.float64) for l in self.layers}

    @property
    def global_clock(self) -> int:
        return int(self.clock.global_clock())

    @property
    def _scale(self) -> int:
        """What each VW's delta is divided by before it is applied."""
        return self.num_vws if self.aggregate == "mean" else 1

    def stage_numel(self, vw: int, stage: int) -> int:
        """Elements of a push from the stage: its layers' weights, then their synced buffers."""
        mine = self.stage_layers[vw].get(stage, ())
        return sum(self.W[l].size + self.B[l].size for l in mine)

    def reply_numel(self, vw: int, stage: int) -> int:
        """Elements of a pull reply to the stage: weights, replica slices, synced buffers."""
        return self.stage_numel(vw, stage) + sum(n for _, _, n in self.replicas.get((vw, stage), ()))

    def pulls_from(self, vw: int, stage: int) -> bool:
        return stage in self.stage_layers[vw] or (vw, stage) in self.replicas

    # --- pushes ----------------------------------------------------------------------------------
    def push(self, vw: int, stage: int, wave: int, delta: np.ndarray) -> None:
        key = (vw, stage, wave)
        if key in self.seen:
            raise WSPViolation(f"PS shard {self.index}: duplicate push of wave {wave} from VW {vw} stage {stage}")
        if stage not in self.stage_layers[vw]:
            raise WSPViolation(f"PS shard {self.index}: VW {vw} stage {stage} holds none of its layers but pushed")
        if delta.dtype != np.float32 or delta.size != self.stage_numel(vw, stage):
            raise WSPViolation(f"PS shard {self.index}: push from VW {vw} stage {stage} wave {wave} is "
                               f"{delta.dtype}[{delta.size}], expected float32[{self.stage_numel(vw, stage)}]")
        if wave < int(self.clock.clock(vw)):
            raise WSPViolation(f"PS shard {self.index}: VW {vw} stage {stage} pushed wave {wave} "
                               f"but VW {vw} is already at clock {int(self.clock.clock(vw))}")
        self.seen.add(key)
        self.log.pushes.append(key)
        off = 0
        parts = self.pending[wave].setdefault(vw, {})
        for l in self.stage_layers[vw][stage]:
            n = self.W[l].size
            parts[l] = self.spare[l].pop() if self.spare[l] else np.empty(n, dtype=np.float32)
            np.copyto(parts[l], delta[off:off + n])
            if self.log_sums:
                self.log.pushed_sum[l] += parts[l] / self._scale
            off += n
        values = self.pending_buffers[wave].setdefault(vw, {})
        for l in self.stage_layers[vw][stage]:
            n = self.B[l].size
            if n:
                values[l] = delta[off:off + n].copy()
                off += n
        self.arrived[(vw, wave)].add(stage)
        self._advance(vw)

    def _advance(self, vw: int) -> None:
        need = set(self.stage_layers[vw])
        while True:
            c = int(self.clock.clock(vw))
            if self.arrived.get((vw, c)) != need:
                break
            del self.arrived[(vw, c)]
            self.clock.advance(vw)
            g = self.global_clock
            cv = int(self.clock.clock(vw))
            self.log.clocks.append((vw, cv, g))
            if not 0 <= cv - g <= self.d + 1:
                raise WSPViolation(f"PS shard {self.index}: VW {vw} clock {cv} vs global {g} breaks "
                                   f"0 <= clock - global <= D + 1 with D = {self.d}")
            self._apply_ready()

    def _apply_ready(self) -> None:
        """Apply every wave the global clock has passed, in VW then stage order (deterministic), or in a
        script's order; a script holds wave ``c`` back while a pull it gives version ``c`` is unanswered."""
        g = self.global_clock
        while self.applied < g:
            c = self.applied
            if self.script is not None and self.script.holds(c):
                return
            order = self.script.order(c) if self.script is not None else self.apply_order()
            wave = self.pending.pop(c)
            for vw, stage in order:
                for l in self.stage_layers[vw][stage]:
                    delta = wave[vw][l]
                    if self._scale > 1:
                        np.divide(delta, np.float32(self._scale), out=delta)
                    hetpipe_core.apply_delta(self.W[l], delta)
                    self.spare[l].append(delta)
                self.log.applied.append((vw, stage, c))
            self._average_buffers(self.pending_buffers.pop(c, {}), list(dict.fromkeys(vw for vw, _ in order)))
            self.applied += 1
            if self.on_applied is not None:
                self.on_applied(self.applied)

    def apply_order(self) -> List[Tuple[int, int]]:
        """The (vw, stage) pushes of one wave, in the order this shard applies them on its own."""
        return [(vw, s) for vw in range(self.num_vws) for s in sorted(self.stage_layers[vw])]

    def _average_buffers(self, values: Dict[int, Dict[int, np.ndarray]], vws: Sequence[int]) -> None:
        """B <- the VWs' average of the buffer values they pushed for one wave (summed in ``vws`` order)."""
        for l in self.layers:
            pushed = [values[vw][l] for vw in vws if l in values.get(vw, {})]
            if not pushed:
                continue
            if len(pushed) == 1:
                np.copyto(self.B[l], pushed[0])
                continue
            change = np.zeros_like(self.B[l])
            for p in pushed:
                change += p - self.B[l]
            self.B[l] += change / np.float32(len(pushed))

    # --- pulls -----------------------------------------------------------------------------------
    def pull(self, src: int, vw: int, stage: int, wave: int) -> None:
        if not self.pulls_from(vw, stage):
            raise WSPViolation(f"PS shard {self.index}: VW {vw} stage {stage} holds none of its layers but pulled")
        self.queued.append((src, vw, stage, wave))

    def ready_pulls(self, limit: Optional[int] = None) -> List[Tuple[int, int, int, int]]:
        """Remove and return the queued pulls the staleness bound now allows (under a script: those whose
        recorded version ``W`` now is), in arrival order (at most ``limit`` of them; the others stay
        queued). Each is answered with ``W_applied``; call :meth:`answered` once their replies are taken."""
        if self.script is None:
            ok = lambda q: q[3] - self.d <= self.global_clock  # noqa: E731
        else:
            ok = lambda q: self.script.due(q[1], q[2], q[3], self.applied)  # noqa: E731
        ready = [q for q in self.queued if ok(q)][:limit]
        self.queued = [q for q in self.queued if q not in ready]
        for (_, vw, stage, wave) in ready:
            self.log.pulls.append((vw, stage, wave, self.applied))
            self.log.pull_clocks.append(int(self.clock.clock(vw)))
        return ready

    def answered(self, pulls: Sequence[Tuple[int, int, int, int]]) -> None:
        """The replies of ``pulls`` (from :meth:`ready_pulls`) were taken: a script may release waves."""
        if self.script is not None and pulls:
            for (_, vw, stage, wave) in pulls:
                self.script.served(vw, stage, wave)
            self._apply_ready()

    def snapshot_into(self, vw: int, stage: int, out: np.ndarray) -> None:
        """Copy ``W_g`` of the stage's layers (layer order), its replica slices, then ``B_g`` of its
        layers into ``out`` (float32)."""
        off = 0
        mine = self.stage_layers[vw].get(stage, ())
        for l in mine:
            n = self.W[l].size
            hetpipe_core.snapshot(self.W[l], out[off:off + n])
            off += n
        for l, a, n in self.replicas.get((vw, stage), ()):
            out[off:off + n] = self.W[l][a:a + n]
            off += n
        for l in mine:
            n = self.B[l].size
            out[off:off + n] = self.B[l]
            off += n


class ShardServer:
    """Drives a :class:`ShardState` over a transport; ``step()`` handles what has arrived, never blocks."""

    def __init__(self, state: ShardState, transport: Transport, pool, num_stage_ranks: int, *,
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

    def step(self) -> bool:
        t = self.transport
        t.progress()
        progressed = False
        while True:
            msg = t.try_recv(ANY, PUSH)
            if msg is None:
                break
            h = msg.header
            # A push from a stage holding none of the shard's layers is left to ShardState.push to name.
            known = 0 <= h.vw < self.state.num_vws and h.stage in self.state.stage_layers[h.vw]
            want = self.state.stage_numel(h.vw, h.stage) if known else 0
            if known and (h.dtype != "float32" or h.nbytes != 4 * want):
                raise WSPViolation(f"PS shard {self.state.index}: push from VW {h.vw} stage {h.stage} wave {h.aux} "
                                   f"is {h.dtype}{list(h.shape)} ({h.nbytes} bytes), expected float32[{want}] "
                                   f"({4 * want} bytes)")
            started, applied = time.perf_counter(), self.state.applied
            self.state.push(h.vw, h.stage, h.aux, msg.payload.view(np.float32))
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
            if self.state.script is not None:
                self.blocked_on += f", {self.state.script.waiting(self.state.applied)}"
        return progressed

    def _receive_done(self) -> bool:
        """Take the DONE messages that arrived; whether there was one."""
        got = False
        while True:
            msg = self.transport.try_recv(ANY, DONE)
            if msg is None:
                return got
            self.done[(msg.header.vw, msg.header.stage)] = msg.header.aux
            got = True

    def _record(self, kind: str, started: float, wave: int, label: str) -> None:
        self.trace.append(TraceEvent(PS_VW, self.state.index, kind, started - self.t0,
                                     time.perf_counter() - started, -1, wave, label))

    @property
    def weights(self) -> Dict[int, np.ndarray]:
        return self.state.W
