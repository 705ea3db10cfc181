"""Planner benchmark: search time against model depth and cluster size, and partition quality.

Devices are modelled, not measured: every time below comes from layer profiles (analytic presets
or synthetic layers) and the devices' peak FLOP/s, through hetpipe.plan's stage model.

Table 1 — wall-clock seconds of ``make_plan(policy="auto")`` (all three formation policies, every
Nm, device-order search) for synthetic models of 50..2000 layers on clusters of 4..1024 GPUs
(nodes of 4 GPUs of one type, the four HetPipe testbed types in turn).

Table 2 — partition quality: for each VW of a plan, the predicted bottleneck (slowest stage's
compute + transfer) of a baseline split over the same device order, divided by ours (> 1: ours
is better). Baselines: (a) uniform layer counts; (b) balanced parameter counts (DeepSpeed's
default ``partition_method="parameters"``); (c) balanced time as if every device were identical
(torchgpipe's ``balance_by_time``, timed on the VW's first device type). A ``*`` marks a baseline
that would not fit memory. Reported: geometric mean and worst case over the VWs.

    python bench/planner.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import time
from typing import List, Sequence

import numpy as np

from hetpipe.plan import LayerTable, StageDevice, make_plan, partition
from hetpipe.plan.cluster import cluster_from_dict, load_cluster
from hetpipe.plan.partition import evaluate, links_of, partition_order
from hetpipe.plan.profile import LayerProfile, ModelProfile, load_profile

TESTBED_TYPES = {"titan_v": (12, 14.9e12), "titan_rtx": (24, 16.3e12), "rtx2060": (6, 6.45e12),
                 "quadro_p4000": (8, 5.3e12)}


def synthetic_profile(layers: int, types, seed: int = 0) -> ModelProfile:
    """A model of mixed layers with lognormal compute, parameters and activations; whatever the depth
    it has about 200M parameters and 4 TFLOP per minibatch in all (deeper models, smaller layers)."""
    rng = random.Random(seed)
    out = []
    for i in range(layers):
        flops = 4e12 / layers * rng.lognormvariate(0, 0.6)
        params = int(4 * 2e8 / layers * rng.lognormvariate(0, 1.0))
        act = int(4 * 32 * 4e7 / layers * rng.lognormvariate(0, 0.5))
        f = {t: flops / (peak * 0.5) for t, (_, peak) in types.items()}
        out.append(LayerProfile(f"l{i}", f, {t: 2 * v for t, v in f.items()}, activation_bytes=act,
                                param_bytes=params, optimizer_bytes=params, workspace_bytes=act, stash_bytes=2 * act))
    return ModelProfile(f"synthetic-{layers}", 32, out)


def scaled_cluster(devices: int, types=TESTBED_TYPES, per_node: int = 4) -> dict:
    names = list(types)
    nodes = [{"name": f"n{i}", "type": names[i % len(names)], "count": min(per_node, devices - i * per_node)}
             for i in range(math.ceil(devices / per_node))]
    return {"name": f"scaled-{devices}",
            "device_types": {t: {"memory_bytes": gb * 2**30, "peak_flops": p} for t, (gb, p) in types.items()},
            "nodes": nodes, "intra_node": {"bandwidth": 15.75e9, "latency": 1e-5},
            "inter_node": {"bandwidth": 7e9, "latency": 5e-6}}


def table(head: Sequence[str], rows: List[Sequence[str]]) -> str:
    width = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(head, width)),
             "-|-".join("-" * w for w in width)]
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(r, width)) for r in rows]
    return "\n".join(lines)


def search_time(layer_counts, device_counts) -> str:
    rows = []
    for n_dev in device_counts:
        cluster = cluster_from_dict(scaled_cluster(n_dev))
        row = [str(n_dev)]
        for n_layers in layer_counts:
            prof = synthetic_profile(n_layers, TESTBED_TYPES)
            t0 = time.perf_counter()
            try:
                make_plan(cluster, prof)
                row.append(f"{time.perf_counter() - t0:.2f}")
            except ValueError:
                row.append(f"{time.perf_counter() - t0:.2f} (infeasible)")
        rows.append(row)
    return table(["devices \\ layers"] + [str(x) for x in layer_counts], rows)


def balanced_cuts(weights: Sequence[float], k: int) -> List[int]:
    """Exact min-max contiguous split of ``weights`` into ``k`` non-empty parts (cut positions)."""
    w = np.asarray(weights, dtype=float)
    n = len(w)
    cum = np.concatenate([[0.0], np.cumsum(w)])
    f = np.full((k + 1, n + 1), np.inf)
    arg = np.zeros((k + 1, n + 1), dtype=int)
    f[0, 0] = 0.0
    for p in range(1, k + 1):
        for j in range(p, n - (k - p) + 1):
            i = np.arange(p - 1, j)
            v = np.maximum(f[p - 1, i], cum[j] - cum[i])
            m = int(np.argmin(v))
            f[p, j], arg[p, j] = v[m], i[m]
    cuts, j = [n], n
    for p in range(k, 0, -1):
        j = int(arg[p, j])
        cuts.append(j)
    return cuts[::-1]


def uniform_cuts(n: int, k: int) -> List[int]:
    return [round(i * n / k) for i in range(k + 1)]


def quality_rows(label: str, cluster, prof: ModelProfile, vws: List[List[StageDevice]], nm: int) -> list:
    types = sorted({s.device_type for vw in vws for s in vw})
    tab = LayerTable(prof, types)
    ratios = {"uniform": [], "params": [], "time-homog": []}
    oom = {k: 0 for k in ratios}
    ours_oom = 0
    for stage_devs in vws:
        try:
            ours = partition(tab, stage_devs, cluster, nm)
        except ValueError:
            ours_oom += 1
            continue
        order = list(ours.stage_devs)
        links = links_of(order, cluster)
        K = len(order)
        ref_t = [f + b for f, b in zip(prof.fwd(order[0].device_type), prof.bwd(order[0].device_type))]
        cuts = {"uniform": uniform_cuts(prof.num_layers, K),
                "params": balanced_cuts([x.param_bytes + 1e-9 for x in prof.layers], K),
                "time-homog": balanced_cuts(ref_t, K)}
        for name, b in cuts.items():
            base = evaluate(tab, order, links, nm, b, [False] * K)
            ratios[name].append(base.bottleneck / ours.bottleneck)
            if any(st.memory > sl.memory_bytes for st, sl in zip(base.stages, order)):
                oom[name] += 1
    cells = []
    for name in ratios:
        r = ratios[name]
        if not r:
            cells.append("-")
            continue
        gm = math.exp(sum(math.log(x) for x in r) / len(r))
        mark = f" ({oom[name]}/{len(r)} OOM)" if oom[name] else ""
        cells.append(f"{gm:.2f} / {max(r):.2f}{mark}")
    return [label, str(len(vws) - ours_oom)] + cells


def slots_for(cluster, ids) -> List[StageDevice]:
    return [StageDevice(d.id, d.type, d.node, cluster.device_types[d.type].memory_bytes)
            for d in (cluster.device(i) for i in ids)]


def random_cluster(rng: random.Random, n_types: int = 6) -> dict:
    types = {f"gpu{i}": (rng.choice([6, 8, 11, 12, 16, 24, 32, 48]), rng.uniform(4e12, 40e12))
             for i in range(n_types)}
    return scaled_cluster(32, types)


def quality(quick: bool) -> str:
    from hetpipe.plan.formation import form_virtual_workers

    rows = []
    tb = load_cluster("hetpipe-testbed")
    for model in ("resnet152", "vgg19", "gpt"):
        prof = load_profile(model)
        for pol in ("ED", "HD"):
            vws = [slots_for(tb, vw) for vw in form_virtual_workers(tb, pol)]
            nm = 2 if model == "gpt" else 4
            rows.append(quality_rows(f"testbed {pol} {model} (Nm={nm})", tb, prof, vws, nm))
    rng = random.Random(7)
    for trial in range(2 if quick else 5):
        spec = random_cluster(rng)
        cluster = cluster_from_dict(spec)
        types = {t: (v["memory_bytes"] // 2**30, v["peak_flops"]) for t, v in spec["device_types"].items()}
        prof = synthetic_profile(120, types, seed=trial)
        ids = [d.id for d in cluster.devices]
        vws = []
        for _ in range(6):
            k = rng.randint(3, 6)
            vws.append(slots_for(cluster, rng.sample(ids, k)))
        rows.append(quality_rows(f"random cluster {trial}: 120 layers, VWs of 3-6 random GPUs", cluster, prof, vws, 2))
    return table(["instance", "VWs", "(a) uniform: gmean / worst", "(b) params (DeepSpeed)",
                  "(c) time, homogeneous (torchgpipe)"], rows)


def distinct_orders(stage_devs: Sequence[StageDevice]):
    """Every order of ``stage_devs`` up to interchangeable devices (same type, memory and node)."""
    seen = set()
    for perm in itertools.permutations(stage_devs):
        sig = tuple((s.device_type, s.memory_bytes, s.node) for s in perm)
        if sig not in seen:
            seen.add(sig)
            yield list(perm)


def brute_orders(tab: LayerTable, stage_devs: Sequence[StageDevice], cluster, nm: int) -> float:
    """The reference: every distinct order, each solved by the exact fixed-order DP at layer
    granularity (no coarsening, no order search); +inf when nothing fits."""
    best = math.inf
    for order in distinct_orders(stage_devs):
        p = partition_order(tab, order, links_of(order, cluster), nm, coarse_above=10**9)
        if p is not None:
            best = min(best, p.bottleneck)
    return best


def tight_cluster(rng: random.Random, n_types: int, gb=(2, 3, 4, 6)) -> dict:
    types = {f"gpu{i}": (rng.choice(gb), rng.uniform(4e12, 40e12)) for i in range(n_types)}
    return scaled_cluster(32, types, per_node=4)


def vw_of(cluster, rng: random.Random, k: int, kinds: int) -> List[StageDevice]:
    """``k`` devices of at most ``kinds`` types (repeats allowed) from a few nodes."""
    types = rng.sample(sorted(cluster.device_types), kinds)
    pool = [d for d in cluster.devices if d.type in types]
    return slots_for(cluster, [d.id for d in rng.sample(pool, min(k, len(pool)))])


def timed(fn):
    t0 = time.perf_counter()
    try:
        out = fn()
    except ValueError:
        out = None
    return out, time.perf_counter() - t0


def order_search(quick: bool) -> str:
    """Table 3: VWs of 6-8 devices, tight memory; ours (exact order search) and the previous search
    (a few node-grouped orders, kept as the fallback beyond exact search) against brute force."""
    from hetpipe.plan.partition import _search_candidates

    rng = random.Random(11)
    rows = []
    cases = [(6, 3, 48), (6, 6, 48), (7, 4, 48), (8, 4, 32), (8, 8, 24)]
    for k, kinds, layers in cases:
        n_inst = 3 if quick else 8
        ours_t, base_t, brute_t, ours_r, base_r = [], [], [], [], []
        wrong = {"ours": 0, "previous": 0}
        brute_ok = 0
        for _ in range(n_inst):
            spec = tight_cluster(rng, 8, gb=(3, 4, 6, 8))
            cluster = cluster_from_dict(spec)
            types = {t: (v["memory_bytes"] // 2**30, v["peak_flops"]) for t, v in spec["device_types"].items()}
            prof = synthetic_profile(layers, types, seed=rng.randrange(1000))
            stage_devs = vw_of(cluster, rng, k, kinds)
            tab = LayerTable(prof, {s.device_type for s in stage_devs})
            nm = rng.randint(1, 4)
            ours, t = timed(lambda: partition(tab, stage_devs, cluster, nm))
            ours_t.append(t)
            base, t = timed(lambda: _search_candidates(tab, stage_devs, cluster, nm, "none", 5, 256, 128, False))
            base_t.append(t)
            n_orders = sum(1 for _ in distinct_orders(stage_devs))
            if n_orders > (3000 if quick else 50000):
                continue
            ref, t = timed(lambda: brute_orders(tab, stage_devs, cluster, nm))
            brute_t.append(t)
            brute_ok += 1
            if ref == math.inf:
                continue
            for name, got, acc in (("ours", ours, ours_r), ("previous", base, base_r)):
                if got is None:
                    wrong[name] += 1
                else:
                    acc.append(got.bottleneck / ref)
        def ratio(r):
            return f"{max(r):.3f}" if r else "-"
        rows.append([f"{k} devices, {kinds} types, {layers} layers", str(n_inst),
                     f"{np.mean(ours_t):.2f} / {max(ours_t):.2f}",
                     f"{np.mean(base_t):.2f}", f"{np.mean(brute_t):.2f} ({brute_ok})" if brute_t else "- (too many orders)",
                     ratio(ours_r) + (f", {wrong['ours']} wrongly infeasible" if wrong["ours"] else ""),
                     ratio(base_r) + (f", {wrong['previous']} wrongly infeasible" if wrong["previous"] else "")])
    return table(["VW", "instances", "ours s: mean / max", "previous s", "brute force s (instances)",
                  "ours / brute: worst", "previous / brute: worst"], rows)


def deep(quick: bool) -> str:
    """Table 4: deep models, tight memory: ours against every order x the exact layer-granularity DP."""
    rng = random.Random(5)
    rows = []
    for layers, k, gb in ([(500, 2, (8, 12, 16)), (1000, 4, (4, 6, 8))] if quick else
                          [(500, 2, (8, 12, 16)), (1000, 2, (8, 12, 16)), (1000, 4, (4, 6, 8)),
                           (2000, 4, (4, 6, 8))]):
        n_inst = 3 if quick else 6
        ours_t, brute_t, ratios, wrong = [], [], [], 0
        for _ in range(n_inst):
            spec = tight_cluster(rng, 4, gb=gb)
            cluster = cluster_from_dict(spec)
            types = {t: (v["memory_bytes"] // 2**30, v["peak_flops"]) for t, v in spec["device_types"].items()}
            prof = synthetic_profile(layers, types, seed=rng.randrange(1000))
            stage_devs = vw_of(cluster, rng, k, k)
            tab = LayerTable(prof, {s.device_type for s in stage_devs})
            ours, t = timed(lambda: partition(tab, stage_devs, cluster, 2))
            ours_t.append(t)
            ref, t = timed(lambda: brute_orders(tab, stage_devs, cluster, 2))
            brute_t.append(t)
            if ref < math.inf:
                if ours is None:
                    wrong += 1
                else:
                    ratios.append(ours.bottleneck / ref)
        rows.append([f"{layers} layers, {k} devices", str(n_inst), f"{np.mean(ours_t):.2f} / {max(ours_t):.2f}",
                     f"{np.mean(brute_t):.2f}", f"{len(ratios) + wrong}",
                     (f"{max(ratios):.4f}" if ratios else "-") + (f", {wrong} wrongly infeasible" if wrong else "")])
    return table(["model x VW", "instances", "ours s: mean / max", "brute force s", "feasible",
                  "ours / brute: worst"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and trials")
    args = ap.parse_args()
    layers = [50, 200, 2000] if args.quick else [50, 200, 500, 2000]
    devices = [4, 16, 1024] if args.quick else [4, 16, 64, 256, 1024]
    print("Devices are modelled from layer profiles and peak FLOP/s, not measured.\n")
    print("Table 1: make_plan(policy='auto') search time, seconds")
    print(search_time(layers, devices))
    print("\nTable 2: baseline bottleneck / our bottleneck, same device order (>1: ours is better)")
    print(quality(args.quick))
    print("\nTable 3: VWs of 6-8 devices, tight memory: bottleneck / brute force (every distinct order x "
          "exact DP), 1.000 is optimal; 'previous': a few node-grouped orders (the search beyond 8 devices)")
    print(order_search(args.quick))
    print("\nTable 4: deep models, tight memory: bottleneck / brute force (every distinct order x exact DP "
          "at layer granularity)")
    print(deep(args.quick))


if __name__ == "__main__":
    main()
