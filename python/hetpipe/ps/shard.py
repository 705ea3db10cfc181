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
* The outer optimizer (:mod:`hetpipe.plan.outer`, :mod:`hetpipe.ps.outer_step`) turns a wave's pushes into a
  step: ``outer="sgd"`` adds each push's ``delta / k`` times ``outer_lr`` as above (lr 1, no staleness decay,
  no gain: exactly the plain rule); ``"nesterov"`` sums the wave's ``delta / k`` into ``A`` (in apply
  order) and takes DiLoCo's outer step on the pseudo-gradient ``g = -A`` with the momentum buffer ``M``;
  ``"delayed-nesterov"`` adds each ``delta / k`` at once and takes a momentum step on the sum ``A`` of
  every ``outer_delay`` pushes. ``M`` and delayed-nesterov's ``A`` and count (per layer) are part of the
  shard's state. ``k`` is the gain (``N`` with ``"mean"``, else 1; ``sqrt(N)`` with ``outer_gain="sqrt"``)
  times the staleness decay (1, ``1 + s`` with ``outer_staleness="inverse"``, ``sqrt(1 + s)`` with
  ``"sqrt"``), ``s = c - v`` where ``v`` is the version the pushing stage's pull of wave ``c`` got (wave 0
  has no pull: ``s = 0``).
* Synced buffers (BatchNorm running statistics) ride at the end of each push as the stage's current
  values ``P``; when wave ``c`` is applied, ``B`` becomes the VWs' average of their wave-``c`` values
  (computed as ``B + mean(P - B)``, so a buffer no VW changed stays bitwise the same).
* Replicas: a stage holding a tied parameter owned by a layer of this shard outside the stage pulls
  the parameter's slice too (``replicas``), after its own layers' weights; it never pushes it.
* Pull ``(vw, stage, w)``: queued until ``g >= w - D``, then answered with ``(g, W_g)`` restricted to
  the stage's layers, then its replica slices, then ``B_g`` of its layers. With ``D = 0`` every pull
  gets ``g = w``: runs are reproducible. With ``D >= 1`` the ``g`` a pull gets depends on timing; it is
  logged, and a replay following a run's record (:mod:`hetpipe.run.record`, installed as the shard's
  :mod:`gate <hetpipe.ps.gate>`) gives every pull the recorded ``g`` by holding back the application of
  wave ``g`` until the pulls recorded at ``g`` are answered.
* DONE ``(vw, stage, n)``: the stage finished and sent ``n`` pushes here; the shard is finished once
  every stage said DONE and all announced pushes have arrived.

Invariant, checked at every clock change: ``0 <= clock_vw - global <= D + 1``.
Thread role: :class:`ShardState` is pure logic for one thread; :class:`ShardServer` drives it over a
transport from the shard rank's main thread (or from the replay loop). Over MPI a shard rank runs the
compiled core's data plane instead (:mod:`hetpipe.ps.core_plane`, same protocol, same bits).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Set, Tuple

import numpy as np

import hetpipe_core
from hetpipe.plan.outer import check_outer
from hetpipe.ps.gate import Gate, WSPGate
from hetpipe.util.errors import HetpipeError
from hetpipe.ps.outer_step import OuterStep, initial_delayed, initial_momentum

__all__ = ["ShardLog", "ShardState", "ShardView", "WSPViolation", "check_aggregate", "held_layers",
           "initial_delayed", "initial_momentum"]


class WSPViolation(HetpipeError, RuntimeError):
    """The PS saw something WSP forbids: a duplicate push, a broken clock bound, a malformed push.
    ``sender``: the rank whose message broke it, by its transport source (never by the VW and stage its
    header claims), or None when no one message did; the launcher names that rank as the culprit."""

    def __init__(self, message: str, sender: Optional[int] = None) -> None:
        super().__init__(message)
        self.sender = sender


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


def stage_ranks(stage_layers: Sequence[Sequence[Any]]) -> Dict[Tuple[int, int], int]:
    """The rank of each ``(vw, stage)`` of a plan whose VWs have ``len(stage_layers[vw])`` stages: stage
    ranks are numbered in plan order (VW by VW, stage by stage), as the run's communicator numbers them."""
    firsts = np.cumsum([0] + [len(v) for v in stage_layers]).tolist()
    return {(v, s): firsts[v] + s for v in range(len(stage_layers)) for s in range(len(stage_layers[v]))}


def check_source(index: int, ranks: Mapping[Tuple[int, int], int], vw: int, stage: int, src: Optional[int],
                 what: str, wave: int) -> None:
    """Refuse a ``what`` ("push", "pull", "DONE") of ``wave`` at shard ``index`` whose header claims
    ``(vw, stage)`` but that came from another rank than that stage's (``src``: its transport source;
    None: not a message). The WSPViolation names the sender by its source, never by the claim."""
    if src is None:
        return
    owner = ranks.get((vw, stage))
    if owner is None:
        raise WSPViolation(f"PS shard {index}: rank {src} sent a {what} of wave {wave} claiming VW {vw} stage "
                           f"{stage}, which the plan does not have (a malformed header)", sender=src)
    if src != owner:
        raise WSPViolation(f"PS shard {index}: rank {src} sent a {what} of wave {wave} claiming VW {vw} stage "
                           f"{stage}, which is rank {owner} (a forged or corrupt header; the sender is named by its "
                           "transport source)", sender=src)


def check_wave_minibatches(index: int, wave_minibatches: Optional[Sequence[int]], num_vws: int) -> None:
    """ValueError naming the shard unless ``wave_minibatches`` is None or one integer >= 1 per VW."""
    if wave_minibatches is None:
        return
    if len(wave_minibatches) != num_vws or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                              for n in wave_minibatches):
        raise ValueError(f"PS shard {index}: wave_minibatches must be one integer >= 1 per VW ({num_vws}), "
                         f"got {list(wave_minibatches)!r}")


def check_aggregate(index: int, aggregate: str) -> None:
    """ValueError naming the shard unless ``aggregate`` is "sum" or "mean"."""
    if aggregate not in ("sum", "mean"):
        raise ValueError(f"PS shard {index}: aggregate must be 'sum' or 'mean', got {aggregate!r}")


class ShardView(Protocol):
    """What a shard server, the checkpointer and a run's outcome read of a shard's state; both
    :class:`ShardState` and the core plane's :class:`~hetpipe.ps.core_plane.CoreShardState` provide it."""

    index: int
    layers: List[int]
    W: Dict[int, np.ndarray]                         # layer -> global weights W_g (flat float32)
    B: Dict[int, np.ndarray]                         # layer -> synced buffers B_g
    M: Dict[int, np.ndarray]                         # layer -> outer momentum (nesterov, delayed-nesterov; else empty)
    A: Dict[int, np.ndarray]                         # layer -> delayed-nesterov's pushes since its momentum step
    outer_options: Dict[str, object]                 # hetpipe.plan.outer.OUTER_FIELDS
    stage_ranks: Dict[Tuple[int, int], int]          # (vw, stage) -> its rank (:func:`stage_ranks`)
    log: ShardLog
    on_applied: Optional[Callable[[int], None]]      # called with ``applied`` at each wave boundary

    @property
    def applied(self) -> int: ...

    @property
    def global_clock(self) -> int: ...

    def outer_counts(self) -> Dict[int, int]:
        """Per layer, the pushes in ``A`` (delayed-nesterov; else 0)."""


class ShardState:
    """One shard's weights, clocks and pending wave deltas (no I/O)."""

    def __init__(self, index: int, weights: Dict[int, np.ndarray], stage_layers: Sequence[Sequence[Tuple[int, int]]],
                 d: int, *, log_sums: bool = False, buffers: Optional[Dict[int, np.ndarray]] = None,
                 replicas: Optional[Dict[Tuple[int, int], Sequence[Tuple[int, int, int]]]] = None,
                 aggregate: str = "sum", outer: str = "sgd", outer_lr: float = 1.0, outer_momentum: float = 0.9,
                 outer_staleness: str = "none", outer_gain: str = "none", outer_delay: int = 0,
                 momentum: Optional[Dict[int, np.ndarray]] = None,
                 delayed: Optional[Tuple[Dict[int, np.ndarray], Dict[int, int]]] = None,
                 wave_minibatches: Optional[Sequence[int]] = None) -> None:
        check_aggregate(index, aggregate)
        self.index = index
        self.d = d
        self.aggregate = aggregate
        self.outer_options = check_outer(f"PS shard {index}", outer, outer_lr, outer_momentum, outer_staleness,
                                         outer_gain, outer_delay)
        self.layers = sorted(weights)
        self.W = {l: np.ascontiguousarray(weights[l], dtype=np.float32).copy() for l in self.layers}
        buffers = buffers or {}
        self.B = {l: np.ascontiguousarray(buffers.get(l, np.zeros(0)), dtype=np.float32).copy() for l in self.layers}
        self.num_vws = len(stage_layers)
        check_wave_minibatches(index, wave_minibatches, len(stage_layers))
        self.outer = OuterStep(index, self.W, self.num_vws, aggregate, self.outer_options, momentum, delayed,
                               wave_minibatches)
        self.M, self.A = self.outer.M, self.outer.A
        self.stage_layers = held_layers(self.W, self.B, stage_layers)
        # The rank of each (vw, stage): stage ranks are numbered in plan order (VW by VW, stage by stage),
        # as the run's communicator numbers them; a message is checked against the rank it came from.
        self.stage_ranks = stage_ranks(stage_layers)
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
        self.stop_after: Optional[int] = None                        # an early stop's last wave (announce_stop)
        self.log = ShardLog()
        # Per-layer buffers of applied waves, reused for the next pushes (fresh pages of this size
        # cost as much to fault in as the copy itself).
        self.spare: Dict[int, List[np.ndarray]] = collections.defaultdict(list)
        self.log_sums = log_sums
        # Decides the version each pull gets and the order each wave is applied in: WSP's own rules
        # (a run, or a plain replay), or a run's record (a replay following it).
        self.gate: Gate = WSPGate()
        if log_sums:
            self.log.pushed_sum = {l: np.zeros(self.W[l].size, dtype=np.float64) for l in self.layers}

    @property
    def global_clock(self) -> int:
        return int(self.clock.global_clock())

    def outer_counts(self) -> Dict[int, int]:
        return dict(self.outer.count)

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
    def check_source(self, vw: int, stage: int, src: Optional[int], what: str, wave: int) -> None:
        check_source(self.index, self.stage_ranks, vw, stage, src, what, wave)

    def push(self, vw: int, stage: int, wave: int, delta: np.ndarray, src: Optional[int] = None) -> None:
        """Take VW ``vw`` stage ``stage``'s delta of ``wave`` (from rank ``src``, for messages)."""
        self.check_source(vw, stage, src, "push", wave)
        key = (vw, stage, wave)
        sender = f" (rank {src})" if src is not None else ""
        clock = int(self.clock.clock(vw))
        if wave > clock + self.d + 1:
            raise WSPViolation(f"PS shard {self.index}: push of wave {wave} from VW {vw} stage {stage}{sender} is "
                               f"beyond VW {vw}'s clock {clock} + D + 1 = {clock + self.d + 1}: no stage can push it "
                               "under the staleness bound (a corrupt header, or a stage that ran ahead of its pulls)",
                               sender=src)
        if key in self.seen:
            raise WSPViolation(f"PS shard {self.index}: duplicate push of wave {wave} from VW {vw} stage "
                               f"{stage}{sender}", sender=src)
        if stage not in self.stage_layers[vw]:
            raise WSPViolation(f"PS shard {self.index}: VW {vw} stage {stage}{sender} holds none of its layers but "
                               "pushed", sender=src)
        if delta.dtype != np.float32 or delta.size != self.stage_numel(vw, stage):
            raise WSPViolation(f"PS shard {self.index}: push from VW {vw} stage {stage}{sender} wave {wave} is "
                               f"{delta.dtype}[{delta.size}], expected float32[{self.stage_numel(vw, stage)}]",
                               sender=src)
        if wave < clock:
            raise WSPViolation(f"PS shard {self.index}: VW {vw} stage {stage}{sender} pushed wave {wave} "
                               f"but VW {vw} is already at clock {clock}", sender=src)
        self.seen.add(key)
        self.log.pushes.append(key)
        off = 0
        parts = self.pending[wave].setdefault(vw, {})
        for l in self.stage_layers[vw][stage]:
            n = self.W[l].size
            parts[l] = self.spare[l].pop() if self.spare[l] else np.empty(n, dtype=np.float32)
            np.copyto(parts[l], delta[off:off + n])
            if self.log_sums:
                self.log.pushed_sum[l] += parts[l] / self.outer.scale[vw]
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
        """Apply every wave the global clock has passed, in the gate's order (WSP's: VW then stage order,
        deterministic) unless the gate holds it (a record holds wave ``c`` back while a pull it gives
        version ``c`` is unanswered)."""
        g = self.global_clock
        while self.applied < g:
            c = self.applied
            if self.gate.holds(c):
                return
            order = self.gate.order(c, self.apply_order())
            wave = self.pending.pop(c)
            for vw, stage in order:
                version = self.outer.version_of(vw, stage, c)
                if version > c:
                    raise WSPViolation(f"PS shard {self.index}: VW {vw} stage {stage} pulled wave {c} at version "
                                       f"{version}, after that wave was applied")
                k = self.outer.divisor(vw, c, version)
                for l in self.stage_layers[vw][stage]:
                    delta = wave[vw][l]
                    self.outer.add(l, delta, k)
                    self.spare[l].append(delta)
                self.log.applied.append((vw, stage, c))
            self.outer.end_wave()
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

    def announce_stop(self, vw: int, stage: int, after: int) -> None:
        """A push of VW ``vw`` stage ``stage`` announced an early stop: no wave after ``after`` is trained
        (VW 0's stages announce it on every push once decided, so the shard knows it before its clock
        can make a pull of wave ``after + 1`` due; docs/design.md, "Evaluation and early stopping")."""
        if self.stop_after is not None and self.stop_after != after:
            raise WSPViolation(f"PS shard {self.index}: VW {vw} stage {stage} announces a stop after wave {after}, "
                               f"another push announced one after wave {self.stop_after}")
        self.stop_after = after

    def stopped_pulls(self) -> List[Tuple[int, int, int, int]]:
        """Remove and return the queued pulls of waves after an announced stop (answered without weights)."""
        if self.stop_after is None:
            return []
        out = [q for q in self.queued if q[3] > self.stop_after]
        self.queued = [q for q in self.queued if q[3] <= self.stop_after]
        return out

    # --- pulls -----------------------------------------------------------------------------------
    def pull(self, src: Optional[int], vw: int, stage: int, wave: int) -> None:
        """Queue the pull of ``wave`` by ``(vw, stage)`` from rank ``src`` (None: not a message, a direct call)."""
        self.check_source(vw, stage, src, "pull", wave)
        if not self.pulls_from(vw, stage):
            raise WSPViolation(f"PS shard {self.index}: VW {vw} stage {stage} (rank {src}) holds none of its layers "
                               "but pulled", sender=src)
        # A stage requests wave w once its pull of w - 1 was answered, which needed the global clock (and
        # so its VW's clock here) at w - 1 - D: a later wave cannot come from a stage that keeps the protocol.
        clock = int(self.clock.clock(vw))
        if wave > clock + self.d + 1:
            raise WSPViolation(f"PS shard {self.index}: pull of wave {wave} from VW {vw} stage {stage} (rank {src}) "
                               f"is beyond VW {vw}'s clock {clock} + D + 1 = {clock + self.d + 1}: no stage can pull "
                               "it under the staleness bound (a corrupt header, or a stage that ran ahead)", sender=src)
        self.queued.append((src, vw, stage, wave))

    def ready_pulls(self, limit: Optional[int] = None) -> List[Tuple[int, int, int, int]]:
        """Remove and return the queued pulls the gate now allows (WSP's gate: the staleness bound; a
        record's: those whose recorded version ``W`` now is), in arrival order (at most ``limit`` of them; the others stay
        queued). Each is answered with ``W_applied``; call :meth:`answered` once their replies are taken."""
        g = self.global_clock
        ready = [q for q in self.queued if self.gate.due(q[1], q[2], q[3], self.applied, g, self.d)][:limit]
        self.queued = [q for q in self.queued if q not in ready]
        for (_, vw, stage, wave) in ready:
            self.log.pulls.append((vw, stage, wave, self.applied))
            self.log.pull_clocks.append(int(self.clock.clock(vw)))
            if stage in self.stage_layers[vw]:
                self.outer.pulled_at(vw, stage, wave, self.applied)
        return ready

    def answered(self, pulls: Sequence[Tuple[int, int, int, int]]) -> None:
        """The replies of ``pulls`` (from :meth:`ready_pulls`) were taken: the gate may release waves."""
        if pulls:
            for (_, vw, stage, wave) in pulls:
                self.gate.served(vw, stage, wave)
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


