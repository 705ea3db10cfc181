"""The cost model: a plan's steady-state throughput under HetPipe's pipelining and WSP.

Per VW ``v`` with stage times ``t_k`` (compute + transfer, :mod:`hetpipe.plan.stage_cost`), bottleneck
``b = max t_k`` and round trip ``R`` (every stage's forward and backward plus every activation and
gradient transfer once), with ``Nm`` minibatches per wave:

* ``D >= 1`` and ``Nm >= K`` (stages): the 1F1B order runs straight across wave boundaries, so the
  VW completes ``Nm`` minibatches every ``W_v = max(Nm x b, R, S_v)`` seconds: it is limited by its
  bottleneck, by the round trip, and by its PS synchronisation ``S_v``, which overlaps compute.
* ``D = 0``: a wave must be pushed by every VW before the next one starts, so the pipeline fills and
  drains every wave and the synchronisation is exposed: ``W_v = R + (Nm - 1) x b + S_v``. With
  ``Nm < K`` the schedule's wave gate drains stages 1 .. K-1 in the same way for any D, so the same
  formula applies (an upper bound: under D >= 1 stage 0 starts the next wave early, which the
  discrete-event simulator shows to gain up to a bottleneck or so per wave).
* These closed forms belong to the ``hetpipe`` schedule; each registered schedule carries its own
  (:mod:`hetpipe.schedule.registry`, ``ScheduleSpec.wave_time``), e.g. GPipe and 1F1B with a flush
  run one wave of all their minibatches, filled and drained.
* ``S_v``: per wave, each stage pushes its layers' updates and pulls their new values; for every
  shard it talks to this costs ``2 x (latency + bytes / bandwidth)`` over the link between the
  stage's node and the shard's node (free on the same device's node); ``S_v`` is the slowest stage's.
* Each shard's network interface carries, per wave, the pushes and pulls of every VW whose stage
  holding its layers is on another node: ``P_s = 2 x remote bytes / inter-node bandwidth``.

The wave period of the cluster is ``P = max(max_v W_v, max_s P_s)``: with bounded staleness no VW
can run more than ``D + 1`` waves ahead of the slowest, so in steady state every VW completes a
wave every ``P`` seconds and the cluster trains ``#VWs x Nm / P`` minibatches per second. Over a
finite run of ``H`` waves of the slowest VW (``horizon``), a faster VW may complete up to
``D + 1`` more waves, ``min(H + D + 1, H x P / W_v)``, so a larger D lets faster VWs run closer to
their own speed. All device speeds are modelled, not measured.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from hetpipe.plan.placement import holders
from hetpipe.plan.types import ShardPlan
from hetpipe.schedule.registry import ScheduleOptions, get_schedule


def vw_sync_time(stages: Sequence[Tuple[int, int, str]], param_bytes: Sequence[float],
                 shards: Sequence[ShardPlan], link) -> float:
    """``S_v``: the slowest stage's push + pull seconds per wave. ``stages``: (start, stop, node);
    ``link(node_a, node_b)`` returns an object with ``bandwidth`` and ``latency``."""
    owner: Dict[int, int] = {}
    for sh in shards:
        for layer in sh.layers:
            owner[layer] = sh.index
    worst = 0.0
    for a, b, node in stages:
        per: Dict[int, float] = {}
        for layer in range(a, b):
            s = owner.get(layer)
            if s is not None:
                per[s] = per.get(s, 0.0) + param_bytes[layer]
        t = 0.0
        for s, nbytes in per.items():
            if shards[s].node != node and nbytes > 0:
                lk = link(node, shards[s].node)
                t += 2 * (lk.latency + nbytes / lk.bandwidth)
        worst = max(worst, t)
    return worst


def shard_times(vw_stage_lists: Sequence[Sequence[Tuple[int, int, str]]], param_bytes: Sequence[float],
                shards: Sequence[ShardPlan], nodes: Sequence[str], inter_bandwidth: float) -> Tuple[float, ...]:
    """``P_s`` per shard: seconds its node's network needs per wave for remote pushes and pulls."""
    h = holders(len(param_bytes), nodes, vw_stage_lists)
    col = {n: i for i, n in enumerate(nodes)}
    pb = np.asarray(param_bytes, dtype=float)
    nvw = len(vw_stage_lists)
    out = []
    for sh in shards:
        idx = np.array(sh.layers, dtype=int)
        remote = float(np.sum(pb[idx] * (nvw - h[idx, col[sh.node]]))) if len(idx) else 0.0
        out.append(2 * remote / inter_bandwidth)
    return tuple(out)


def vw_wave_time(bottleneck: float, round_trip: float, sync: float, nm: int, d: int, num_stages: int = 1,
                 schedule: str = "hetpipe") -> float:
    """``W_v`` (see the module docstring) of a wave of ``nm`` minibatches under the registered ``schedule``."""
    spec = get_schedule(schedule)
    return spec.wave_time(bottleneck, round_trip, sync, ScheduleOptions(num_stages, nm, nm, d))


def cluster_throughput(wave_times: Sequence[float], nm: int, d: int, shard_period: float = 0.0,
                       horizon: Optional[int] = None) -> float:
    """Minibatches per second of the whole cluster under WSP (see the module docstring)."""
    if not wave_times:
        return 0.0
    period = max(max(wave_times), shard_period)
    if period <= 0:
        return float("inf")
    if horizon is None:
        return len(wave_times) * nm / period
    total_time = horizon * period
    waves = sum(min(horizon + d + 1, horizon * period / w) if w > 0 else horizon + d + 1 for w in wave_times)
    return waves * nm / total_time
