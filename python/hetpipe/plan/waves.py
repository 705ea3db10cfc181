"""Wave lengths: how many minibatches each VW trains per wave (docs/design.md, "Waves of unequal length").

HetPipe gives every VW the same wave, Nm minibatches. Under WSP the VWs advance one clock per wave and
stay within D clocks of each other, so with equal waves the slowest VW sets every VW's pace and the
faster ones wait at the D bound. ``"speed"`` makes a VW's wave proportional to its speed instead: VW ``v``
trains ``nm_v = round(Nm x T_max / T_v)`` minibatches per wave (``T_v`` its predicted time for a wave of
Nm, ``T_max`` the slowest VW's), so every wave takes about the slowest VW's time on every VW. The PS then
weighs each VW's delta by the samples behind it (``aggregate="mean"``: ``n_v / S`` instead of ``1 / N``).

A VW's Nm is also its cap on minibatches in flight, and a stage holds ``min(Nm, stages - stage)`` of them
(:mod:`hetpipe.schedule.generators`): a VW whose stage count exceeds the plan's Nm would need more memory
for a longer wave, so its wave stays Nm long (``meta["waves"]["kept"]`` names it).

:class:`Deal` is the arithmetic of the epoch's deal to VWs of such waves (slots by share,
:mod:`hetpipe.loader.deal`), kept here, free of torch, because a checkpoint's manifest counts it too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from hetpipe.plan.types import MAX_NM, Plan

WAVE_RULES = ("equal", "speed")


def check_wave_rule(where: str, waves: Any) -> str:
    """``waves`` if it is a known rule, else a ValueError naming ``where``."""
    if waves not in WAVE_RULES:
        raise ValueError(f"{where}: waves must be one of {list(WAVE_RULES)}, got {waves!r}")
    return waves


def speed_lengths(nm: int, wave_times: Sequence[float], num_stages: Sequence[int]) -> List[int]:
    """Minibatches per wave of each VW under ``"speed"``: ``round(nm x max(wave_times) / wave_times[v])``,
    at least ``nm`` and at most :data:`MAX_NM`; ``nm`` for a VW with more stages than ``nm`` (a longer
    wave would hold more in flight) or without a predicted time."""
    slowest = max(wave_times)
    out = []
    for t, k in zip(wave_times, num_stages):
        if t <= 0 or k > nm:
            out.append(nm)
        else:
            out.append(min(MAX_NM, max(nm, int(round(nm * slowest / t)))))
    return out


def speed_throughput(nm: int, wave_times: Sequence[float], num_stages: Sequence[int]) -> float:
    """Predicted minibatches per second of VWs with :func:`speed_lengths`' waves: every VW's minibatches
    per wave over the slowest VW's time for its wave (a wave of ``n_v`` taking ``T_v x n_v / nm``; the
    cost model's steady state, the PS shards' network time per wave left out). 0 without wave times."""
    lengths = speed_lengths(nm, wave_times, num_stages) if wave_times else []
    period = max((t * n / nm for t, n in zip(wave_times, lengths)), default=0.0)
    return sum(lengths) / period if period > 0 else 0.0


def with_waves(plan: Plan, waves: str) -> Plan:
    """``plan`` with the wave rule ``waves`` applied: unchanged under ``"equal"``; under ``"speed"``, each
    VW's Nm from :func:`speed_lengths` over ``meta["wave_time_s"]`` (the planner's prediction for a wave of
    Nm), the predicted throughput that of the longer waves (:func:`speed_throughput`), and
    ``meta["waves"]`` what was done."""
    check_wave_rule("make_plan", waves)
    if waves == "equal":
        return plan
    times = plan.meta.get("wave_time_s")
    if not times or len(times) != len(plan.virtual_workers):
        raise ValueError("make_plan: waves='speed' needs the planner's predicted wave time of every VW "
                         "(meta['wave_time_s']); this plan has none")
    stages = [len(vw.stages) for vw in plan.virtual_workers]
    lengths = speed_lengths(plan.nm, times, stages)
    vws = tuple(dataclasses.replace(vw, nm=0 if n == plan.nm else n) for vw, n in zip(plan.virtual_workers, lengths))
    meta: Dict[str, Any] = dict(plan.meta)
    meta["waves"] = {"rule": "speed", "minibatches": lengths,
                     "kept": [v for v, (k, n) in enumerate(zip(stages, lengths)) if k > plan.nm]}
    throughput = speed_throughput(plan.nm, times, stages)
    return dataclasses.replace(plan, virtual_workers=vws, meta=meta, throughput=throughput or plan.throughput)


@dataclass(frozen=True)
class Deal:
    """The slots of an epoch's deal (:mod:`hetpipe.loader.deal`): ``shares[v]`` (``q_v``) and ``offsets[v]`` of
    each VW, ``num_slots`` (``Q``), and ``per_slot``, the minibatches of each slot per wave (``gcd(n)``;
    Nm with equal waves)."""

    shares: Tuple[int, ...]
    offsets: Tuple[int, ...]
    per_slot: int

    @property
    def num_slots(self) -> int:
        return sum(self.shares)

    @property
    def equal(self) -> bool:
        """Whether each VW is one slot: the round-robin deal of equal waves."""
        return all(q == 1 for q in self.shares)

    def slots_of(self, vw: int) -> range:
        return range(self.offsets[vw], self.offsets[vw] + self.shares[vw])

    def per_epoch(self, vw: int, minibatches: int) -> int:
        """Minibatches VW ``vw`` takes of an epoch of ``minibatches``."""
        return minibatches // self.num_slots * self.shares[vw]


def deal_for(wave_minibatches: Sequence[int]) -> Deal:
    """The deal of VWs training ``wave_minibatches[v]`` minibatches per wave (``Plan.wave_minibatches``)."""
    g = 0
    for n in wave_minibatches:
        g = math.gcd(g, n)
    shares = tuple(n // g for n in wave_minibatches)
    offsets = tuple(sum(shares[:v]) for v in range(len(shares)))
    return Deal(shares, offsets, g)
