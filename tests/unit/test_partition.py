"""The partitioner against brute force, heterogeneity, memory limits and infeasibility."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetpipe.plan import LayerTable, StageDevice, partition
from hetpipe.plan.cluster import cluster_from_dict
from hetpipe.plan.partition import links_of
from hetpipe.plan.profile import LayerProfile, ModelProfile


def make_cluster(types, nodes, intra=(1e3, 0.01), inter=(1e2, 0.05)):
    """types: {name: (memory, speed)}; nodes: [[type, ...], ...]."""
    return cluster_from_dict({
        "name": "t", "device_types": {t: {"memory_bytes": m, "speed": s} for t, (m, s) in types.items()},
        "nodes": [{"name": f"n{i}", "devices": d} for i, d in enumerate(nodes)],
        "intra_node": {"bandwidth": intra[0], "latency": intra[1]},
        "inter_node": {"bandwidth": inter[0], "latency": inter[1]}})


def make_profile(times, speeds, act, stash, param, opt, ws, input_bytes=0):
    layers = [LayerProfile(f"l{i}", {t: times[i] / s for t, s in speeds.items()},
                           {t: 2 * times[i] / s for t, s in speeds.items()},
                           activation_bytes=act[i], param_bytes=param[i], optimizer_bytes=opt[i],
                           workspace_bytes=ws[i], stash_bytes=stash[i])
              for i in range(len(times))]
    return ModelProfile("m", 1, layers, input_bytes=input_bytes)


def slots_of(cluster, ids=None):
    devs = cluster.devices if ids is None else [cluster.device(i) for i in ids]
    return [StageDevice(d.id, d.type, d.node, cluster.device_types[d.type].memory_bytes) for d in devs]


def brute_force(profile, cluster, stage_devs, nm, d):
    """Best bottleneck over every device order and every cut; the stage model written out directly."""
    L, K = profile.num_layers, len(stage_devs)
    layers = profile.layers
    best = float("inf")
    for order in itertools.permutations(stage_devs):
        for cuts in itertools.combinations(range(1, L), K - 1):
            b = (0,) + cuts + (L,)
            worst = 0.0
            for k, s in enumerate(order):
                lo, hi = b[k], b[k + 1]
                t = sum(layers[i].fwd_time[s.device_type] + layers[i].bwd_time[s.device_type] for i in range(lo, hi))
                if k < K - 1:
                    lk = cluster.node_link(s.node, order[k + 1].node)
                    if layers[hi - 1].activation_bytes:
                        t += lk.latency + layers[hi - 1].activation_bytes / lk.bandwidth
                if k > 0:
                    lk = cluster.node_link(order[k - 1].node, s.node)
                    if layers[lo - 1].activation_bytes:
                        t += lk.latency + layers[lo - 1].activation_bytes / lk.bandwidth
                n = min(nm, K - k)
                mem = sum(2 * layers[i].param_bytes + layers[i].optimizer_bytes for i in range(lo, hi))
                mem += max(layers[i].workspace_bytes for i in range(lo, hi))
                mem += n * sum(layers[i].stash for i in range(lo, hi))
                # n weight stashes with their gradients, and d + 2 wave deltas
                mem += (2 * n + d + 2) * sum(layers[i].param_bytes for i in range(lo, hi))
                if mem > s.memory_bytes:
                    worst = float("inf")
                    break
                worst = max(worst, t)
            best = min(best, worst)
    return best


@st.composite
def instances(draw, memory_limits):
    L = draw(st.integers(1, 12))
    ntypes = draw(st.integers(1, 3))
    speeds = {f"t{i}": draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0])) for i in range(ntypes)}
    K = draw(st.integers(1, min(4, L)))
    kinds = [draw(st.sampled_from(sorted(speeds))) for _ in range(K)]
    nodes_of = [draw(st.integers(0, 1)) for _ in range(K)]
    nodes = [[k for k, n in zip(kinds, nodes_of) if n == j] for j in range(2)]
    nodes = [n for n in nodes if n]
    ints = st.integers(0, 100)
    times = [draw(st.integers(1, 100)) / 10 for _ in range(L)]
    act = [draw(ints) for _ in range(L)]
    stash = [draw(ints) for _ in range(L)]
    param = [draw(ints) for _ in range(L)]
    opt = [draw(ints) for _ in range(L)]
    ws = [draw(ints) for _ in range(L)]
    mems = {t: (draw(st.integers(100, 6000)) if memory_limits else 10**12) for t in speeds}
    cluster = make_cluster({t: (mems[t], speeds[t]) for t in speeds}, nodes)
    nm = draw(st.integers(1, 4))
    d = draw(st.integers(0, 2))
    return make_profile(times, speeds, act, stash, param, opt, ws), cluster, nm, d


def check_against_brute_force(profile, cluster, nm, d):
    stage_devs = slots_of(cluster)
    want = brute_force(profile, cluster, stage_devs, nm, d)
    table = LayerTable(profile, cluster.device_types, d)
    if want == float("inf"):
        with pytest.raises(ValueError, match=r"fits memory.*needing \d+ bytes of its \d+ bytes"):
            partition(table, stage_devs, cluster, nm)
        return
    got = partition(table, stage_devs, cluster, nm)
    assert got.bottleneck == pytest.approx(want, rel=1e-9)
    for st_, sl in zip(got.stages, got.stage_devs):
        assert st_.memory <= sl.memory_bytes
    assert sorted(s.device for s in got.stage_devs) == sorted(s.device for s in stage_devs)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(memory_limits=False))
def test_matches_brute_force_without_memory_limits(inst):
    check_against_brute_force(*inst)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(memory_limits=True))
def test_matches_brute_force_with_memory_limits(inst):
    check_against_brute_force(*inst)


def test_fast_device_gets_more_layers():
    cluster = make_cluster({"fast": (10**9, 4.0), "slow": (10**9, 1.0)}, [["fast", "slow"]])
    profile = make_profile([1.0] * 10, {"fast": 4.0, "slow": 1.0}, *[[0] * 10] * 5)
    part = partition(LayerTable(profile, cluster.device_types), slots_of(cluster), cluster, 1)
    n = {sl.device_type: st_.stop - st_.start for st_, sl in zip(part.stages, part.stage_devs)}
    assert n == {"fast": 8, "slow": 2}
    assert part.bottleneck == pytest.approx(2 * 3 / 1.0)


def test_memory_moves_layers_off_a_small_device():
    # the fast device is tiny: memory, not speed, decides its share (each layer needs 6 x 50 bytes:
    # weights, gradients, a weight stash and its gradient, 2 wave deltas; 650 bytes hold two)
    cluster = make_cluster({"fast": (650, 4.0), "slow": (10**9, 1.0)}, [["fast", "slow"]])
    z = [0] * 10
    profile = make_profile([1.0] * 10, {"fast": 4.0, "slow": 1.0}, z, z, [50] * 10, z, z)
    part = partition(LayerTable(profile, cluster.device_types), slots_of(cluster), cluster, 1)
    n = {sl.device_type: st_.stop - st_.start for st_, sl in zip(part.stages, part.stage_devs)}
    assert n == {"fast": 2, "slow": 8}
    assert all(s.memory <= sl.memory_bytes for s, sl in zip(part.stages, part.stage_devs))


def test_infeasible_names_device_and_bytes():
    cluster = make_cluster({"a": (100, 1.0)}, [["a", "a"]])
    z = [0] * 4
    profile = make_profile([1.0] * 4, {"a": 1.0}, z, z, [40] * 4, z, z)
    # two layers of 40 parameter bytes, each counted 6 times (see test_memory_moves_layers_off_a_small_device)
    with pytest.raises(ValueError, match=r"on n0\.g[01] \(a\), needing 480 bytes of its 100 bytes"):
        partition(LayerTable(profile, cluster.device_types), slots_of(cluster), cluster, 1)


def test_recompute_fits_what_stashing_cannot():
    cluster = make_cluster({"a": (1000, 1.0)}, [["a", "a"]])
    L = 2
    profile = make_profile([1.0] * L, {"a": 1.0}, [10] * L, [600] * L, [0] * L, [0] * L, [0] * L, input_bytes=10)
    table = LayerTable(profile, cluster.device_types)
    with pytest.raises(ValueError, match="fits memory"):
        partition(table, slots_of(cluster), cluster, 2)
    part = partition(table, slots_of(cluster), cluster, 2, recompute="fit")
    first = part.stages[0]
    assert first.recompute and first.memory <= 1000
    assert first.bwd == pytest.approx(first.fwd * 3)      # backward 2x forward + recomputed forward
    assert not part.stages[-1].recompute                  # the last stage stashes one minibatch: fits


def test_coarse_blocks_refined_match_full_dp():
    import random
    rng = random.Random(3)
    L = 600
    speeds = {"f": 3.0, "s": 1.0}
    cluster = make_cluster({"f": (10**12, 3.0), "s": (10**12, 1.0)}, [["f", "f"], ["s", "s"]])
    profile = make_profile([rng.uniform(0.1, 1) for _ in range(L)], speeds, *[[0] * L] * 5)
    table = LayerTable(profile, cluster.device_types)
    stage_devs = slots_of(cluster)
    coarse = partition(table, stage_devs, cluster, 2, coarse_above=256, num_blocks=64)
    exact = partition(table, stage_devs, cluster, 2, coarse_above=10**6)
    assert coarse.bottleneck <= exact.bottleneck * 1.001


def test_too_few_layers_for_the_devices():
    cluster = make_cluster({"a": (100, 1.0)}, [["a", "a", "a"]])
    z = [0] * 2
    profile = make_profile([1.0] * 2, {"a": 1.0}, z, z, z, z, z)
    with pytest.raises(ValueError, match="3 devices need at least 3 layers"):
        partition(LayerTable(profile, cluster.device_types), slots_of(cluster), cluster, 1)


def test_consecutive_stages_share_a_node_when_transfers_dominate():
    # two nodes of two identical devices, huge activations: the order crosses the network once
    cluster = make_cluster({"a": (10**12, 1.0)}, [["a", "a"], ["a", "a"]], intra=(1e6, 0.0), inter=(1e2, 0.0))
    L = 8
    profile = make_profile([1.0] * L, {"a": 1.0}, [100] * L, *[[0] * L] * 4)
    part = partition(LayerTable(profile, cluster.device_types), slots_of(cluster), cluster, 1)
    nodes = [s.node for s in part.stage_devs]
    assert sum(x != y for x, y in zip(nodes, nodes[1:])) == 1
    assert links_of(part.stage_devs, cluster)


def test_workspace_range_maxima_dense_and_sparse():
    import numpy as np
    from hetpipe.plan import stage_cost
    rng = np.random.default_rng(0)
    for n in (7, stage_cost.DENSE_MAX + 90):
        ws = rng.integers(0, 1000, n)
        prof = ModelProfile("m", 1, [LayerProfile(f"l{i}", {"a": 1.0}, {"a": 1.0}, workspace_bytes=int(ws[i]))
                                     for i in range(n)])
        tab = LayerTable(prof, ["a"])
        a = np.arange(n)[:, None]
        b = np.arange(1, n + 1)[None, :]
        got = tab.ws_max(a, np.maximum(b, a + 1))
        for i in range(0, n, 5):
            for j in range(i + 1, n + 1, 7):
                assert got[i, j - 1] == ws[i:j].max()


def test_stash_count_follows_the_schedule_warmup():
    # stage k stashes as many minibatches as the HetPipe schedule runs forwards ahead of backwards
    from hetpipe.plan.stage_cost import LinkCost
    from hetpipe.schedule.generators import warmup
    prof = make_profile([1.0] * 6, {"a": 1.0}, [0] * 6, [100] * 6, [0] * 6, [0] * 6, [0] * 6)
    tab = LayerTable(prof, ["a"])
    stage_dev = StageDevice("d", "a", "n", 10**9)
    link = LinkCost(1e9, 0.0)
    for K in (1, 3, 6):
        for nm in (1, 2, 5, 8):
            for k in range(K):
                _, mem = tab.stage(stage_dev, k, K, nm, 0, 2, link if k else None, link if k < K - 1 else None, False)
                assert mem == warmup(k, K, nm) * 200


def test_partition_accepts_a_profile_and_device_ids():
    from hetpipe.plan.cluster import load_cluster
    from hetpipe.plan.profile import load_profile
    tb = load_cluster("hetpipe-testbed")
    part = partition(load_profile("vgg19"), ["n0.g0", "n2.g0"], tb, 2)
    n = {s.device_type: st_.stop - st_.start for st_, s in zip(part.stages, part.stage_devs)}
    assert set(n) == {"titan_v", "rtx2060"} and sum(n.values()) == 19
    with pytest.raises(ValueError, match="unknown device 'n9.g0'"):
        partition(load_profile("vgg19"), ["n9.g0"], tb, 1)


def test_partition_checks_d_against_its_table():
    cluster = make_cluster({"a": (10**9, 1.0)}, [["a"]])
    prof = make_profile([1.0], {"a": 1.0}, [0], [0], [10], [0], [0])
    assert partition(prof, slots_of(cluster), cluster, 1, d=2).stages[0].memory == (2 + 2 + 4) * 10
    with pytest.raises(ValueError, match="d=1 but the LayerTable was built for d=0"):
        partition(LayerTable(prof, ["a"]), slots_of(cluster), cluster, 1, d=1)
