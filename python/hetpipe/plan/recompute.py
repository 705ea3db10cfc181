"""Recomputation and Hippie's memory efficiency.

The partitioner decides recomputation per stage (:mod:`hetpipe.plan.stage_cost` gives its memory and
time): mode ``none`` never recomputes, ``fit`` recomputes exactly the stages that would otherwise
not fit their device (the DP takes the cheaper variant that fits), ``all`` recomputes every stage
(each lists all its layers in ``StagePlan.recompute``). In mode ``fit`` each recomputing stage then
keeps what it can: :func:`choose_layers` picks the layers to recompute that fit the device at the
least recomputation time (exact up to ``EXACT_MAX`` layers, else by memory saved per second of
recomputation), so a stage recomputes only what its memory requires.

Memory of a stage recomputing the layer set ``R`` (the runtime recomputes maximal runs of ``R``,
saving each run's input per minibatch in flight and rebuilding one minibatch's activations of all
runs at its Recompute)::

    memory(R) = memory(no recompute) - (n_k - 1) x sum(stash[l] for l in R)
                                     + n_k x sum(input_bytes(run start) for the runs of R)

which is the stage model's whole-stage formula for ``R = [a, b)``.

Hippie chooses among candidate plans by memory efficiency, ``ME = scalability x throughput /
memory``, where scalability is the plan's throughput over that of the fastest single device
training the whole model (memory ignored), and memory is the plan's total predicted peak bytes.
``make_plan(objective="memory_efficiency")`` picks, over Nm and the three modes, the plan of
highest ME instead of the fastest.
"""

from __future__ import annotations

from itertools import groupby
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from hetpipe.plan.stage_cost import LayerTable, LinkCost, StageDevice, reference_times

EXACT_MAX = 16


def single_device_throughput(table: LayerTable, device_types: Iterable[str]) -> float:
    """Minibatches per second of the fastest device type running the whole model alone."""
    best = min(float(sum(reference_times(table, t))) for t in device_types)
    return float("inf") if best <= 0 else 1.0 / best


def memory_efficiency(throughput: float, single_throughput: float, memory_bytes: float) -> float:
    if memory_bytes <= 0 or single_throughput <= 0:
        return 0.0
    return (throughput / single_throughput) * throughput / memory_bytes


def recompute_cost(table: LayerTable, stage_dev: StageDevice, k: int, num_stages: int, nm: int, a: int, b: int,
                   prev: Optional[LinkCost], nxt: Optional[LinkCost],
                   layers: Sequence[int]) -> Tuple[float, int]:
    """(time, memory bytes) of stage ``k`` holding ``[a, b)`` and recomputing ``layers``."""
    return _Terms(table, stage_dev, k, num_stages, nm, a, b, prev, nxt).cost(layers)


def recompute_seconds(table: LayerTable, device_type: str, layers: Sequence[int]) -> float:
    """The forward time recomputing ``layers`` adds to a backward on ``device_type``."""
    return float(sum(np.diff(table.cum_fwd[device_type])[list(layers)]))


def choose_layers(table: LayerTable, stage_dev: StageDevice, k: int, num_stages: int, nm: int, a: int, b: int,
                  prev: Optional[LinkCost], nxt: Optional[LinkCost]) -> Optional[Tuple[int, ...]]:
    """The layers of ``[a, b)`` to recompute so that stage ``k`` fits ``stage_dev.memory_bytes`` at the
    least recomputation time (ties: less memory); ``()`` when nothing needs recomputing, None when
    even recomputing every layer does not fit."""
    terms = _Terms(table, stage_dev, k, num_stages, nm, a, b, prev, nxt)
    if terms.memory_none <= stage_dev.memory_bytes:
        return ()
    if b - a <= EXACT_MAX:
        return _exact(terms, table.in_bytes, stage_dev.memory_bytes)
    return _by_efficiency(terms, stage_dev.memory_bytes)


class _Terms:
    """What the cost of one stage under a recompute set is made of, computed once per stage."""

    def __init__(self, table, stage_dev, k, num_stages, nm, a, b, prev, nxt):
        self.a, self.b = a, b
        self.time_none, self.memory_none = table.stage(stage_dev, k, num_stages, nm, a, b, prev, nxt, recompute=False)
        self.n = min(nm, num_stages - k)
        self.fwd = np.diff(table.cum_fwd[stage_dev.device_type])
        self.stash = np.diff(table.cum_stash)
        self.in_bytes = table.in_bytes

    def cost(self, layers: Sequence[int]) -> Tuple[float, int]:
        chosen = sorted(set(layers))
        starts = [run[0] for run in runs(chosen)]
        mem = (self.memory_none - (self.n - 1) * sum(self.stash[l] for l in chosen)
               + self.n * sum(self.in_bytes[s] for s in starts))
        return self.time_none + sum(self.fwd[l] for l in chosen), int(round(mem))


def _exact(terms: _Terms, in_bytes: np.ndarray, cap: int) -> Optional[Tuple[int, ...]]:
    """Every subset at once: bit i of row r says whether layer a + i is recomputed in subset r."""
    a, b, n = terms.a, terms.b, terms.n
    m = b - a
    bits = (np.arange(1 << m)[:, None] >> np.arange(m)[None, :]) & 1
    starts = bits & (1 - np.concatenate([np.zeros((1 << m, 1), dtype=bits.dtype), bits[:, :-1]], axis=1))
    extra = bits @ terms.fwd[a:b]
    mem = terms.memory_none - (n - 1) * (bits @ terms.stash[a:b]) + n * (starts @ in_bytes[a:b])
    feasible = np.flatnonzero(np.round(mem) <= cap)
    if feasible.size == 0:
        return None
    best = feasible[np.lexsort((mem[feasible], extra[feasible]))[0]]
    return tuple(a + i for i in range(m) if bits[best, i])


def _by_efficiency(terms: _Terms, cap: int) -> Optional[Tuple[int, ...]]:
    """From recomputing everything, keep (stop recomputing) the layer whose memory cost per second
    of recomputation saved is least, while the stage still fits; Hippie's memory efficiency."""
    chosen = set(range(terms.a, terms.b))
    _, mem = terms.cost(chosen)
    if mem > cap:
        return None
    while chosen:
        best, best_key = None, None
        for l in sorted(chosen):
            _, m = terms.cost(chosen - {l})
            if m > cap:
                continue
            key = ((m - mem) / terms.fwd[l] if terms.fwd[l] > 0 else float("inf"), m)
            if best is None or key < best_key:
                best, best_key = l, key
        if best is None:
            break
        chosen.discard(best)
        _, mem = terms.cost(chosen)
    return tuple(sorted(chosen))


def runs(layers: Sequence[int]) -> List[List[int]]:
    """Maximal runs of consecutive layers (``layers`` sorted)."""
    return [[l for _, l in g] for _, g in groupby(enumerate(layers), key=lambda x: x[1] - x[0])]
