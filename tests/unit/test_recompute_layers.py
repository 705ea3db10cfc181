"""Per-layer recomputation in mode ``fit``: the layers chosen fit the device at the least
recomputation time, against a brute force over every subset written from the memory formula."""

import itertools
import random

import pytest

from hetpipe.plan import recompute
from hetpipe.plan.partition import partition
from hetpipe.plan.recompute import choose_layers, recompute_cost
from hetpipe.plan.stage_cost import LayerTable, LinkCost
from test_partition import make_cluster, make_profile, slots_of


def random_stage(rng, m):
    times = [rng.uniform(0.1, 2.0) for _ in range(m)]
    act = [rng.randrange(1, 50) for _ in range(m)]
    stash = [rng.randrange(0, 400) for _ in range(m)]
    param = [rng.randrange(0, 20) for _ in range(m)]
    profile = make_profile(times, {"a": 1.0}, act, stash, param, [0] * m, [0] * m, input_bytes=rng.randrange(1, 50))
    return profile, LayerTable(profile, ["a"], d=rng.randrange(0, 3))


def brute_force(profile, table, n, cap_left, a, b):
    """Least extra forward time over subsets R of [a, b) whose memory fits; memory written out:
    n x stash of kept layers + stash of recomputed ones + n x the input of each run of R."""
    layers = profile.layers
    best = None
    for r in range(b - a + 1):
        for chosen in itertools.combinations(range(a, b), r):
            runs = [l for l in chosen if l - 1 not in chosen]
            mem = sum(layers[l].stash if l in chosen else n * layers[l].stash for l in range(a, b))
            mem += sum(n * (profile.input_bytes if l == 0 else layers[l - 1].activation_bytes) for l in runs)
            if mem <= cap_left:
                extra = sum(layers[l].fwd_time["a"] for l in chosen)
                best = extra if best is None else min(best, extra)
    return best


def fixed_bytes(table, slot, k, K, nm, a, b, prev, nxt):
    """Memory of the stage apart from its activations: the no-recompute memory less n x stash."""
    _, m = table.stage(slot, k, K, nm, a, b, prev, nxt, recompute=False)
    n = min(nm, K - k)
    return m - n * (table.cum_stash[b] - table.cum_stash[a])


@pytest.mark.parametrize("seed", range(40))
def test_choice_is_the_cheapest_subset_that_fits(seed):
    rng = random.Random(seed)
    m = rng.randrange(1, 8)
    profile, table = random_stage(rng, m)
    K, k, nm = rng.randrange(1, 4), 0, rng.randrange(1, 5)
    k = rng.randrange(K)
    cluster = make_cluster({"a": (10**9, 1.0)}, [["a"]])
    prev = LinkCost(1e3, 0.01) if k > 0 else None
    nxt = LinkCost(1e3, 0.01) if k < K - 1 else None
    _, none_mem = table.stage(slots_of(cluster)[0], k, K, nm, 0, m, prev, nxt, recompute=False)
    _, all_mem = table.stage(slots_of(cluster)[0], k, K, nm, 0, m, prev, nxt, recompute=True)
    cap = rng.randrange(min(none_mem, all_mem) - 50, max(none_mem, all_mem) + 50)
    slot = slots_of(make_cluster({"a": (max(cap, 1), 1.0)}, [["a"]]))[0]
    got = choose_layers(table, slot, k, K, nm, 0, m, prev, nxt)
    n = min(nm, K - k)
    want = brute_force(profile, table, n, slot.memory_bytes - fixed_bytes(table, slot, k, K, nm, 0, m, prev, nxt),
                       0, m)
    if want is None:
        assert got is None
        return
    assert got is not None
    t, mem = recompute_cost(table, slot, k, K, nm, 0, m, prev, nxt, got)
    t0, _ = table.stage(slot, k, K, nm, 0, m, prev, nxt, recompute=False)
    assert mem <= slot.memory_bytes
    assert t - t0 == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("seed", range(10))
def test_cost_of_none_and_all_is_the_stage_model(seed):
    rng = random.Random(100 + seed)
    m = rng.randrange(1, 9)
    _, table = random_stage(rng, m)
    slot = slots_of(make_cluster({"a": (10**9, 1.0)}, [["a"]]))[0]
    K, nm = 3, rng.randrange(1, 5)
    for k in range(K):
        prev = LinkCost(1e3, 0.01) if k > 0 else None
        nxt = LinkCost(1e3, 0.01) if k < K - 1 else None
        for layers, whole in (((), False), (tuple(range(m)), True)):
            t, mem = recompute_cost(table, slot, k, K, nm, 0, m, prev, nxt, layers)
            tw, mw = table.stage(slot, k, K, nm, 0, m, prev, nxt, recompute=whole)
            assert t == pytest.approx(tw) and mem == mw


@pytest.mark.parametrize("seed", range(15))
def test_efficiency_rule_fits_and_never_recomputes_more_time_than_the_whole_stage(seed, monkeypatch):
    rng = random.Random(200 + seed)
    m = rng.randrange(2, 9)
    profile, table = random_stage(rng, m)
    K, k, nm = 2, 0, 4
    nxt = LinkCost(1e3, 0.01)
    probe = slots_of(make_cluster({"a": (10**9, 1.0)}, [["a"]]))[0]
    _, none_mem = table.stage(probe, k, K, nm, 0, m, None, nxt, recompute=False)
    _, all_mem = table.stage(probe, k, K, nm, 0, m, None, nxt, recompute=True)
    if all_mem >= none_mem:
        return
    slot = slots_of(make_cluster({"a": ((all_mem + none_mem) // 2, 1.0)}, [["a"]]))[0]
    exact = choose_layers(table, slot, k, K, nm, 0, m, None, nxt)
    monkeypatch.setattr(recompute, "EXACT_MAX", 0)
    rule = choose_layers(table, slot, k, K, nm, 0, m, None, nxt)
    t_rule, mem_rule = recompute_cost(table, slot, k, K, nm, 0, m, None, nxt, rule)
    t_exact, _ = recompute_cost(table, slot, k, K, nm, 0, m, None, nxt, exact)
    t_all, _ = table.stage(slot, k, K, nm, 0, m, None, nxt, recompute=True)
    assert mem_rule <= slot.memory_bytes
    assert t_exact - 1e-9 <= t_rule <= t_all + 1e-9


def test_partition_recomputes_only_the_layer_memory_requires():
    # two devices, 2 minibatches in flight at stage 0; layer 1 stashes 500 bytes per minibatch, the
    # others 10. The best split is [0, 2) | [2, 5) and stage 0 fits 800 bytes only if layer 1 is
    # recomputed (2 x 510 = 1020 bytes kept otherwise); recomputing layer 0 as well buys nothing.
    # Without recomputation, layer 1 must sit alone-ish at the last stage, which is slower.
    cluster = make_cluster({"a": (800, 1.0)}, [["a", "a"]])
    stash = [10, 500, 10, 10, 10]
    profile = make_profile([1.0] * 5, {"a": 1.0}, [10] * 5, stash, [0] * 5, [0] * 5, [0] * 5, input_bytes=10)
    table = LayerTable(profile, cluster.device_types)
    plain = partition(table, slots_of(cluster), cluster, 2)     # [0, 1) | [1, 5): layer 1 at stage 1
    part = partition(table, slots_of(cluster), cluster, 2, recompute="fit")
    assert part.bottleneck < plain.bottleneck
    first, last = part.stages
    assert (first.start, first.stop) == (0, 2) and first.recompute_layers == (1,)
    assert first.memory <= 800 and not last.recompute
    assert first.bwd == pytest.approx(2 * 2.0 + 1.0)          # backward + layer 1's forward again
    whole = partition(table, slots_of(cluster), cluster, 2, recompute="all").stages[0]
    assert whole.recompute_layers == (0, 1) and first.time < whole.time
