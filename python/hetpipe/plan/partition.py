"""Heterogeneous partitioner: contiguous stages over a VW's ordered devices, minimising the bottleneck.

For a fixed device order the problem is solved exactly by a min-max dynamic programme over cut
positions: ``f[k+1][j] = min_i max(f[k][i], cost_k(i, j))`` where ``cost_k(i, j)`` is the time of
stage ``k`` holding layers ``[i, j)`` (see :mod:`hetpipe.plan.stage_cost`) and ``+inf`` when the stage
does not fit its device's memory. Among the partitions with the optimal bottleneck, a second pass
picks the one with the smallest sum of stage times (a shorter round trip). Every device gets at
least one layer.

Each DP step is one vectorised (starts x stops) matrix.

Device orders: VWs of at most ``exhaustive_max`` devices (default 8), and larger VWs whose devices
fall into few interchangeable classes, are searched over every distinct order at once by the DP of
:mod:`hetpipe.plan.orders`, which is exact. Other VWs try the candidate orders of
:mod:`hetpipe.plan.mapping`, each solved exactly, and carry an admissible lower bound on the best
bottleneck (:func:`hetpipe.plan.orders.lower_bound`), so ``bottleneck / lower_bound`` bounds how far
from optimal they can be.

Deep models (more than ``coarse_above`` layers) are first solved on blocks of layers of about equal
compute (AutoPipe-H's sub-block granularity), then refined exactly at layer granularity with each
cut free to move within one block either side (not proven optimal: ``Partition.optimal`` is False);
every order when there are at most ``MAX_GROUP_ORDERS``, else the order search's winner on blocks. When nothing fits at block
granularity the blocks are made four times finer, and then every layer boundary is tried: blocks
never make a feasible model look infeasible.

Recomputation: the DP decides it per stage (mode ``fit``: only where a stage would not fit
otherwise); the winning partition's recomputing stages then recompute only the layers their memory
requires (:func:`keep_what_fits`, :mod:`hetpipe.plan.recompute`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import numpy as np

from hetpipe.plan.mapping import MAX_GROUP_ORDERS, distinct_perms, candidate_orders
from hetpipe.plan.orders import EXACT_MAX_PAIRS, device_classes, least_bytes_after, lower_bound, search, state_pairs
from hetpipe.plan.stage_cost import LayerTable, LinkCost, StageDevice, reference_times, stage_matrix
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

    stage_devs: Tuple[StageDevice, ...]
    stages: Tuple[StageResult, ...]
    nm: int
    optimal: bool = True        # proven optimal under the stage model (every order, every cut)
    lower_bound: float = 0.0    # when not proven optimal: an admissible bound on the best bottleneck

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


def _stage_device(cluster, device_id: str) -> StageDevice:
    d = cluster.device(device_id)
    return StageDevice(d.id, d.type, d.node, cluster.device_types[d.type].memory_bytes)


def links_of(stage_devs: Sequence[StageDevice], cluster) -> List[LinkCost]:
    """The links between consecutive stage devices."""
    out = []
    for x, y in zip(stage_devs[:-1], stage_devs[1:]):
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


def _cost_matrix(table: LayerTable, stage_devs, links, k, nm, starts, stops, mode, capacity):
    K = len(stage_devs)
    prev = links[k - 1] if k > 0 else None
    nxt = links[k] if k < K - 1 else None
    return stage_matrix(table, stage_devs[k], k, K, nm, starts, stops, prev, nxt, mode, capacity[k])


def _dp(table, stage_devs, links, nm, positions, mode, capacity, bound=np.inf):
    """Exact DP over candidate cut positions; returns (bounds, recompute flags), or None if nothing
    fits memory or nothing beats ``bound`` (a bottleneck already achieved elsewhere)."""
    K = len(stage_devs)
    mats = []
    f = np.zeros(1)
    for k in range(K):
        mats.append(_cost_matrix(table, stage_devs, links, k, nm, positions[k], positions[k + 1], mode, capacity))
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


def _blocks(table: LayerTable, stage_devs, num_blocks: int) -> np.ndarray:
    """Cut positions splitting the layers into about ``num_blocks`` blocks of equal compute."""
    L = table.num_layers
    ref = np.asarray(reference_times(table, stage_devs[0].device_type), dtype=float) + 1e-30
    cum = np.concatenate([[0.0], np.cumsum(ref)])
    targets = np.linspace(0.0, cum[-1], num_blocks + 1)
    cuts = np.unique(np.clip(np.searchsorted(cum, targets), 0, L))
    return np.unique(np.concatenate([[0, L], cuts, np.linspace(0, L, num_blocks + 1).astype(int)]))


def _full_positions(L: int, K: int) -> List[np.ndarray]:
    """Every cut: stage ``k`` starts anywhere that leaves a layer for each stage."""
    return [np.array([0])] + [np.arange(k, L - K + k + 1) for k in range(1, K)] + [np.array([L])]


def _coarse_positions(table: LayerTable, stage_devs, blocks: int) -> Optional[Tuple[List[np.ndarray], int]]:
    """Cuts at block boundaries only, and the widest block; None when some stage has no start."""
    K, L = len(stage_devs), table.num_layers
    cuts = _blocks(table, stage_devs, blocks)
    coarse = [np.array([0])] + [cuts[(cuts >= k) & (cuts <= L - K + k)] for k in range(1, K)] + [np.array([L])]
    if any(len(p) == 0 for p in coarse):
        return None
    return coarse, int(np.max(np.diff(cuts)))


def _granularities(table: LayerTable, stage_devs, coarse_above: int, num_blocks: int):
    """The coarse grids to try before layer granularity: none for models of at most
    ``coarse_above`` layers, else blocks of ``num_blocks`` then four times as many."""
    L = table.num_layers
    if L <= coarse_above:
        return
    for blocks in (num_blocks, 4 * num_blocks):
        if blocks >= L:
            return
        grid = _coarse_positions(table, stage_devs, blocks)
        if grid is None:
            return
        yield grid


def _refine(table, stage_devs, links, nm, mode, capacity, bounds, width, bound=np.inf):
    """The exact DP with each cut free to move ``width`` layers either side of ``bounds``."""
    K, L = len(stage_devs), table.num_layers
    fine = [np.array([0])]
    for k in range(1, K):
        c = bounds[k]
        fine.append(np.arange(max(k, c - width), min(L - K + k, c + width) + 1))
    fine.append(np.array([L]))
    return _dp(table, stage_devs, links, nm, fine, mode, capacity, bound)


def _solve_order(table, stage_devs, links, nm, mode, capacity, coarse_above, num_blocks, bound=np.inf,
                 fine_fallback: bool = True):
    """(bounds, flags) on one device order: block granularity refined to layers for deep models,
    and (``fine_fallback``) layer granularity before answering None, so blocks never hide the only
    feasible cut."""
    for coarse, width in _granularities(table, stage_devs, coarse_above, num_blocks):
        sol = _dp(table, stage_devs, links, nm, coarse, mode, capacity)   # no bound: refining may beat it
        if sol is not None:
            refined = _refine(table, stage_devs, links, nm, mode, capacity, sol[0], width, bound)
            return refined if refined is not None else sol
    if (not fine_fallback and table.num_layers > coarse_above) or least_bytes_after(table)[0] > float(np.sum(capacity)):
        return None
    return _dp(table, stage_devs, links, nm, _full_positions(table.num_layers, len(stage_devs)), mode, capacity, bound)


def _solve_exact(table, stage_devs, cluster, nm, mode, coarse_above, num_blocks, ignore_memory, blocks: bool = True):
    """(order, bounds, flags, optimal) over every distinct order, or None when nothing fits.
    Deep models are searched at block granularity with the winning order's cuts refined to layers
    (not proven optimal); layer granularity is always tried before answering None."""
    K, L = len(stage_devs), table.num_layers
    capacity = np.array([np.inf if ignore_memory else float(s.memory_bytes) for s in stage_devs])
    if blocks and L > coarse_above:
        for coarse, width in _granularities(table, stage_devs, coarse_above, num_blocks):
            sol = search(table, stage_devs, cluster, nm, mode, coarse, ignore_memory)   # no bound: see _solve_order
            if sol is None:
                continue
            order, bounds, flags = sol
            cap = np.array([np.inf if ignore_memory else float(s.memory_bytes) for s in order])
            refined = _refine(table, list(order), links_of(order, cluster), nm, mode, cap, bounds, width)
            return (order,) + (refined if refined is not None else (bounds, flags)) + (False,)
    full = _full_positions(L, K)
    upper = np.inf
    if len(device_classes(stage_devs)) > 2:
        # branch and bound: the given order's optimum is an upper bound worth its one DP
        links = links_of(stage_devs, cluster)
        first = _dp(table, stage_devs, links, nm, full, mode, capacity)
        upper = np.inf if first is None else evaluate(table, stage_devs, links, nm, *first).bottleneck
    sol = search(table, stage_devs, cluster, nm, mode, full, ignore_memory, upper)
    return None if sol is None else sol + (True,)


def evaluate(table: LayerTable, stage_devs: Sequence[StageDevice], links: Sequence[LinkCost], nm: int,
             bounds: Sequence[int], recompute: Sequence[bool]) -> Partition:
    """The stage model's costs of a given partition (no feasibility check)."""
    K = len(stage_devs)
    stages = []
    for k in range(K):
        a, b = bounds[k], bounds[k + 1]
        prev = links[k - 1] if k > 0 else None
        nxt = links[k] if k < K - 1 else None
        t, m = table.stage(stage_devs[k], k, K, nm, a, b, prev, nxt, recompute[k])
        f, bw = table.compute_times(stage_devs[k].device_type, a, b, recompute[k])
        layers = tuple(range(a, b)) if recompute[k] else ()
        stages.append(StageResult(a, b, t, f, bw, table.send_time(b, nxt), m, bool(recompute[k]), layers))
    return Partition(tuple(stage_devs), tuple(stages), nm)


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
        stage_dev = part.stage_devs[k]
        prev = links[k - 1] if k > 0 else None
        nxt = links[k] if k < K - 1 else None
        layers = choose_layers(table, stage_dev, k, K, part.nm, st.start, st.stop, prev, nxt)
        if layers is None:
            layers = st.recompute_layers
        t, m = recompute_cost(table, stage_dev, k, K, part.nm, st.start, st.stop, prev, nxt, layers)
        f, bw = table.compute_times(stage_dev.device_type, st.start, st.stop, False)
        bw += recompute_seconds(table, stage_dev.device_type, layers)
        stages.append(StageResult(st.start, st.stop, t, f, bw, st.send, m, bool(layers), tuple(layers)))
    return replace(part, stages=tuple(stages))


def overflow_report(table: LayerTable, stage_devs, links, nm, mode) -> str:
    """Why no partition fits: the stage that overflows most in the time-optimal unconstrained split."""
    K = len(stage_devs)
    rc = mode != "none"
    # deep models: the block-granularity split refined to layers is as good an example, and cheap
    bounds, _ = _solve_order(table, list(stage_devs), list(links), nm, "all" if rc else "none", np.full(K, np.inf),
                             256, 128)
    part = evaluate(table, stage_devs, links, nm, bounds, [rc] * K)
    worst = max(range(K), key=lambda k: part.stages[k].memory / max(stage_devs[k].memory_bytes, 1))
    s, sl = part.stages[worst], stage_devs[worst]
    return (f"e.g. the fastest split puts layers [{s.start}, {s.stop}) on {sl.device} ({sl.device_type}), "
            f"needing {s.memory} bytes of its {sl.memory_bytes} bytes")


def partition_order(table: LayerTable, stage_devs: Sequence[StageDevice], links: Sequence[LinkCost], nm: int,
                    recompute="none", coarse_above: int = 256, num_blocks: int = 128,
                    bound: float = np.inf, ignore_memory: bool = False, fine_fallback: bool = True
                    ) -> Optional[Partition]:
    """The optimal partition on a fixed device order, or None when nothing fits memory (or when no
    partition has a bottleneck <= ``bound``; or, without ``fine_fallback``, when nothing fits at
    block granularity)."""
    mode = _mode(recompute)
    if nm < 1:
        raise ValueError(f"partition: nm must be >= 1, got {nm}")
    if len(stage_devs) > table.num_layers:
        raise ValueError(f"partition: {len(stage_devs)} devices need at least {len(stage_devs)} layers, "
                         f"the model has {table.num_layers}")
    capacity = np.array([np.inf if ignore_memory else float(s.memory_bytes) for s in stage_devs])
    sol = _solve_order(table, list(stage_devs), list(links), nm, mode, capacity, coarse_above, num_blocks, bound,
                       fine_fallback)
    if sol is None:
        return None
    return evaluate(table, stage_devs, links, nm, sol[0], sol[1])


def partition(table, stage_devs: Sequence, cluster, nm: int, *, recompute="none",
              exhaustive_max: int = 8, coarse_above: int = 256, num_blocks: int = 128,
              relaxed: Optional[Partition] = None, ignore_memory: bool = False, d: Optional[int] = None) -> Partition:
    """The best partition of the model over the VW ``stage_devs`` in any device order.

    ``table``: a :class:`LayerTable` or a ModelProfile; ``stage_devs``: :class:`StageDevice` objects or device
    ids of ``cluster``, which supplies the links (``node_link``) and the devices' relative speeds.
    VWs of at most ``exhaustive_max`` devices, and larger ones whose devices fall into few
    interchangeable classes (:data:`hetpipe.plan.orders.EXACT_MAX_PAIRS`), are searched over every
    distinct order (:mod:`hetpipe.plan.orders`); others over the candidate orders of
    :mod:`hetpipe.plan.mapping`, with ``lower_bound`` set so that ``bottleneck / lower_bound``
    bounds the optimality gap.
    Raises ValueError naming a device and bytes when no order and no partition fits memory.
    ``relaxed``: the result of the same call with ``ignore_memory=True`` (any nm); when it fits
    memory at this ``nm`` it is optimal here too and the search is skipped.
    ``d``: the WSP staleness bound (sizes each stage's wave deltas) when ``table`` is a profile,
    default 0; a :class:`LayerTable` carries its own, and a different ``d`` is an error.
    """
    if not stage_devs:
        raise ValueError("partition: a virtual worker needs at least one device")
    stage_devs = [s if isinstance(s, StageDevice) else _stage_device(cluster, s) for s in stage_devs]
    if not isinstance(table, LayerTable):
        table = LayerTable(table, {s.device_type for s in stage_devs}, 0 if d is None else d)
    elif d is not None and d != table.d:
        raise ValueError(f"partition: d={d} but the LayerTable was built for d={table.d}")
    if len(stage_devs) > table.num_layers:
        raise ValueError(f"partition: {len(stage_devs)} devices need at least {len(stage_devs)} layers, "
                         f"the model has {table.num_layers}")
    if nm < 1:
        raise ValueError(f"partition: nm must be >= 1, got {nm}")
    mode = _mode(recompute)
    if relaxed is not None:
        links = links_of(relaxed.stage_devs, cluster)
        again = evaluate(table, relaxed.stage_devs, links, nm, relaxed.bounds, [s.recompute for s in relaxed.stages])
        if all(st.memory <= sl.memory_bytes for st, sl in zip(again.stages, again.stage_devs)):
            return replace(again, optimal=relaxed.optimal, lower_bound=relaxed.lower_bound)
    if ignore_memory and mode == "fit":
        mode = "none"
    best: Optional[Partition] = None
    few = table.num_layers > coarse_above and distinct_perms(stage_devs, _class) <= MAX_GROUP_ORDERS
    if few:
        # deep models on few orders: each order at block granularity refined to layers (the order
        # that wins on blocks need not win after refinement)
        best = _search_candidates(table, stage_devs, cluster, nm, mode, len(stage_devs), coarse_above, num_blocks,
                                  ignore_memory, fine_fallback=False)
    if best is None and (len(stage_devs) <= exhaustive_max or state_pairs(stage_devs) <= EXACT_MAX_PAIRS):
        # when blocks fit nothing in any order above, only layer granularity is left to try
        sol = _solve_exact(table, stage_devs, cluster, nm, mode, coarse_above, num_blocks, ignore_memory,
                           blocks=not few)
        if sol is not None:
            order, bounds, flags, optimal = sol
            best = evaluate(table, order, links_of(order, cluster), nm, bounds, flags)
            best = replace(best, optimal=optimal, lower_bound=best.bottleneck if optimal else lower_bound(table, stage_devs))
    elif best is None:
        best = _search_candidates(table, stage_devs, cluster, nm, mode, exhaustive_max, coarse_above, num_blocks,
                                  ignore_memory)
    if best is None:
        links = links_of(stage_devs, cluster)
        raise ValueError(
            f"partition: no split of {table.num_layers} layers over {', '.join(s.device for s in stage_devs)} "
            f"fits memory with nm={nm} (recompute={mode}) in any device order; "
            f"{overflow_report(table, stage_devs, links, nm, mode)}")
    if mode == "fit":
        best = keep_what_fits(table, best, links_of(best.stage_devs, cluster))
    return best


def _class(s: StageDevice) -> Tuple[str, int, str]:
    return s.device_type, s.memory_bytes, s.node


def _search_candidates(table, stage_devs, cluster, nm, mode, exhaustive_max, coarse_above, num_blocks,
                       ignore_memory, fine_fallback: bool = True) -> Optional[Partition]:
    """The best partition over :func:`hetpipe.plan.mapping.candidate_orders` (each order exact),
    with the admissible :func:`hetpipe.plan.orders.lower_bound`; None when none fits."""
    speed = {t: dt.speed for t, dt in cluster.device_types.items()}
    best: Optional[Partition] = None
    best_key = None
    for order in candidate_orders(stage_devs, speed, exhaustive_max):
        links = links_of(order, cluster)
        bound = best_key[0] if best is not None else np.inf
        p = partition_order(table, order, links, nm, mode, coarse_above, num_blocks, bound, ignore_memory,
                            fine_fallback)
        if p is None:
            continue
        key = (p.bottleneck, p.round_trip)
        if best is None or key < best_key:
            best, best_key = p, key
    if best is None:
        return None
    return replace(best, optimal=False, lower_bound=lower_bound(table, stage_devs))
