"""Parameter-server shards as resources of the simulator: their traffic per stage, and busy calendars.

Each shard has three resources, each serving one request at a time:

* **receive** — a push from a stage occupies the shard's link for ``latency + bytes / bandwidth``;
  the link is the cluster's intra-node link when the stage's device is on the shard's node, else the
  inter-node link. The pushing stage's own PS link is busy for the same interval (one push at a time
  per stage, its shards in index order).
* **apply** — a received push is added into the shard's weights in ``bytes / apply_rate`` seconds
  (:data:`DEFAULT_APPLY_RATE` unless overridden), after it has been received; receiving the next
  push overlaps applying this one.
* **send** — a pull occupies the shard's link back to the stage for the push's transfer time.

A request takes the first idle interval of its length at or after the moment it is ready (FIFO
when requests come in time order, which they do within VWs sharing a schedule; across VWs with
different schedules the simulator books them in the order it plays them, so a request booked later
fits into an earlier idle gap rather than delaying requests already booked). A shard has applied
wave ``c`` when every VW's push of wave ``c`` to it has been applied.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# Bytes of pushed float32 deltas a shard adds into its weights per second. Applying reads the delta
# and the weights and writes the weights back (3x the pushed bytes of memory traffic), so a host
# streaming ~12 GB/s applies ~4 GB/s; measure a machine with bench/core_apply.py and override.
DEFAULT_APPLY_RATE = 4e9


@dataclass(frozen=True)
class ShardTraffic:
    """One stage's traffic with one shard per wave: seconds its push occupies the link
    (``push_s``), the shard takes to apply it (``apply_s``), and the pull occupies the link
    (``pull_s``)."""

    shard: int
    push_s: float
    apply_s: float
    pull_s: float

    def __post_init__(self) -> None:
        for name in ("push_s", "apply_s", "pull_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"ShardTraffic: {name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.shard, int) or self.shard < 0:
            raise ValueError(f"ShardTraffic: shard must be an index >= 0, got {self.shard!r}")


StageTraffic = Tuple[ShardTraffic, ...]


class Calendar:
    """Busy intervals of one resource serving one request at a time (sorted, disjoint, merged)."""

    def __init__(self) -> None:
        self.starts: List[float] = []
        self.ends: List[float] = []
        self.busy_s = 0.0

    def book(self, ready: float, dur: float) -> Tuple[float, float]:
        """Reserve the first idle ``[start, start + dur)`` with ``start >= ready``; return it."""
        if dur <= 0:
            return ready, ready
        starts, ends = self.starts, self.ends
        i = bisect_right(ends, ready)           # intervals before i end at or before ``ready``
        t = ready
        while i < len(starts) and starts[i] < t + dur:
            t = max(t, ends[i])
            i += 1
        end = t + dur
        self.busy_s += dur
        if i > 0 and ends[i - 1] == t:
            if i < len(starts) and starts[i] == end:
                ends[i - 1] = ends[i]
                del starts[i], ends[i]
            else:
                ends[i - 1] = end
        elif i < len(starts) and starts[i] == end:
            starts[i] = t
        else:
            starts.insert(i, t)
            ends.insert(i, end)
        return t, end


@dataclass(frozen=True)
class ShardStats:
    """One shard over a simulation: seconds its receive, apply and send resources were busy."""

    recv_s: float
    apply_s: float
    send_s: float


class Shards:
    """The shards' calendars and which waves each has applied, shared by every VW of a simulation."""

    def __init__(self, num_shards: int) -> None:
        self.recv = [Calendar() for _ in range(num_shards)]
        self.apply = [Calendar() for _ in range(num_shards)]
        self.send = [Calendar() for _ in range(num_shards)]
        self._applied: Dict[Tuple[int, int], float] = {}      # (wave, shard): its last push applied
        self._through: Dict[Tuple[int, int], float] = {}      # (wave, shard): all waves <= wave applied
        self.events: List[Tuple[str, int, int, float, float]] = []    # (kind, shard, wave, start, dur)

    def push(self, ready: float, wave: int, traffic: StageTraffic,
             booked: Optional[List[Tuple[int, float, float]]] = None) -> float:
        """Book one stage's push of ``wave`` to each of its shards in turn; return when the stage's
        link is free again (its last push received). ``booked`` gets ``(shard, received, applied)``
        of each push."""
        for tr in traffic:
            start, got = self.recv[tr.shard].book(ready, tr.push_s)
            a0, done = self.apply[tr.shard].book(got, tr.apply_s)
            key = (wave, tr.shard)
            self._applied[key] = max(self._applied.get(key, 0.0), done)
            self.events.append(("PUSH", tr.shard, wave, start, got - start))
            self.events.append(("APPLY", tr.shard, wave, a0, done - a0))
            if booked is not None:
                booked.append((tr.shard, got, done))
            ready = got
        return ready

    def applied(self, wave: int, traffic: StageTraffic) -> float:
        """When every shard of ``traffic`` has applied all waves ``<= wave`` (all pushed by now)."""
        return max((self._through_wave(wave, tr.shard) for tr in traffic), default=0.0)

    def _through_wave(self, wave: int, shard: int) -> float:
        c = wave
        while c >= 0 and (c, shard) not in self._through:
            c -= 1
        t = self._through[(c, shard)] if c >= 0 else 0.0
        for c in range(c + 1, wave + 1):
            t = max(t, self._applied.get((c, shard), 0.0))
            self._through[(c, shard)] = t
        return t

    def pull(self, ready: float, wave: int, traffic: StageTraffic) -> float:
        """Book one stage's pull of ``wave`` from each of its shards in turn; return when it ends."""
        for tr in traffic:
            start, ready = self.send[tr.shard].book(ready, tr.pull_s)
            self.events.append(("PULL", tr.shard, wave, start, ready - start))
        return ready

    def stats(self) -> List[ShardStats]:
        return [ShardStats(r.busy_s, a.busy_s, s.busy_s) for r, a, s in zip(self.recv, self.apply, self.send)]


def plan_traffic(plan, cluster, param_bytes: Sequence[float], apply_rate: float = DEFAULT_APPLY_RATE
                 ) -> List[List[StageTraffic]]:
    """Per VW, per stage of ``plan``: its traffic with each shard owning some of its layers' bytes.

    ``cluster`` gives each device's node and the links; ``param_bytes[l]`` is layer ``l``'s pushed
    and pulled bytes per wave (float32 weights)."""
    if not (isinstance(apply_rate, (int, float)) and math.isfinite(apply_rate) and apply_rate > 0):
        raise ValueError(f"PS model: apply rate must be a finite number of bytes/s > 0, got {apply_rate!r}")
    if len(param_bytes) != plan.num_layers:
        raise ValueError(f"PS model: {len(param_bytes)} layer sizes for a plan of {plan.num_layers} layers")
    owner = {layer: sh.index for sh in plan.ps_shards for layer in sh.layers}
    shard_node = {sh.index: sh.node for sh in plan.ps_shards}
    out: List[List[StageTraffic]] = []
    for vw in plan.virtual_workers:
        stages = []
        for st in vw.stages:
            node = cluster.device(st.device).node
            per: Dict[int, float] = {}
            for layer in st.layers:
                if layer in owner:
                    per[owner[layer]] = per.get(owner[layer], 0.0) + float(param_bytes[layer])
            traffic = []
            for s in sorted(per):
                nbytes = per[s]
                if nbytes <= 0:
                    continue
                link = cluster.node_link(node, shard_node[s])
                tx = link.time(nbytes)
                traffic.append(ShardTraffic(s, tx, nbytes / apply_rate, tx))
            stages.append(tuple(traffic))
        out.append(stages)
    return out
