"""Heterogeneous partitioner: contiguous stages over a VW's ordered devices, minimising the bottleneck.

For a fixed device order the problem is solved exactly by a min-max dynamic programme over cut
positions: ``f[k+1][j] = min_i max(f[k][i], cost_k(i, j))`` where ``cost_k(i, j)`` is the time of
stage ``k`` holding layers ``[i, j)`` (see :mod:`hetpipe.plan.stage`) and ``+inf`` when the stage
does not fit its device's memory. Among the partitions with the optimal bottleneck, a second pass
picks the one with the smallest sum of stage times (a shorter round trip). Every device gets at
least one layer.

Each DP step is one vectorised (starts x stops) matrix. Deep models (more than ``coarse_above``
layers) are first solved on blocks of layers of about equal compute (AutoPipe-H's sub-block
granularity), then refined exactly at layer granularity with each cut free to move within one
block either side. When nothing fits at block granularity the blocks are made four times finer
once; a fit that needs cuts inside even those blocks is reported as infeasible (models at most
``coarse_above`` layers deep are always solved exactly).

Device orders: all orders (up to interchangeable devices) for VWs of at most ``exhaustive_max``
devices, else the candidate orders of :mod:`hetpipe.plan.mapping`.

Recomputation: the DP decides it per stage (mode ``fit``: only where a stage would not fit
otherwise); the winning partition's recomputing stages then recompute only the layers their memory
requires (:func:`keep_what_fits`, :mod:`hetpipe.plan.recompute`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from hetpipe.plan.mapping import candidate_orders
from hetpipe.plan.stage import LayerTable, LinkCost, Slot, reference_times
from hetpipe.plan.recompute import choose_layers, recompute_cost, recompute_seconds

RECOMPUTE_MODES = ("none", "fit", "all")


@dataclass(frozen=True)
class StageResult:
    start: int
    stop: int
    time: float             # compute + transfer: what the bottleneck is made of
    fwd: float
    bwd: float              # recomputation included
    send: float             # output activation to the next stage
    memory: int
    recompute: bool
    recompute_layers: Tuple[int, ...] = ()    # the layers recomputed (all of [start, stop) unless refined)


@dataclass(frozen=True)
class Partition:
    """One VW's device order and stages, with the stage model's predicted costs."""

    slots: Tuple[Slot, ...]
    stages: Tuple[StageResult, ...]
    nm: int

    @property
    def bottleneck(self) -> float:
        return max(s.time for s in self.stages)

    @property
    def round_trip(self) -> float:
        """Seconds for one minibatch alone to go forward and back through the VW."""
        return sum(s.fwd + s.bwd for s in self.stages) + 2 * sum(s.send for s in self.stages)

    @property
    def bounds(self) -> Tuple[int, ...]:
        return tuple(s.start for s in self.stages) + (self.stages[-1].stop,)


def _slot(cluster, device_id: str) -> Slot:
    d = cluster.device(device_id)
    return Slot(d.id, d.type, d.node, cluster.device_types[d.type].memory_bytes)


def links_of(slots: Sequence[Slot], cluster) -> List[LinkCost]:
    """The links between consecutive slots."""
    out = []
    for x, y in zip(slots[:-1], slots[1:]):
        lk = cluster.node_link(x.node, y.node)
        out.append(LinkCost(lk.bandwidth, lk.latency))
    return out


def _mode(recompute) -> str:
    if recompute is True:
        return "fit"
    if recompute is False or recompute is None:
        return "none"
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"partition: recompute must be one of {RECOMPUTE_MODES} or a bool, got {recompute!r}")
    return recompute


def _cost_matrix(table: LayerTable, slots, links, k, nm, starts, stops, mode, capacity):
    K = len(slots)
    a, b = starts[:, None], stops[None, :]
    prev = links[k - 1] if k > 0 else None
    nxt = links[k] if k < K - 1 else None
    invalid = b <= a
    options = [False, True] if mode == "fit" else [mode == "all"]
    best = rc = None
    for r in options:
        t, m = table.stage_arrays(slots[k], k, K, nm, a, b, prev, nxt, r)
        t[invalid | (m > capacity[k])] = np.inf
        if best is None:
            best, rc = t, np.full(t.shape, r)
        else:
            better = t < best
            best[better] = t[better]
            rc[better] = r
    return best, rc


def _dp(table, slots, links, nm, positions, mode, capacity, bound=np.inf):
    """Exact DP over candidate cut positions; returns (bounds, recompute flags), or None if nothing
    fits memory or nothing beats ``bound`` (a bottleneck already achieved elsewhere)."""
    K = len(slots)
    mats = []
    f = np.zeros(1)
    for k in range(K):
        mats.append(_cost_matrix(table, slots, links, k, nm, positions[k], positions[k + 1], mode, capacity))
        f = np.maximum(f[:, None], mats[k][0]).min(axis=0)
        if not f.min() <= bound:
            return None
    best = float(f[0])
    if not np.isfinite(best):
        return None
    # second pass: least total stage time among the partitions whose every stage is <= best
    tol = best * (1 + 1e-12) + 1e-300
    g = np.zeros(1)
    args = []
    for k in range(K):
        c = np.where(mats[k][0] <= tol, mats[k][0], np.inf)
        tot = g[:, None] + c
        args.append(tot.argmin(axis=0))
        g = tot.min(axis=0)
    idx = 0
    bounds = [int(positions[K][0])]
    flags = []
    for k in range(K - 1, -1, -1):
        i = int(args[k][idx])
        flags.append(bool(mats[k][1][i, idx]))
        bounds.append(int(positions[k][i]))
        idx = i
    return tuple(reversed(bounds)), tuple(reversed(flags))


def _blocks(table: LayerTable, slots, num_blocks: int) -> np.ndarray:
    """Cut positions splitting the layers into about ``num_blocks`` blocks of equal compute."""
    L = table.num_layers
    ref = np.asarray(reference_times(table, slots[0].device_type), dtype=float) + 1e-30
    cum = np.concatenate([[0.0], np.cumsum(ref)])
    targets = np.linspace(0.0, cum[-1], num_blocks + 1)
    cuts = np.unique(np.clip(np.searchsorted(cum, targets), 0, L))
    return np.unique(np.concatenate([[0, L], cuts, np.linspace(0, L, num_blocks + 1).astype(int)]))


def _solve_order(table, slots, links, nm, mode, capacity, coarse_above, num_blocks, bound=np.inf):
    K, L = len(slots), table.num_layers
    full = [np.array([0])] + [np.arange(k, L - K + k + 1) for k in range(1, K)] + [np.array([L])]
    if L <= coarse_above:
        return _dp(table, slots, links, nm, full, mode, capacity, bound)
    sol, cuts = None, None
    for blocks in (num_blocks, 4 * num_blocks):
        if blocks >= L:
            return _dp(table, slots, links, nm, full, mode, capacity, bound)
        cuts = _blocks(table, slots, blocks)
        coarse = ([np.array([0])] + [cuts[(cuts >= k) & (cuts <= L - K + k)] for k in range(1, K)]
                  + [np.array([L])])
        if any(len(p) == 0 for p in coarse):
            return _dp(table, slots, links, nm, full, mode, capacity, bound)
        sol = _dp(table, slots, links, nm, coarse, mode, capacity)   # no bound: refining may beat it
        if sol is not None:
            break
    if sol is None:
        return None
    w = int(np.max(np.diff(cuts)))
    fine = [np.array([0])]
    for k in range(1, K):
        c = sol[0][k]
        fine.append(np.arange(max(k, c - w), min(L - K + k, c + w) + 1))
    fine.append(np.array([L]))
    refined = _dp(table, slots, links, nm, fine, mode, capacity, bound)
    return refined if refined is not None else sol


def evaluate(table: LayerTable, slots: Sequence[Slot], links: Sequence[LinkCost], nm: int,
             bounds: Sequence[int], recompute: Sequence[bool]) -> Partition:
    """The stage model's costs of a given partition (no feasibility check)."""
    K = len(slots)
    stages = []
    for k in range(K):
        a, b = bounds[k], bounds[k + 1]
        prev = links[k - 1] if k > 0 else None
        nxt = links[k] if k < K - 1 else None
        t, m = table.stage(slots[k], k, K, nm, a, b, prev, nxt, recompute[k])
        f, bw = table.compute_times(slots[k].device_type, a, b, recompute[k])
        layers = tuple(range(a, b)) if recompute[k] else ()
        stages.append(StageResult(a, b, t, f, bw, table.send_time(b, nxt), m, bool(recompute[k]), layers))
    return Partition(tuple(slots), tuple(stages), nm)


def keep_what_fits(table: LayerTable, part: Partition, links: Sequence[LinkCost]) -> Partition:
    """Mode ``fit``: each recomputing stage recomputes only the layers its memory requires
    (:func:`hetpipe.plan.recompute.choose_layers`); the others keep their activations. Stage
    boundaries stay; no stage gets slower, so neither does the VW."""
    K = len(part.stages)
    stages = []
    for k, st in enumerate(part.stages):
        if not st.recompute:
            stages.append(st)
            continue
        slot = part.slots[k]
        prev = links[k - 1] if k > 0 else None
        nxt = links[k] if k < K - 1 else None
        layers = choose_layers(table, slot, k, K, part.nm, st.start, st.stop, prev, nxt)
        if layers is None:
            layers = st.recompute_layers
        t, m = recompute_cost(table, slot, k, K, part.nm, st.start, st.stop, prev, nxt, layers)
        f, bw = table.compute_times(slot.device_type, st.start, st.stop, False)
        bw += recompute_seconds(table, slot.device_type, layers)
        stages.append(StageResult(st.start, st.stop, t, f, bw, st.send, m, bool(layers), tuple(layers)))
    return Partition(part.slots, tuple(stages), part.nm)


def overflow_report(table: LayerTable, slots, links, nm, mode) -> str:
    """Why no partition fits: the stage that overflows most in the time-optimal unconstrained split."""
    K = len(slots)
    inf_cap = np.full(K, np.inf)
    L = table.num_layers
    full = [np.array([0])] + [np.arange(k, L - K + k + 1) for k in range(1, K)] + [np.array([L])]
    rc = mode != "none"
    bounds, _ = _dp(table, slots, links, nm, full, "all" if rc else "none", inf_cap)
    part = evaluate(table, slots, links, nm, bounds, [rc] * K)
    worst = max(range(K), key=lambda k: part.stages[k].memory / max(slots[k].memory_bytes, 1))
    s, sl = part.stages[worst], slots[worst]
    return (f"e.g. the fastest split puts layers [{s.start}, {s.stop}) on {sl.device} ({sl.device_type}), "
            f"needing {s.memory} bytes of its {sl.memory_bytes} bytes")


def partition_order(table: LayerTable, slots: Sequence[Slot], links: Sequence[LinkCost], nm: int,
                    recompute="none", coarse_above: int = 256, num_blocks: int = 128,
                    bound: float = np.inf, ignore_memory: bool = False) -> Optional[Partition]:
    """The optimal partition on a fixed device order, or None when nothing fits memory (or when no
    partition has a bottleneck <= ``bound``)."""
    mode = _mode(recompute)
    if nm < 1:
        raise ValueError(f"partition: nm must be >= 1, got {nm}")
    if len(slots) > table.num_layers:
        raise ValueError(f"partition: {len(slots)} devices need at least {len(slots)} layers, "
                         f"the model has {table.num_layers}")
    capacity = np.array([np.inf if ignore_memory else float(s.memory_bytes) for s in slots])
    sol = _solve_order(table, list(slots), list(links), nm, mode, capacity, coarse_above, num_blocks, bound)
    if sol is None:
        return None
    return evaluate(table, slots, links, nm, sol[0], sol[1])


def partition(table, slots: Sequence, cluster, nm: int, *, recompute="none",
              exhaustive_max: int = 5, coarse_above: int = 256, num_blocks: int = 128,
              relaxed: Optional[Partition] = None, ignore_memory: bool = False, d: Optional[int] = None) -> Partition:
    """The best partition of the model over the VW ``slots`` in any device order we search.

    ``table``: a :class:`LayerTable` or a ModelProfile; ``slots``: :class:`Slot` objects or device
    ids of ``cluster``, which supplies the links (``node_link``) and the devices' relative speeds.
    Raises ValueError naming a device and bytes when no order and no partition fits memory.
    ``relaxed``: the result of the same call with ``ignore_memory=True`` (any nm); when it fits
    memory at this ``nm`` it is optimal here too and the search is skipped.
    ``d``: the WSP staleness bound (sizes each stage's wave deltas) when ``table`` is a profile,
    default 0; a :class:`LayerTable` carries its own, and a different ``d`` is an error.
    """
    if not slots:
        raise ValueError("partition: a virtual worker needs at least one device")
    slots = [s if isinstance(s, Slot) else _slot(cluster, s) for s in slots]
    if not isinstance(table, LayerTable):
        table = LayerTable(table, {s.device_type for s in slots}, 0 if d is None else d)
    elif d is not None and d != table.d:
        raise ValueError(f"partition: d={d} but the LayerTable was built for d={table.d}")
    mode = _mode(recompute)
    if relaxed is not None:
        links = links_of(relaxed.slots, cluster)
        again = evaluate(table, relaxed.slots, links, nm, relaxed.bounds, [s.recompute for s in relaxed.stages])
        if all(st.memory <= sl.memory_bytes for st, sl in zip(again.stages, again.slots)):
            return again
    if ignore_memory and mode == "fit":
        mode = "none"
    speed = {t: dt.speed for t, dt in cluster.device_types.items()}
    best: Optional[Partition] = None
    best_key = None
    orders = candidate_orders(slots, speed, exhaustive_max)
    for order in orders:
        links = links_of(order, cluster)
        bound = best_key[0] if best is not None else np.inf
        p = partition_order(table, order, links, nm, mode, coarse_above, num_blocks, bound, ignore_memory)
        if p is None:
            continue
        key = (p.bottleneck, p.round_trip)
        if best is None or key < best_key:
            best, best_key = p, key
    if best is None:
        links = links_of(orders[0], cluster)
        raise ValueError(
            f"partition: no split of {table.num_layers} layers over {', '.join(s.device for s in slots)} "
            f"fits memory with nm={nm} (recompute={mode}); "
            f"{overflow_report(table, orders[0], links, nm, mode)}")
    if mode == "fit":
        best = keep_what_fits(table, best, links_of(best.slots, cluster))
    return best
