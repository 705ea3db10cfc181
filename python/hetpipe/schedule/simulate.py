"""Discrete-event simulation of several virtual workers' schedules under WSP.

Time model, per VW (each stage runs its stream in order, one instruction at a time):

- ``Fwd``/``Bwd``/``Recompute`` take the stage's time for that kind (half of it for a half
  micro-batch of a split schedule), ``Apply`` the stage's apply time.
- ``SendAct(mb, s+1)`` does not block the stage: the message occupies the link direction
  ``s -> s+1`` for the boundary's transfer time, starting when both the message and the link are
  free (one transfer at a time per direction), and arrives ``latency_s`` after the end of that.
  ``SendGrad`` likewise on ``s -> s-1``. ``RecvAct``/``RecvGrad`` wait for the arrival.
- ``Push(c)`` does not block the stage: the transfer to the PS takes the stage's fixed push time
  (if any) on the stage's own PS link (one push at a time), then the stage's traffic with each
  parameter-server shard it talks to (``VWCosts.ps``) queues at that shard: the shard receives, then
  applies it, one push at a time each (:mod:`hetpipe.schedule.ps`). The global clock reaches
  ``c + 1`` when every VW that has a wave ``c`` has finished pushing it from all its stages.
- ``Pull(w)`` waits until the global clock is ``>= w - d`` and every shard the stage talks to has
  applied wave ``w - d - 1`` from every VW (the WSP wait), then takes the stage's fixed pull time
  plus its pull from each shard, queued at the shard's link back.

The run's messages besides activations and gradients (tied gradients, norm shares, evaluation
points, DONE: :mod:`hetpipe.schedule.messages`) are not modelled: a schedule carrying them plays as
without them.

Everything is deterministic. The engine plays instructions in the lock-step order of
:mod:`hetpipe.schedule.lockstep` (a topological order of each schedule's dependencies), vectorised over
the VWs that share a schedule, and merges VWs with different schedules at Pull boundaries.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from hetpipe.schedule.ir import (
    MESSAGES, Apply, Bwd, Fwd, Pull, Push, Recompute, RecvAct, RecvGrad, Schedule, SendAct, SendGrad,
)
from hetpipe.schedule.ps import DEFAULT_APPLY_RATE, Shards, ShardStats, ShardTraffic, StageTraffic, plan_traffic
from hetpipe.schedule.lockstep import lockstep
from hetpipe.schedule.registry import ScheduleOptions, generate, get_schedule
from hetpipe.schedule.trace import PS_VW, TraceEvent
from hetpipe.schedule.validate import ScheduleError, validate

PerStage = Union[float, Sequence[float]]


@dataclass(frozen=True)
class VWCosts:
    """The costs of one VW of ``k`` stages, in seconds.

    ``fwd``/``bwd``/``recompute``/``apply``/``push``/``pull`` have one entry per stage (per minibatch
    or per wave). ``act_s[b]``/``grad_s[b]`` are how long one activation / gradient occupies the link
    across boundary ``b`` (between stages ``b`` and ``b + 1``) and ``latency_s[b]`` the link's latency.
    ``ps[s]`` is stage ``s``'s traffic with the PS shards per wave (empty: the PS serves at once).
    Build one with :func:`vw_costs`.
    """

    fwd: Tuple[float, ...]
    bwd: Tuple[float, ...]
    recompute: Tuple[float, ...]
    apply: Tuple[float, ...]
    act_s: Tuple[float, ...]
    grad_s: Tuple[float, ...]
    latency_s: Tuple[float, ...]
    push: Tuple[float, ...]
    pull: Tuple[float, ...]
    ps: Tuple[StageTraffic, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.fwd)


def _per(name: str, value: PerStage, n: int, *, allow_inf: bool = False) -> Tuple[float, ...]:
    """``value`` per stage or boundary: a scalar for all ``n``, or ``n`` numbers; each >= 0 and not
    NaN (nor infinite unless ``allow_inf``)."""
    if isinstance(value, (int, float)):
        out = (float(value),) * n
        shown = repr(value)
    else:
        out = tuple(float(v) for v in value)
        shown = repr(out)
        if len(out) != n:
            raise ValueError(f"vw_costs: {name} has {len(out)} entries, expected {n}")
    if any(not (v >= 0) or (v == math.inf and not allow_inf) for v in out):
        raise ValueError(f"vw_costs: {name} must be {'' if allow_inf else 'finite, '}>= 0 and not NaN, got {shown}")
    return out


def vw_costs(fwd: Sequence[float], bwd: Sequence[float], *, recompute: PerStage = 0.0, apply: PerStage = 0.0,
             act_bytes: PerStage = 0.0, bandwidth: PerStage = math.inf, latency_s: PerStage = 0.0,
             transfer_s: Optional[PerStage] = None, push: PerStage = 0.0, pull: PerStage = 0.0,
             ps: Optional[Sequence[Sequence[ShardTraffic]]] = None) -> VWCosts:
    """Costs of one VW: per-stage forward/backward seconds, and per boundary either ``transfer_s``
    (seconds per message) or ``act_bytes / bandwidth`` (bytes, bytes per second); gradients have the
    size of the activation they belong to. Scalars apply to every stage or boundary. ``push``/``pull``
    are fixed seconds per stage and wave on the stage's PS link; ``ps[s]`` lists stage ``s``'s
    :class:`ShardTraffic` (the shards as resources, see :mod:`hetpipe.schedule.ps`)."""
    k = len(fwd)
    nb = max(k - 1, 0)
    if ps is None:
        traffic: Tuple[StageTraffic, ...] = ((),) * k
    else:
        traffic = tuple(tuple(st) for st in ps)
        if len(traffic) != k:
            raise ValueError(f"vw_costs: ps has {len(traffic)} stages' traffic, expected {k}")
    if transfer_s is None:
        sizes, bws = _per("act_bytes", act_bytes, nb), _per("bandwidth", bandwidth, nb, allow_inf=True)
        tx = tuple(0.0 if b == 0 else b / w for b, w in zip(sizes, bws))
    else:
        tx = _per("transfer_s", transfer_s, nb)
    return VWCosts(_per("fwd", fwd, k), _per("bwd", bwd, k), _per("recompute", recompute, k),
                   _per("apply", apply, k), tx, tx, _per("latency_s", latency_s, nb),
                   _per("push", push, k), _per("pull", pull, k), traffic)


@dataclass(frozen=True)
class StageStats:
    """One stage of one VW over the VW's span ``[0, finish]``: ``busy`` computing, ``idle`` not
    computing (``finish - busy``), of which ``comm_wait`` blocked on receives, ``wsp_wait`` blocked
    on the staleness bound and ``pull`` fetching weights."""

    busy_s: float
    idle_s: float
    comm_wait_s: float
    wsp_wait_s: float
    pull_s: float

    @property
    def utilisation(self) -> float:
        span = self.busy_s + self.idle_s
        return self.busy_s / span if span > 0 else 0.0


_F, _B, _R, _A, _SA, _RA, _SG, _RG, _PUSH, _PULL = range(10)
_OPS = {Fwd: _F, Bwd: _B, Recompute: _R, Apply: _A, SendAct: _SA, RecvAct: _RA, SendGrad: _SG,
        RecvGrad: _RG, Push: _PUSH, Pull: _PULL}
_KIND = {_F: "F", _B: "B", _R: "R", _A: "A"}


@dataclass
class _Group:
    """VWs sharing one schedule, simulated together as vectors."""

    schedule: Schedule
    vws: List[int]
    ops: List[Tuple[int, int, int, int]]          # (op, stage, mb or wave, boundary)
    pos: int = 0
    records: List[Tuple[str, int, int, int, np.ndarray, np.ndarray]] = field(default_factory=list)


Key = Tuple[int, int, int]                  # (vw, stage, wave)


@dataclass
class PSLog:
    """When each stage's traffic with the PS happened in a simulation, by ``(vw, stage, wave)``.

    ``push_s``: when the stage issued ``Push(wave)``; ``sent_s``: when its fixed push time on its PS
    link ended (without modelled shards, when the push reached them); ``shards``: each modelled shard's
    ``(shard, received, applied)`` of that push; ``pull_s``: ``(start, end)`` of ``Pull(wave)``, start
    being when the stage reached the instruction (before any WSP wait)."""

    push_s: Dict[Key, float] = field(default_factory=dict)
    sent_s: Dict[Key, float] = field(default_factory=dict)
    shards: Dict[Key, Tuple[Tuple[int, float, float], ...]] = field(default_factory=dict)
    pull_s: Dict[Key, Tuple[float, float]] = field(default_factory=dict)


@dataclass
class SimResult:
    """What :func:`simulate` returns. Per-VW lists are indexed by VW; ``stages[v][s]`` is a
    :class:`StageStats`. ``wave_done_s[v][c]`` is when VW ``v``'s last stage-push of wave ``c`` was
    issued (the VW's wave ``c`` computation ended)."""

    makespan_s: float
    finish_s: List[float]
    minibatches: List[int]
    stages: List[List[StageStats]]
    wave_done_s: List[List[float]]
    shards: List[ShardStats] = field(default_factory=list)
    ps_log: PSLog = field(default_factory=PSLog, repr=False)
    _shard_events: List[Tuple[str, int, int, float, float]] = field(repr=False, default_factory=list)
    _groups: List[_Group] = field(repr=False, default_factory=list)
    _timeline: Optional[List[TraceEvent]] = field(repr=False, default=None)

    @property
    def throughput(self) -> float:
        """Minibatches per second of the whole cluster over the makespan."""
        return sum(self.minibatches) / self.makespan_s if self.makespan_s > 0 else 0.0

    def vw_throughput(self, vw: int) -> float:
        """Minibatches per second of VW ``vw`` over its own span."""
        return self.minibatches[vw] / self.finish_s[vw] if self.finish_s[vw] > 0 else 0.0

    def steady_throughput(self, vw: int, skip_waves: int = 1) -> float:
        """VW ``vw``'s minibatches per second between the end of wave ``skip_waves - 1`` and its last
        wave (start-up excluded); needs more than ``skip_waves`` waves."""
        done = self.wave_done_s[vw]
        if len(done) <= skip_waves or skip_waves < 1:
            raise ValueError(f"steady_throughput: VW {vw} has {len(done)} waves, need more than {skip_waves}")
        nm = self._nm(vw)
        mbs = self.minibatches[vw] - nm * skip_waves
        return mbs / (done[-1] - done[skip_waves - 1])

    def _nm(self, vw: int) -> int:
        return next(g.schedule.nm for g in self._groups if vw in g.vws)

    @property
    def bubble_fraction(self) -> float:
        """``1 - busy / (stages x span)`` summed over all VWs' stages (each VW over its own span)."""
        busy = sum(st.busy_s for vw in self.stages for st in vw)
        total = sum(len(vw) * f for vw, f in zip(self.stages, self.finish_s))
        return 1.0 - busy / total if total > 0 else 0.0

    def vw_bubble_fraction(self, vw: int) -> float:
        busy = sum(st.busy_s for st in self.stages[vw])
        total = len(self.stages[vw]) * self.finish_s[vw]
        return 1.0 - busy / total if total > 0 else 0.0

    @property
    def wsp_wait_s(self) -> float:
        """Total time stages spent blocked on the staleness bound."""
        return sum(st.wsp_wait_s for vw in self.stages for st in vw)

    @property
    def timeline(self) -> List[TraceEvent]:
        """Every compute instruction, Pull and WSP wait (``kind="WAIT"``) as a :class:`TraceEvent`,
        ordered by VW, then stage, then start time, then the PS shards' ``PUSH`` (receive), ``APPLY``
        and ``PULL`` (send) intervals by shard and time; built on first use."""
        if self._timeline is None:
            events: List[TraceEvent] = []
            for g in self._groups:
                if not g.records:
                    continue
                kinds, stages, mbs, waves, starts, durs = zip(*g.records)
                waves = [w if m < 0 else g.schedule.wave_of(m) for m, w in zip(mbs, waves)]
                start_mat, dur_mat = np.stack(starts), np.stack(durs)
                by_stage: List[List[int]] = [[] for _ in range(g.schedule.num_stages)]
                for r, s in enumerate(stages):
                    by_stage[s].append(r)
                for i, vw in enumerate(g.vws):
                    st_i, du_i = start_mat[:, i].tolist(), dur_mat[:, i].tolist()
                    for s, rows in enumerate(by_stage):
                        events.extend(TraceEvent(vw, s, kinds[r], st_i[r], du_i[r], mbs[r], waves[r]) for r in rows
                                      if du_i[r] > 0 or kinds[r] not in ("WAIT", "PULL"))
            events.sort(key=lambda e: e.vw)
            events.extend(TraceEvent(PS_VW, shard, kind, start, dur, wave=wave)
                          for kind, shard, wave, start, dur in sorted(self._shard_events, key=lambda e: (e[1], e[3]))
                          if dur > 0)
            self._timeline = events
        return self._timeline

    def table(self) -> str:
        """Per-stage utilisation table plus the predicted throughput."""
        lines = [f"{'vw':>3} {'stage':>5} {'busy s':>10} {'idle s':>10} {'comm wait':>10} {'wsp wait':>10} {'util':>6}"]
        for v, stages in enumerate(self.stages):
            for s, st in enumerate(stages):
                lines.append(f"{v:>3} {s:>5} {st.busy_s:>10.4f} {st.idle_s:>10.4f} {st.comm_wait_s:>10.4f} "
                             f"{st.wsp_wait_s:>10.4f} {st.utilisation:>6.1%}")
        if any(sh.recv_s or sh.apply_s or sh.send_s for sh in self.shards):
            lines.append(f"{'shard':>5} {'recv s':>10} {'apply s':>10} {'send s':>10} {'busiest':>8}")
            for i, sh in enumerate(self.shards):
                top = max(sh.recv_s, sh.apply_s, sh.send_s) / self.makespan_s if self.makespan_s > 0 else 0.0
                lines.append(f"{i:>5} {sh.recv_s:>10.4f} {sh.apply_s:>10.4f} {sh.send_s:>10.4f} {top:>8.1%}")
        lines.append(f"makespan {self.makespan_s:.4f} s, throughput {self.throughput:.3f} minibatches/s, "
                     f"bubble {self.bubble_fraction:.1%}, WSP wait {self.wsp_wait_s:.4f} s")
        return "\n".join(lines)


# Compiled ops of the schedules simulated last, by id (the entry keeps its schedule alive, so the id
# stays its own; schedules are immutable): sweeps that simulate one schedule under many costs replay
# and validate it once.
_COMPILED: Dict[int, Tuple[Schedule, bool, List[Tuple[int, int, int, int]]]] = {}
_CACHE_SIZE = 4


def _compiled(schedule: Schedule, check: bool) -> List[Tuple[int, int, int, int]]:
    hit = _COMPILED.get(id(schedule))
    if hit is not None and hit[0] is schedule and (hit[1] or not check):
        return hit[2]
    if check:
        validate(schedule)
    ops = _compile(schedule)
    if len(_COMPILED) >= _CACHE_SIZE:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[id(schedule)] = (schedule, check, ops)
    return ops


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _plan_schedule(name: str, options: ScheduleOptions) -> Schedule:
    return generate(name, options)


def _compile(schedule: Schedule) -> List[Tuple[int, int, int, int]]:
    rep = lockstep(schedule)
    if rep.stuck:
        raise ScheduleError(f"simulate: schedule {schedule.name!r} deadlocks; run validate() for the grid")
    ops = []
    for s, ins in rep.order():
        if isinstance(ins, MESSAGES):
            continue
        op = _OPS[type(ins)]
        num = ins.wave if op in (_PUSH, _PULL) else ins.mb
        boundary = s if op == _SA else s - 1 if op == _SG else -1
        ops.append((op, s, num, boundary))
    return ops


def simulate(schedules: Sequence[Schedule], costs: Sequence[VWCosts], *, check: bool = True) -> SimResult:
    """Play one schedule per VW with that VW's costs under WSP (model in the module docstring).

    All schedules must share ``d`` (the cluster's staleness bound). ``check`` validates each distinct
    schedule first. The PS shards are those named by the costs' ``ps`` traffic. Returns a
    :class:`SimResult`.
    """
    if len(schedules) != len(costs) or not schedules:
        raise ValueError(f"simulate: {len(schedules)} schedules and {len(costs)} cost sets; need one per VW")
    d = schedules[0].d
    groups: List[_Group] = []
    for v, (sch, c) in enumerate(zip(schedules, costs)):
        if sch.d != d:
            raise ValueError(f"simulate: VW {v} has d = {sch.d}, VW 0 has d = {d}; WSP needs one bound")
        if c.num_stages != sch.num_stages:
            raise ValueError(f"simulate: VW {v} has {sch.num_stages} stages but costs for {c.num_stages}")
        g = next((g for g in groups if g.schedule is sch or g.schedule == sch), None)
        if g is None:
            groups.append(_Group(sch, [v], _compiled(sch, check)))
        else:
            g.vws.append(v)

    num_waves = max(g.schedule.num_waves for g in groups)
    need = [sum(g.schedule.num_stages for g in groups if g.schedule.num_waves > c) for c in range(num_waves)]
    pushed = [0] * num_waves
    gate = [0.0] * num_waves
    shards = Shards(1 + max((tr.shard for c in costs for st in c.ps for tr in st), default=-1))
    states = [_State(g, [costs[v] for v in g.vws], num_waves) for g in groups]

    progress = True
    while progress:
        progress = False
        for g, state in zip(groups, states):
            before = g.pos
            state.run(d, pushed, need, gate, shards)
            progress |= g.pos > before
    stuck = [g for g in groups if g.pos < len(g.ops)]
    if stuck:
        raise ScheduleError(f"simulate: VWs {[g.vws for g in stuck]} cannot proceed under d = {d}")

    nv = len(schedules)
    finish = [0.0] * nv
    stages: List[List[StageStats]] = [[] for _ in range(nv)]
    wave_done: List[List[float]] = [[] for _ in range(nv)]
    log = PSLog()
    for g, state in zip(groups, states):
        for (s, c), (issued, sent, booked) in state.push_log.items():
            for i, v in enumerate(g.vws):
                log.push_s[(v, s, c)], log.sent_s[(v, s, c)] = float(issued[i]), float(sent[i])
                log.shards[(v, s, c)] = tuple(booked[i])
        for (s, w), (start, end) in state.pull_log.items():
            for i, v in enumerate(g.vws):
                log.pull_s[(v, s, w)] = (float(start[i]), float(end[i]))
        end = np.max(np.stack(state.t), axis=0)
        for i, v in enumerate(g.vws):
            finish[v] = float(end[i])
            stages[v] = [StageStats(float(state.busy[s][i]), float(end[i] - state.busy[s][i]),
                                    float(state.comm[s][i]), float(state.wsp[s][i]), float(state.pulls[s][i]))
                         for s in range(g.schedule.num_stages)]
            wave_done[v] = [float(state.wave_done[c][i]) for c in range(g.schedule.num_waves)]
    return SimResult(max(finish), finish, [schedules[v].num_minibatches for v in range(nv)], stages, wave_done,
                     shards.stats(), log, shards.events, groups)


class _State:
    """Clocks and queues of one group of VWs; ``run`` plays its ops until a closed Pull gate."""

    def __init__(self, g: _Group, costs: List[VWCosts], num_waves: int) -> None:
        self.g = g
        k = g.schedule.num_stages
        n = len(costs)

        def col(attr: str, i: int) -> np.ndarray:
            return np.array([getattr(c, attr)[i] for c in costs], dtype=float)

        self.cost = {(_F, s): col("fwd", s) for s in range(k)}
        self.cost.update({(_B, s): col("bwd", s) for s in range(k)})
        self.cost.update({(_R, s): col("recompute", s) for s in range(k)})
        self.cost.update({(_A, s): col("apply", s) for s in range(k)})
        self.push = [col("push", s) for s in range(k)]
        self.pull = [col("pull", s) for s in range(k)]
        self.traffic = [[c.ps[s] if c.ps else () for c in costs] for s in range(k)]
        self.has_ps = [any(self.traffic[s]) for s in range(k)]
        self.tx = {(_SA, b): col("act_s", b) for b in range(k - 1)}
        self.tx.update({(_SG, b): col("grad_s", b) for b in range(k - 1)})
        self.lat = [col("latency_s", b) for b in range(k - 1)]
        zero = np.zeros(n)
        self.t = [zero] * k
        self.link = {key: zero for key in self.tx}
        self.ps_link = [zero] * k
        self.busy = np.zeros((k, n))
        self.comm = np.zeros((k, n))
        self.wsp = np.zeros((k, n))
        self.pulls = np.zeros((k, n))
        self.wave_done = [zero] * num_waves
        self.msgs: Dict[Tuple[int, int, int], np.ndarray] = {}
        # (stage, wave) -> (issued, sent, per VW the shards' (shard, received, applied)) of each Push,
        # and (start, end) of each Pull, as vectors over the group's VWs (PSLog).
        self.push_log: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray, List[List[Tuple[int, float, float]]]]] = {}
        self.pull_log: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]] = {}

    def run(self, d: int, pushed: List[int], need: List[int], gate: List[float], shards: Shards) -> None:
        g, t, rec = self.g, self.t, self.g.records
        sch = g.schedule
        ops = g.ops
        half = 2 * sch.split
        while g.pos < len(ops):
            op, s, num, b = ops[g.pos]
            if op <= _A:
                dur = self.cost[(op, s)]
                if op != _A and num < half:
                    dur = dur * 0.5
                start = t[s]
                t[s] = start + dur
                self.busy[s] += dur
                rec.append((_KIND[op], s, num, -1, start, dur))
            elif op == _SA or op == _SG:
                key = (op, b)
                st = np.maximum(t[s], self.link[key])
                done = st + self.tx[key]
                self.link[key] = done
                self.msgs[(op, b, num)] = done + self.lat[b]
            elif op == _RA or op == _RG:
                arrive = self.msgs.pop((_SA if op == _RA else _SG, s - 1 if op == _RA else s, num))
                new = np.maximum(t[s], arrive)
                self.comm[s] += new - t[s]
                t[s] = new
            elif op == _PUSH:
                st = np.maximum(t[s], self.ps_link[s])
                done = st + self.push[s]
                booked: List[List[Tuple[int, float, float]]] = [[] for _ in g.vws]
                self.push_log[(s, num)] = (t[s], done.copy(), booked)
                if self.has_ps[s]:
                    for i in np.argsort(done, kind="stable").tolist():      # FIFO at the shards
                        done[i] = shards.push(float(done[i]), num, self.traffic[s][i], booked[i])
                self.ps_link[s] = done
                self.wave_done[num] = np.maximum(self.wave_done[num], t[s])
                pushed[num] += 1
                gate[num] = max(gate[num], float(done.max()))
            else:
                c = num - d - 1
                if c >= 0 and pushed[c] < need[c]:
                    return
                reached = t[s]
                if c >= 0:
                    new = np.maximum(t[s], gate[c])
                    if self.has_ps[s]:
                        new = np.maximum(new, [shards.applied(c, tr) for tr in self.traffic[s]])
                    wait = new - t[s]
                    rec.append(("WAIT", s, -1, num, t[s], wait))
                    self.wsp[s] += wait
                    t[s] = new
                start = t[s]
                end = start + self.pull[s]
                if self.has_ps[s]:
                    for i in np.argsort(end, kind="stable").tolist():       # FIFO at the shards
                        end[i] = shards.pull(float(end[i]), num, self.traffic[s][i])
                self.pull_log[(s, num)] = (reached, end)
                t[s] = end
                self.pulls[s] += end - start
                rec.append(("PULL", s, -1, num, start, end - start))
            g.pos += 1


# The most minibatch-stages (waves x Nm x stages, summed over the distinct VW shapes) simulate_plan
# plays: about a minute on one core. Beyond it a run would look hung; ask for fewer waves.
MAX_MINIBATCH_STAGES = 400_000


def check_waves(plan, waves: int, name: str = "waves") -> None:
    """Raise ValueError (naming ``name``) unless simulating ``waves`` waves of ``plan`` stays within
    :data:`MAX_MINIBATCH_STAGES`."""
    if isinstance(waves, bool) or not isinstance(waves, int) or waves < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {waves!r}")
    shapes = {(len(vw.stages), plan.nm_of(v)) for v, vw in enumerate(plan.virtual_workers)}
    per_wave = sum(k * nm for k, nm in shapes)
    work = waves * per_wave
    if work > MAX_MINIBATCH_STAGES:
        most = max(1, MAX_MINIBATCH_STAGES // per_wave)
        told = " + ".join(f"Nm {nm} x {k}" for k, nm in sorted(shapes))
        raise ValueError(f"{name} {waves} x ({told} stages) is {work} minibatch-stages, more "
                         f"than the {MAX_MINIBATCH_STAGES} this simulator plays in about a minute; "
                         f"use at most {most} waves")


def simulate_plan(plan, waves: int = 10, *, apply: PerStage = 0.0, latency_s: PerStage = 0.0,
                  push: PerStage = 0.0, pull: PerStage = 0.0, transfer_s: Optional[PerStage] = None,
                  split_startup: int = 0, cluster=None, param_bytes: Optional[Sequence[float]] = None,
                  apply_rate: float = DEFAULT_APPLY_RATE, schedule: str = "hetpipe") -> SimResult:
    """Simulate ``waves`` waves of every VW of a :class:`hetpipe.plan.types.Plan` under its Nm and D.

    Every VW runs the registered schedule ``schedule`` (:mod:`hetpipe.schedule.registry`) for
    ``waves x`` its Nm minibatches; one that does not take the plan's Nm or D refuses them by name.

    Forward/backward times come from each stage's ``fwd_time``/``bwd_time`` (recomputation is part
    of ``bwd_time``, so the schedule has no separate Recompute), transfers from
    ``send_time`` (the same for the gradient back); the keyword arguments override or add costs
    that a plan does not carry (apply, link latency, fixed PS push/pull seconds per stage and wave).
    With ``cluster`` (a ClusterSpec) and ``param_bytes`` (per layer) the plan's PS shards are
    modelled as resources (:mod:`hetpipe.schedule.ps`) applying ``apply_rate`` bytes per second;
    without them the shards serve at once, and so does a schedule that never talks to them.
    """
    check_waves(plan, waves, "simulate_plan: waves")
    if (cluster is None) != (param_bytes is None):
        raise ValueError("simulate_plan: the PS model needs both cluster and param_bytes")
    check_waves(plan, waves)
    spec = get_schedule(schedule)
    traffic = None if cluster is None or not spec.syncs else plan_traffic(plan, cluster, param_bytes, apply_rate)
    schedules, costs = [], []
    cache: Dict[Tuple[int, int], Schedule] = {}
    for v, vw in enumerate(plan.virtual_workers):
        shape = (len(vw.stages), plan.nm_of(v))
        if shape not in cache:
            k, nm = shape
            cache[shape] = _plan_schedule(spec.name, ScheduleOptions(k, waves * nm, nm, plan.d,
                                                                     split_startup=split_startup))
        schedules.append(cache[shape])
        tx = [st.send_time for st in vw.stages[:-1]] if transfer_s is None else transfer_s
        costs.append(vw_costs([st.fwd_time for st in vw.stages], [st.bwd_time for st in vw.stages],
                              apply=apply, latency_s=latency_s, transfer_s=tx, push=push, pull=pull,
                              ps=None if traffic is None else traffic[v]))
    return simulate(schedules, costs)
