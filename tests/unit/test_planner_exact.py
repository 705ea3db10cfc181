"""The order search against an independent brute force: 6-8 devices per VW, deep models, tight memory."""

import itertools
import random

import pytest

from hetpipe.plan.cluster import cluster_from_dict
from hetpipe.plan import LayerTable, StageDevice, format_plan, make_plan, partition
from hetpipe.plan.orders import lower_bound
from hetpipe.plan.profile import LayerProfile, ModelProfile

INTRA = (1e3, 0.01)
INTER = (1e2, 0.05)


def cluster_of(types, nodes):
    """types: {name: (memory, speed)}; nodes: [[type, ...], ...]."""
    return cluster_from_dict({
        "name": "t", "device_types": {t: {"memory_bytes": m, "speed": s} for t, (m, s) in types.items()},
        "nodes": [{"name": f"n{i}", "devices": d} for i, d in enumerate(nodes)],
        "intra_node": {"bandwidth": INTRA[0], "latency": INTRA[1]},
        "inter_node": {"bandwidth": INTER[0], "latency": INTER[1]}})


def profile_of(fwd, act, param, stash, ws, speeds):
    layers = [LayerProfile(f"l{i}", {t: fwd[i] / s for t, s in speeds.items()},
                           {t: 2 * fwd[i] / s for t, s in speeds.items()},
                           activation_bytes=act[i], param_bytes=param[i], optimizer_bytes=param[i],
                           workspace_bytes=ws[i], stash_bytes=stash[i]) for i in range(len(fwd))]
    return ModelProfile("m", 1, layers)


def slots_of(cluster):
    return [StageDevice(x.id, x.type, x.node, cluster.device_types[x.type].memory_bytes) for x in cluster.devices]


class BruteForce:
    """Every distinct device order x every contiguous cut, the stage model written out from its
    definition with prefix sums (times: fwd + bwd + the transfers in and out over intra- or
    inter-node links; memory: weights, gradients, optimizer state, n = min(nm, K - k) stashes of
    activations and of weights with their gradients, D + 2 wave deltas, the largest workspace)."""

    def __init__(self, prof: ModelProfile, cluster, nm: int, d: int):
        self.prof, self.cluster, self.nm, self.d = prof, cluster, nm, d
        lay = prof.layers
        self.L = len(lay)
        self.acc = {t: list(itertools.accumulate((x.fwd_time[t] + x.bwd_time[t] for x in lay), initial=0.0))
                    for t in lay[0].fwd_time}
        self.state = list(itertools.accumulate((2 * x.param_bytes + x.optimizer_bytes for x in lay), initial=0))
        self.par = list(itertools.accumulate((x.param_bytes for x in lay), initial=0))
        self.stash = list(itertools.accumulate((x.stash for x in lay), initial=0))
        self.ws = [x.workspace_bytes for x in lay]
        self.act = [x.activation_bytes for x in lay]

    def link_time(self, a: StageDevice, b: StageDevice, nbytes: int) -> float:
        bw, lat = INTRA if a.node == b.node else INTER
        return 0.0 if nbytes <= 0 else lat + nbytes / bw

    def stage(self, order, k, lo, hi):
        """(seconds, fits) of stage k of ``order`` holding layers [lo, hi)."""
        s, K = order[k], len(order)
        t = self.acc[s.device_type][hi] - self.acc[s.device_type][lo]
        if k > 0:
            t += self.link_time(order[k - 1], s, self.act[lo - 1])
        if k < K - 1:
            t += self.link_time(s, order[k + 1], self.act[hi - 1])
        n = min(self.nm, K - k)
        mem = (self.state[hi] - self.state[lo] + (2 * n + self.d + 2) * (self.par[hi] - self.par[lo])
               + n * (self.stash[hi] - self.stash[lo]) + max(self.ws[lo:hi]))
        return t, mem <= s.memory_bytes

    def orders(self, stage_devs):
        seen = set()
        for perm in itertools.permutations(stage_devs):
            sig = tuple((s.device_type, s.memory_bytes, s.node) for s in perm)
            if sig not in seen:
                seen.add(sig)
                yield perm

    def best(self, stage_devs) -> float:
        K, best = len(stage_devs), float("inf")
        for order in self.orders(stage_devs):
            for cuts in itertools.combinations(range(1, self.L), K - 1):
                b = (0,) + cuts + (self.L,)
                worst = 0.0
                for k in range(K):
                    t, fits = self.stage(order, k, b[k], b[k + 1])
                    if not fits or t >= best:
                        worst = float("inf")
                        break
                    worst = max(worst, t)
                best = min(best, worst)
        return best

    def check(self, part) -> float:
        """The bottleneck of the planner's partition by this model; its every stage must fit."""
        order, b = part.stage_devs, part.bounds
        worst = 0.0
        for k in range(len(order)):
            t, fits = self.stage(order, k, b[k], b[k + 1])
            assert fits, f"stage {k} of the planner's partition does not fit"
            worst = max(worst, t)
        return worst


def random_instance(rng: random.Random, K: int, L: int, ntypes: int, nnodes: int):
    speeds = {f"t{i}": rng.choice([0.5, 1.0, 1.5, 2.0, 3.0, 5.0]) for i in range(ntypes)}
    fwd = [rng.uniform(0.2, 2.0) for _ in range(L)]
    act = [rng.choice([0, 10, 50, 200]) for _ in range(L)]
    param = [rng.randint(1, 40) for _ in range(L)]
    stash = [rng.randint(0, 60) for _ in range(L)]
    ws = [rng.randint(0, 20) for _ in range(L)]
    prof = profile_of(fwd, act, param, stash, ws, speeds)
    # memory from "a device holds about its share of the model" down to tight
    share = sum(8 * p + 2 * s for p, s in zip(param, stash)) / K
    types = {t: (int(share * rng.uniform(0.8, 2.0)), s) for t, s in speeds.items()}
    kinds = [rng.choice(sorted(types)) for _ in range(K)]
    nodes = [[] for _ in range(nnodes)]
    for kind in kinds:
        nodes[rng.randrange(nnodes)].append(kind)
    cluster = cluster_of(types, [n for n in nodes if n])
    return prof, cluster


# (devices, layers, device types, nodes): duplicate types throughout, tight memory
CASES = [(6, 8, 3, 2), (6, 9, 4, 3), (6, 8, 6, 6), (6, 10, 2, 1), (7, 9, 3, 2), (7, 8, 4, 3),
         (8, 9, 3, 2), (8, 10, 2, 2), (8, 9, 4, 4)]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("K,L,ntypes,nnodes", CASES)
def test_exact_order_search_matches_brute_force(K, L, ntypes, nnodes, seed):
    rng = random.Random(1000 * K + 100 * L + 10 * ntypes + nnodes + 7919 * seed)
    prof, cluster = random_instance(rng, K, L, ntypes, nnodes)
    nm, d = rng.randint(1, 3), rng.randint(0, 1)
    bf = BruteForce(prof, cluster, nm, d)
    want = bf.best(slots_of(cluster))
    ids = [x.id for x in cluster.devices]
    if want == float("inf"):
        with pytest.raises(ValueError, match="fits memory .* in any device order"):
            partition(prof, ids, cluster, nm, d=d)
        return
    part = partition(prof, ids, cluster, nm, d=d)
    assert part.optimal
    assert part.bottleneck == pytest.approx(want, rel=1e-9)
    assert bf.check(part) == pytest.approx(want, rel=1e-9)


def test_eight_distinct_devices_on_eight_nodes_match_brute_force():
    # 8! = 40320 distinct orders, one layer per device: the order is everything
    rng = random.Random(8)
    speeds = {f"t{i}": s for i, s in enumerate([0.5, 0.7, 1.0, 1.3, 1.7, 2.2, 3.0, 4.0])}
    act = [rng.choice([10, 100, 400]) for _ in range(8)]
    prof = profile_of([rng.uniform(0.5, 2.0) for _ in range(8)], act, [5] * 8, [5] * 8, [0] * 8, speeds)
    cluster = cluster_of({t: (1000, s) for t, s in speeds.items()}, [[t] for t in speeds])
    stage_devs = [StageDevice(x.id, x.type, x.node, 1000) for x in cluster.devices]
    bf = BruteForce(prof, cluster, 2, 0)
    part = partition(prof, [x.id for x in cluster.devices], cluster, 2)
    assert part.optimal and bf.check(part) == pytest.approx(bf.best(stage_devs), rel=1e-9)


def deep_instance(rng: random.Random, L: int, kinds, window: int):
    """L layers, compute piled on the first tenth (so equal-compute blocks leave the rest coarse);
    memories chosen so that only cuts within ``window`` layers of a random point fit."""
    speeds = {t: s for t, s in kinds}
    fwd = [rng.uniform(5.0, 10.0) if i < L // 10 else rng.uniform(0.001, 0.01) for i in range(L)]
    param = [rng.randint(1, 4) for _ in range(L)]
    prof = profile_of(fwd, [1] * L, param, [0] * L, [0] * L, speeds)
    cut = rng.randint(L // 3, 2 * L // 3)
    # nm = 1, d = 0: a stage of layers [a, b) needs 7 x their parameter bytes (weights, gradients, optimizer, one stash and its gradient, 2 wave deltas), whatever its place
    head, tail = 7 * sum(param[:cut + window]), 7 * sum(param[cut:])
    types = {kinds[0][0]: (head, kinds[0][1]), kinds[1][0]: (tail, kinds[1][1])}
    return prof, cluster_of(types, [[kinds[0][0]], [kinds[1][0]]]), cut


def test_deep_model_whose_only_feasible_cut_blocks_hide():
    # 1000 layers, 2 devices, a stage of n layers needs 7n bytes (+ 6 of workspace with layer 0):
    # a (4206 bytes) holds at most 600 layers, b (2805 bytes) at most 400 and not with layer 0 beside
    # 399 others, so [0, 600) on a + [600, 1000) on b is the only fit; 600 is no boundary of the 128
    # or 512 blocks (equal compute, piled on the first 50 layers, or equal layer counts)
    L = 1000
    fwd = [10.0 if i < 50 else 0.01 for i in range(L)]
    prof = profile_of(fwd, [1] * L, [1] * L, [0] * L, [6] + [0] * (L - 1), {"a": 1.0, "b": 2.0})
    cluster = cluster_of({"a": (7 * 600 + 6, 1.0), "b": (7 * 400 + 5, 2.0)}, [["a"], ["b"]])
    part = partition(prof, [x.id for x in cluster.devices], cluster, 1)
    assert part.bounds == (0, 600, L) and [s.device_type for s in part.stage_devs] == ["a", "b"]
    bf = BruteForce(prof, cluster, 1, 0)
    assert bf.check(part) == pytest.approx(bf.best(slots_of(cluster)), rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_deep_tight_memory_matches_brute_force(seed):
    rng = random.Random(seed)
    L = rng.choice([300, 500, 700])
    prof, cluster, _ = deep_instance(rng, L, [("a", 1.0), ("b", rng.choice([0.5, 2.0]))], rng.randint(0, 3))
    stage_devs = slots_of(cluster)
    bf = BruteForce(prof, cluster, 1, 0)
    want = bf.best(stage_devs)
    assert want < float("inf")
    part = partition(prof, [x.id for x in cluster.devices], cluster, 1)
    assert bf.check(part) == pytest.approx(want, rel=1e-9)


@pytest.mark.slow
def test_deep_three_devices_match_brute_force():
    rng = random.Random(3)
    L = 200
    speeds = {"a": 1.0, "b": 2.0, "c": 3.0}
    param = [rng.randint(1, 4) for _ in range(L)]
    prof = profile_of([rng.uniform(0.1, 1.0) for _ in range(L)], [rng.randint(0, 50) for _ in range(L)],
                      param, [0] * L, [0] * L, speeds)
    third = 7 * sum(param) // 3
    cluster = cluster_of({"a": (int(third * 1.05), 1.0), "b": (int(third * 1.1), 2.0), "c": (int(third * 0.9), 3.0)},
                         [["a", "b"], ["c"]])
    stage_devs = slots_of(cluster)
    bf = BruteForce(prof, cluster, 1, 0)
    part = partition(prof, [x.id for x in cluster.devices], cluster, 1)
    assert part.optimal
    assert bf.check(part) == pytest.approx(bf.best(stage_devs), rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_lower_bound_is_admissible(seed):
    rng = random.Random(50 + seed)
    prof, cluster = random_instance(rng, 6, 8, 3, 2)
    cluster = cluster_of({t: (10**12, dt.speed) for t, dt in cluster.device_types.items()},
                         [[x.type for x in cluster.devices_of(n)] for n in cluster.nodes])
    stage_devs = [StageDevice(x.id, x.type, x.node, 10**12) for x in cluster.devices]
    table = LayerTable(prof, {s.device_type for s in stage_devs})
    assert 0 < lower_bound(table, stage_devs) <= BruteForce(prof, cluster, 2, 0).best(stage_devs) * (1 + 1e-12)


def test_vw_beyond_exact_search_states_its_gap():
    # 10 devices of 10 types: 10 x 2^9 (used, last) pairs, beyond the exact search; the plan says
    # how far from optimal it can be, by an admissible bound
    speeds = {f"t{i}": 1.0 + i / 3 for i in range(10)}
    rng = random.Random(10)
    prof = profile_of([rng.uniform(0.5, 2.0) for _ in range(30)], [10] * 30, [5] * 30, [5] * 30, [0] * 30,
                      speeds)
    cluster = cluster_of({t: (10**6, s) for t, s in speeds.items()}, [list(speeds)[:5], list(speeds)[5:]])
    part = partition(prof, [x.id for x in cluster.devices], cluster, 2)
    assert not part.optimal and 0 < part.lower_bound <= part.bottleneck
    plan = make_plan(cluster, prof, nm=2, policy="ED", vw_size=10)
    assert plan.meta["search"][0].startswith("bottleneck within ")
    assert "VW 0 partition: bottleneck within " in format_plan(plan)
