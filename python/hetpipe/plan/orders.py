"""Exact device-order search: one min-max DP over which devices the pipeline has used so far.

Devices of the same type and memory on the same node are interchangeable, so a VW is a multiset of
*classes* ``c`` with counts ``n_c``. A stage's time depends on its device, its layers ``[i, j)``,
its index ``k`` (stashes in flight) and its two links, and a link is intra- or inter-node. So the
optimal bottleneck over every order and every cut is the DP

    F_k[(u, c, q)][j] = min_i max(F_{k-1}[(u - c, c', q')][i], T(c, k, q', q; i, j))

where ``u`` counts the devices of each class used by stages ``0..k``, ``c`` is stage ``k``'s class,
``q`` says whether stage ``k + 1`` sits on ``c``'s node (``intra``) or not (``inter``, ``None`` for
the last stage), the predecessor ``(c', q')`` must agree (``c`` is on ``c'``'s node iff
``q' = intra``), and ``T`` is the stage model (:func:`hetpipe.plan.stage_cost.stage_matrix`, ``+inf``
where memory does not fit). A second pass with ``+`` in place of ``max``, over stages no slower than
the optimal bottleneck, picks the shortest round trip among the optimal partitions, as the fixed-order
DP does. The DP visits every distinct order implicitly: it has ``sum_c n_c x prod_{c' != c}
(n_c' + 1)`` (used, last class) pairs, at most ``K x 2^(K-1)`` for ``K`` devices (1024 for 8 distinct
devices), and far fewer when types repeat (``K`` for ``K`` identical devices).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hetpipe.plan.stage_cost import LayerTable, LinkCost, StageDevice, stage_matrix

# the most (used, last class) pairs searched exactly: every VW of up to 8 devices, any mix
EXACT_MAX_PAIRS = 1024

Key = Tuple[Tuple[int, ...], int, Optional[str]]


def device_classes(stage_devs: Sequence[StageDevice]) -> List[Tuple[StageDevice, ...]]:
    """The stage devices grouped into interchangeable classes (type, memory, node), in first-seen order."""
    groups: Dict[Tuple[str, int, str], List[StageDevice]] = {}
    for s in stage_devs:
        groups.setdefault((s.device_type, s.memory_bytes, s.node), []).append(s)
    return [tuple(g) for g in groups.values()]


def state_pairs(stage_devs: Sequence[StageDevice]) -> int:
    """How many (used counts, last class) pairs the exact search visits for these stage devices."""
    counts = [len(c) for c in device_classes(stage_devs)]
    total = 0
    for c, n in enumerate(counts):
        rest = 1
        for c2, n2 in enumerate(counts):
            if c2 != c:
                rest *= n2 + 1
        total += n * rest
    return total


def search(table: LayerTable, stage_devs: Sequence[StageDevice], cluster, nm: int, mode: str,
           positions: Sequence[np.ndarray], ignore_memory: bool = False, upper: float = np.inf
           ) -> Optional[Tuple[Tuple[StageDevice, ...], Tuple[int, ...], Tuple[bool, ...]]]:
    """The best (order, stage bounds, recompute flags) over every distinct order of ``stage_devs`` and
    every cut in ``positions`` (``positions[k]``: the starts allowed for stage ``k``; the last entry
    holds the layer count), or None when nothing fits memory. ``cluster`` supplies ``node_link``
    and ``inter_node``. ``upper``: a bottleneck some partition achieves (branch and bound: stages
    slower than it are cut off, which prunes prefixes and never the optimum); None is then returned
    only if nothing fits."""
    classes = device_classes(stage_devs)
    K = len(stage_devs)
    node = [c[0].node for c in classes]
    total = tuple(len(c) for c in classes)
    inter = LinkCost(cluster.inter_node.bandwidth, cluster.inter_node.latency)
    # bound on what is left: devices still unused must do the reference work after the cut, so the
    # bottleneck is at least that work / sum over them of 1 / r (see lower_bound)
    ref, rates = work_rates(table, {s.device_type for s in stage_devs})
    after = np.concatenate([np.cumsum(ref[::-1])[::-1], [0.0]])
    speed = [1.0 / rates[c[0].device_type] if rates[c[0].device_type] > 0 else np.inf for c in classes]
    # and their memory must hold what any stage keeps of the layers after the cut
    tail = least_bytes_after(table)
    memory = [0.0 if ignore_memory else float(c[0].memory_bytes) for c in classes]
    if not ignore_memory and tail[0] > sum(s.memory_bytes for s in stage_devs):
        return None

    def link(kind: Optional[str], n: str) -> Optional[LinkCost]:
        if kind is None:
            return None
        if kind == "inter":
            return inter
        lk = cluster.node_link(n, n)
        return LinkCost(lk.bandwidth, lk.latency)

    def next_kinds(used: Tuple[int, ...], c: int) -> List[Optional[str]]:
        """Where stage k + 1 may sit relative to class ``c``'s node, given the devices left."""
        left = [j for j in range(len(classes)) if used[j] < total[j]]
        if not left:
            return [None]
        out: List[Optional[str]] = []
        if any(node[j] == node[c] for j in left):
            out.append("intra")
        if any(node[j] != node[c] for j in left):
            out.append("inter")
        return out

    def run(threshold: Optional[float]):
        """Min-max DP (threshold None), or min-sum over stages <= threshold; the levels' states.
        A transition touches only the block of the stage matrix between a state's first and last
        finite entries (rows) and the finite columns of those rows: the band of cuts whose stages
        are no slower than the cut-off."""
        cut = (upper * (1 + 1e-12) if threshold is None else threshold)
        levels: List[List[Tuple[Key, np.ndarray, np.ndarray, np.ndarray]]] = []
        prev_states: List[Tuple[Key, np.ndarray, np.ndarray, np.ndarray]] = [
            ((tuple(0 for _ in classes), -1, None), np.zeros(1), np.zeros(1, int), np.zeros(1, int))]
        for k in range(K):
            # per (type, memory, link kinds): the matrix, and each row's first and last finite column
            mats: Dict[Tuple[str, int, Optional[str], Optional[str]], Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
            new: Dict[Key, List] = {}
            width = len(positions[k + 1])
            for pi, ((used, last, q), f, _, _) in enumerate(prev_states):
                fin = np.flatnonzero(np.isfinite(f))
                r0, r1 = int(fin[0]), int(fin[-1]) + 1
                fr = f[r0:r1, None]
                for c in range(len(classes)):
                    if used[c] == total[c]:
                        continue
                    if k > 0 and (node[c] == node[last]) != (q == "intra"):
                        continue
                    u2 = used[:c] + (used[c] + 1,) + used[c + 1:]
                    s = classes[c][0]
                    for q2 in next_kinds(u2, c):
                        mk = (s.device_type, s.memory_bytes, q, q2)
                        if mk not in mats:
                            cap = np.inf if ignore_memory else float(s.memory_bytes)
                            m, _ = stage_matrix(table, s, k, K, nm, positions[k], positions[k + 1],
                                                link(q, s.node), link(q2, s.node), mode, cap)
                            m = np.where(m <= cut, m, np.inf)
                            ok = np.isfinite(m)
                            any_ok = ok.any(axis=1)
                            lo = np.where(any_ok, ok.argmax(axis=1), width)
                            hi = np.where(any_ok, width - ok[:, ::-1].argmax(axis=1), 0)
                            mats[mk] = (m, lo, hi)
                        m, lo, hi = mats[mk]
                        c0, c1 = int(lo[r0:r1].min()), int(hi[r0:r1].max())
                        if c0 >= c1:
                            continue
                        tot = (fr + m[r0:r1, c0:c1]) if threshold is not None else np.maximum(fr, m[r0:r1, c0:c1])
                        best_row = tot.argmin(axis=0)
                        part = tot[best_row, np.arange(c1 - c0)]
                        if not np.isfinite(part).any():
                            continue
                        g = np.full(width, np.inf)
                        g[c0:c1] = part
                        if k < K - 1:
                            left = [total[j] - u2[j] for j in range(len(classes))]
                            rate = sum(n * sp for n, sp in zip(left, speed))
                            g[after[positions[k + 1]] > cut * rate] = np.inf
                            if not ignore_memory:
                                room = sum(n * mem for n, mem in zip(left, memory))
                                g[tail[positions[k + 1]] > room] = np.inf
                            if not np.isfinite(g).any():
                                continue
                        arg = np.zeros(width, dtype=int)
                        arg[c0:c1] = best_row + r0
                        key = (u2, c, q2)
                        cur = new.get(key)
                        if cur is None:
                            new[key] = [g, np.full(width, pi), arg]
                        else:
                            better = g < cur[0]
                            cur[0] = np.where(better, g, cur[0])
                            cur[1] = np.where(better, pi, cur[1])
                            cur[2] = np.where(better, arg, cur[2])
            prev_states = [(key, v[0], v[1], v[2]) for key, v in new.items()]
            if not prev_states:
                return None
            levels.append(prev_states)
        return levels

    levels = run(None)
    if levels is None:
        return None
    best = min(float(f[0]) for _, f, _, _ in levels[-1])
    if not np.isfinite(best):
        return None
    levels = run(best * (1 + 1e-12) + 1e-300)
    assert levels is not None, "the min-sum pass keeps the min-max optimum"
    s_idx = min(range(len(levels[-1])), key=lambda i: float(levels[-1][i][1][0]))
    idx = 0
    picked: List[int] = []
    bounds = [int(positions[K][0])]
    for k in range(K - 1, -1, -1):
        (_, c, _), _, par, arg = levels[k][s_idx]
        picked.append(c)
        i = int(arg[idx])
        bounds.append(int(positions[k][i]))
        s_idx, idx = int(par[idx]), i
    picked.reverse()
    bounds.reverse()
    taken = [0] * len(classes)
    order = []
    for c in picked:
        order.append(classes[c][taken[c]])
        taken[c] += 1
    flags = []
    for k, s in enumerate(order):
        prev = None if k == 0 else cluster.node_link(order[k - 1].node, s.node)
        nxt = None if k == K - 1 else cluster.node_link(s.node, order[k + 1].node)
        _, rc = stage_matrix(table, s, k, K, nm, np.array([bounds[k]]), np.array([bounds[k + 1]]),
                             None if prev is None else LinkCost(prev.bandwidth, prev.latency),
                             None if nxt is None else LinkCost(nxt.bandwidth, nxt.latency), mode,
                             np.inf if ignore_memory else float(s.memory_bytes))
        flags.append(bool(rc[0, 0]))
    return tuple(order), tuple(bounds), tuple(flags)


def least_bytes_after(table: LayerTable) -> np.ndarray:
    """Per cut position ``j``: the least memory the layers ``[j, L)`` need on any stages — state, one
    weight stash and its gradient, D + 2 wave deltas, one minibatch's activations (a stage has at
    least one minibatch in flight, and recomputation still holds one minibatch's activations)."""
    return (table.cum_state[-1] - table.cum_state + (table.d + 4) * (table.cum_param[-1] - table.cum_param)
            + table.cum_stash[-1] - table.cum_stash)


def work_rates(table: LayerTable, types: Sequence[str]) -> Tuple[np.ndarray, Dict[str, float]]:
    """Per-layer reference work ``w`` (compute seconds on the first type) and, per type ``t``, the
    least ratio ``r_t`` of its per-layer time to the reference: a stage on ``t`` holding reference
    work ``W`` computes for at least ``r_t x W`` seconds (0 when some layer is free on ``t``)."""
    types = sorted(types)
    w = {t: np.diff(table.cum_fwd[t]) + np.diff(table.cum_bwd[t]) for t in types}
    ref = w[types[0]]
    pos = ref > 0
    rates = {t: float(np.min(w[t][pos] / ref[pos])) if pos.any() else 0.0 for t in types}
    return np.where(pos, ref, 0.0), rates


def lower_bound(table: LayerTable, stage_devs: Sequence[StageDevice]) -> float:
    """An admissible lower bound on the bottleneck of any order and any cut (links and memory left
    out): some layer runs somewhere, ``B >= max_l min_t w_l^t``; and stage ``k`` holding reference
    work ``W_k`` takes at least ``r_k W_k`` (:func:`work_rates`), so ``W = sum_k W_k <= B sum_k 1/r_k``."""
    types = sorted({s.device_type for s in stage_devs})
    one = float(np.max(np.min(np.stack([np.diff(table.cum_fwd[t]) + np.diff(table.cum_bwd[t]) for t in types]),
                              axis=0)))
    ref, rates = work_rates(table, types)
    if any(rates[s.device_type] <= 0 for s in stage_devs):
        return one
    return max(one, float(np.sum(ref)) / sum(1.0 / rates[s.device_type] for s in stage_devs))
