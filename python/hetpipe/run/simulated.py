"""A run's record synthesised by the simulator: the versions, apply order and times a run on a cluster would have.

:func:`simulated_record` plays the run's own schedules (``spec.schedules``) on the cluster model of
:mod:`hetpipe.schedule.simulate` and writes what the PS shards of that simulated run answer, as a
:class:`~hetpipe.run.record.RunRecord`. Replaying it (:func:`hetpipe.run.replay.replay_run`) gives the
run's exact numerics with the staleness of the cluster, the simulated times its time axis.

What a shard answers, as the real shards do (:mod:`hetpipe.ps.shard`, and the core plane alike): the
request of ``Pull(w)`` reaches shard ``k`` at ``r`` (right after the stage's own ``Push(w - D - 1)``
and the merge of its previous Pull when pulls are requested early, the runtime's default; else when the
stage reaches the Pull); it is answered at ``a = max(r, A_k(w - D - 1))``, ``A_k(c)`` being when shard
``k`` has applied every wave ``<= c`` (each of them once every VW's stages holding its layers pushed it,
received and applied in the simulator's shard model), with the version it then holds: the number of
waves applied by ``a``. So ``w - D <= g``; ``g <= w`` holds by causality (wave ``w`` needs pushes made
after ``Pull(w)``) and is checked. A shard applies each wave in its own order (VW, then stage), which
timing never changes. The clocks are the shard's VW clocks as the pushes arrive.

Times come from the simulator alone (its Pull does not model early requests: it starts its transfer at
the instruction, so a simulated stage may wait for a pull a real one had received already). The record
has no outcome digests: they come from the replay that follows it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from hetpipe.ps.client import pull_ahead as pull_ahead_default
from hetpipe.ps.shard import held_layers
from hetpipe.run.record import RunRecord, ShardRecord, run_identity
from hetpipe.run.spec import RunSpec
from hetpipe.schedule.ir import Pull
from hetpipe.schedule.ps import DEFAULT_APPLY_RATE, plan_traffic
from hetpipe.schedule.simulate import SimResult, VWCosts, simulate, vw_costs
from hetpipe.util.errors import HetpipeError


class SimulatedRecordError(HetpipeError, RuntimeError):
    """The simulated run breaks WSP (a version outside ``w - D <= g <= w``): a bug, named by its pull."""


@dataclass
class SimulatedRun:
    """What :func:`simulated_record` returns.

    ``record``: the run's record. ``sim``: the simulation it came from. ``wave_done_s[v][c]``: when VW
    ``v``'s computation of wave ``c`` ended (its last stage-push issued); ``minibatch_done_s[v][p]``:
    when minibatch ``p`` of VW ``v`` was applied on every stage; ``version_s[g]``: when every shard held
    version ``g`` of the global weights (``version_s[0] = 0``), the time of the model ``W_g``."""

    record: RunRecord
    sim: SimResult
    wave_done_s: List[List[float]]
    minibatch_done_s: List[List[float]]
    version_s: List[float]

    def staleness(self) -> Dict[int, int]:
        """``w - g`` over every pull the record holds: a histogram."""
        return self.record.staleness()


def plan_costs(spec: RunSpec, *, cluster=None, param_bytes: Optional[Sequence[float]] = None,
               apply_rate: float = DEFAULT_APPLY_RATE, latency_s: float = 0.0, push: float = 0.0,
               pull: float = 0.0) -> List[VWCosts]:
    """Each VW's costs from its plan (stage times, boundary transfer times) and, with ``cluster``, the PS
    shards as resources (``param_bytes[l]``: layer ``l``'s pushed bytes; default: its float32 weights and
    synced buffers), as :func:`hetpipe.schedule.simulate_plan` builds them."""
    plan = spec.plan
    traffic = None
    if cluster is not None:
        if param_bytes is None:
            param_bytes = [4.0 * (spec.layout.flat(l).size + spec.layout.flat_buffers(l).size)
                           for l in range(plan.num_layers)]
        traffic = plan_traffic(plan, cluster, param_bytes, apply_rate)
    out = []
    for v, vw in enumerate(plan.virtual_workers):
        out.append(vw_costs([st.fwd_time for st in vw.stages], [st.bwd_time for st in vw.stages],
                            transfer_s=[st.send_time for st in vw.stages[:-1]], latency_s=latency_s, push=push,
                            pull=pull, ps=None if traffic is None else traffic[v]))
    return out


def simulated_record(spec: RunSpec, costs: Optional[Sequence[VWCosts]] = None, *, cluster=None,
                     param_bytes: Optional[Sequence[float]] = None, apply_rate: float = DEFAULT_APPLY_RATE,
                     latency_s: float = 0.0, push: float = 0.0, pull: float = 0.0,
                     pull_ahead: Optional[bool] = None) -> SimulatedRun:
    """Simulate ``spec``'s schedules on ``costs`` (default: :func:`plan_costs` of the other arguments) and
    return the record of that run with its times (see the module docstring). ``pull_ahead``: whether
    stages request pulls early (default: the runtime's, ``HETPIPE_PULL_AHEAD``)."""
    plan = spec.plan
    if costs is None:
        costs = plan_costs(spec, cluster=cluster, param_bytes=param_bytes, apply_rate=apply_rate,
                           latency_s=latency_s, push=push, pull=pull)
    ahead = pull_ahead_default() if pull_ahead is None else pull_ahead
    sim = simulate(spec.schedules, costs)
    log = sim.ps_log
    d = plan.d
    bounds = [[(st.start, st.stop) for st in vw.stages] for vw in plan.virtual_workers]
    waves = [s.num_waves for s in spec.schedules]
    shards: Dict[int, ShardRecord] = {}
    applied_at: Dict[int, List[float]] = {}
    for sh in plan.ps_shards:
        k = sh.index
        weights = {l: spec.layout.flat(l) for l in sh.layers}
        buffers = {l: spec.layout.flat_buffers(l) for l in sh.layers}
        held = held_layers(weights, buffers, bounds)
        replicas = {(v, s) for v, vw in enumerate(plan.virtual_workers) for s, st in enumerate(vw.stages)
                    if any(r.owner in weights for r in spec.layout.stage_replicas(st.start, st.stop))}
        order = [(v, s) for v in range(len(held)) for s in sorted(held[v])]
        pushers = [v for v in range(len(held)) if held[v]]

        def at_shard(v: int, s: int, c: int, which: int) -> float:
            """When shard ``k`` received (``which`` 1) or applied (2) VW ``v`` stage ``s``'s push of wave ``c``."""
            for booked in log.shards.get((v, s, c), ()):
                if booked[0] == k:
                    return booked[which]
            return log.sent_s[(v, s, c)]          # the shard is not modelled: it serves at once

        # Wave c is applied once every VW pushed it (from every stage holding the shard's layers).
        full = min((waves[v] for v in pushers), default=0)
        through: List[float] = []
        for c in range(full):
            t = max(at_shard(v, s, c, 2) for v, s in order)
            through.append(max(t, through[-1]) if through else t)
        applied_at[k] = through
        # The VW clocks at the shard, as the pushes arrive.
        arrivals = sorted((max(at_shard(v, s, c, 1) for s in held[v]), v, c) for v in pushers for c in range(waves[v]))
        received: Dict[int, List[float]] = {v: [] for v in pushers}
        clock = {v: 0 for v in pushers}
        clocks = []
        for t, v, c in arrivals:
            received[v].append(t)
            clock[v] = c + 1
            clocks.append((v, clock[v], min(clock.values())))
        pulls = []
        for v, vw in enumerate(plan.virtual_workers):
            for s in range(len(vw.stages)):
                if s not in held[v] and (v, s) not in replicas:
                    continue
                previous = 0.0
                for w in (ins.wave for ins in spec.schedules[v].streams[s] if isinstance(ins, Pull)):
                    reached, end = log.pull_s[(v, s, w)]
                    if ahead:
                        r = max(previous, log.push_s.get((v, s, w - d - 1), 0.0))
                    else:
                        r = reached
                    previous = end
                    gate = w - d - 1
                    a = max(r, through[gate] if 0 <= gate < len(through) else 0.0 if gate < 0 else math.inf)
                    g = min(bisect.bisect_right(through, a), w)
                    if not w - d <= g <= w:
                        raise SimulatedRecordError(f"simulated record: PS shard {k} would answer the pull of wave "
                                                   f"{w} by VW {v} stage {s} at version {g}, outside "
                                                   f"{w - d}..{w} (D = {d})")
                    cv = bisect.bisect_right(received.get(v, []), a)
                    pulls.append((a, v, s, w, g, cv))
        pulls.sort()
        shards[k] = ShardRecord(k, [list(order) for _ in range(full)], [p[1:] for p in pulls], clocks)
    num_versions = min((len(t) for t in applied_at.values()), default=0)
    version_s = [0.0] + [max(applied_at[k][c] for k in applied_at) for c in range(num_versions)]
    done: List[List[float]] = []
    events = [e for e in sim.timeline if e.kind == "A"]
    for v, sch in enumerate(spec.schedules):
        per = [0.0] * sch.num_minibatches
        for e in events:
            if e.vw == v:
                p = sch.minibatch_of(e.mb)
                per[p] = max(per[p], e.start_s + e.dur_s)
        done.append(per)
    record = RunRecord(run_identity(spec), shards)
    return SimulatedRun(record, sim, sim.wave_done_s, done, version_s)
