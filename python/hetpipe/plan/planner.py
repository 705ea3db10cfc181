"""make_plan: form VWs, partition each, choose Nm, place PS shards, predict throughput.

For each policy (NP, ED, HD, or all three for ``auto``) and each candidate Nm (the given one, else
1 .. ``max_nm``, default twice the largest VW size: past the VW size no stage stashes more, and with
D = 0 a longer wave only amortises the pipeline's fill and drain further), every
distinct VW is partitioned (VWs with the same device types on the same node pattern share one
solution), layers are placed on PS shards, and the cost model predicts the cluster's throughput.
The best plan by ``objective`` wins: ``throughput`` (ties: smaller Nm, less staleness), Hippie's
``memory_efficiency`` (:mod:`hetpipe.plan.recompute`), or ``time-to-accuracy``: the largest goodput, also
over one-device VWs, one VW over every device and the cluster without its slowest devices
(:mod:`hetpipe.plan.time_to_accuracy`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hetpipe.plan import cost as cost_model
from hetpipe.plan.cluster import ClusterSpec, load_cluster
from hetpipe.plan.formation import POLICIES, default_vw_size, form_virtual_workers
from hetpipe.plan.partition import Partition, partition
from hetpipe.plan.placement import place_layers
from hetpipe.plan.precision import check_precision, speed_precision, wire_factor
from hetpipe.plan.profile import ModelProfile, load_profile
from hetpipe.plan.recompute import memory_efficiency, single_device_throughput
from hetpipe.plan.stage_cost import LayerTable, StageDevice
from hetpipe.plan.types import MAX_NM, Plan, StagePlan, VirtualWorkerPlan, check_integer
from hetpipe.plan.waves import check_wave_rule, with_waves

TIME_TO_ACCURACY = "time-to-accuracy"
OBJECTIVES = ("throughput", "memory_efficiency", TIME_TO_ACCURACY)


@dataclass
class _Candidate:
    policy: str
    nm: int
    mode: str
    parts: List[Partition]
    shards: tuple
    wave_times: List[float]
    throughput: float
    memory: int
    score: float
    # VWs that fit nowhere: (VW, why, the stage devices the reason names, the VW's canonical stage devices)
    left_out: List[Tuple[List[StageDevice], str, List[StageDevice], List[StageDevice]]]


def _canonical(stage_devs: Sequence[StageDevice]) -> Tuple[List[StageDevice], tuple]:
    """Slots sorted so that VWs of equal structure line up, and the structure key."""
    groups: Dict[str, List[StageDevice]] = {}
    for s in stage_devs:
        groups.setdefault(s.node, []).append(s)
    units = [sorted(g, key=lambda s: (s.device_type, s.memory_bytes, s.device)) for g in groups.values()]
    units.sort(key=lambda u: tuple((s.device_type, s.memory_bytes) for s in u))
    key = tuple(tuple((s.device_type, s.memory_bytes) for s in u) for u in units)
    return [s for u in units for s in u], key


def _relabel(part: Partition, src: Sequence[StageDevice], dst: Sequence[StageDevice]) -> Partition:
    m = {a.device: b for a, b in zip(src, dst)}
    return replace(part, stage_devs=tuple(m[s.device] for s in part.stage_devs))


def _rename(text: str, src: Sequence[StageDevice], dst: Sequence[StageDevice]) -> str:
    """``text`` about the devices of ``src`` retold about those of ``dst`` (same structure)."""
    m = {a.device: b.device for a, b in zip(src, dst)}
    pattern = "|".join(re.escape(d) for d in sorted(m, key=len, reverse=True))
    return re.sub(rf"(?<![\w.-])({pattern})(?![\w-])", lambda g: m[g.group(1)], text)


def check_fits_cluster(table: LayerTable, cluster: ClusterSpec, profile: ModelProfile) -> None:
    """Errors for a model whose state exceeds the cluster, or a layer that fits no device."""
    state = table.min_model_bytes()
    total = sum(cluster.device_types[d.type].memory_bytes for d in cluster.devices)
    if state > total:
        raise ValueError(f"model {profile.name!r} needs at least {state} bytes of weights, gradients, optimizer "
                         f"state, weight stashes and wave deltas (D = {table.d}), more than the whole cluster "
                         f"{cluster.name!r} has ({total} bytes)")
    big = max(cluster.devices, key=lambda d: cluster.device_types[d.type].memory_bytes)
    cap = cluster.device_types[big.type].memory_bytes
    for i, layer in enumerate(profile.layers):
        need = table.min_layer_bytes(i)
        if need > cap:
            raise ValueError(f"layer {i} ({layer.name!r}) needs {need} bytes (weights, gradients, optimizer state, "
                             f"workspace, one minibatch's activations and weight stash with its gradient, "
                             f"{table.d + 2} wave deltas), more than any device: the largest, "
                             f"{big.id} ({big.type}), has {cap} bytes")


def _stage_nodes(part: Partition) -> List[Tuple[int, int, str]]:
    return [(st.start, st.stop, sl.node) for st, sl in zip(part.stages, part.stage_devs)]


def search(cluster: ClusterSpec, table: LayerTable, policies: Sequence[str], vw_size: Optional[int],
           score: Callable[[float, int, List[int], int], float], *, nm: Optional[int], d: int, modes: Sequence[str],
           exhaustive_max: int, max_nm: Optional[int], horizon: Optional[int], num_ps_shards: Optional[int],
           ps_nodes: Optional[Sequence[str]]) -> Dict[str, Any]:
    """Per policy, in order: the best candidate over Nm and ``modes`` by ``score(throughput, memory, stage
    counts of the VWs, Nm)`` (ties: the first, smaller Nm), or why none fits (a string: the first VW's reason)."""
    by_id = {dv.id: dv for dv in cluster.devices}
    nodes = cluster.nodes
    all_nodes = list(nodes) + [n for n in dict.fromkeys(ps_nodes or ()) if n not in nodes]
    pb = [float(x) for x in table.param_bytes]
    found: Dict[str, Any] = {}
    for pol in policies:
        vws = form_virtual_workers(cluster, pol, vw_size)
        stage_devs = [[StageDevice(i, by_id[i].type, by_id[i].node, cluster.device_types[by_id[i].type].memory_bytes)
                  for i in vw] for vw in vws]
        canon = [_canonical(s) for s in stage_devs]
        kmax = max(len(s) for s in stage_devs)
        nms = [nm] if nm is not None else list(range(1, (max_nm or 2 * kmax) + 1))
        cache: Dict[Any, Tuple[List[StageDevice], Partition]] = {}
        relaxed: Dict[Any, Partition] = {}
        pol_best: Optional[_Candidate] = None
        error: Optional[str] = None
        for mode in modes:
            for m in nms:
                parts = []
                left_out: List[Tuple[List[StageDevice], str, List[StageDevice], List[StageDevice]]] = []
                for (cs, key), vw in zip(canon, stage_devs):
                    try:
                        if (key, mode) not in relaxed:
                            relaxed[(key, mode)] = partition(table, cs, cluster, m, recompute=mode,
                                                             exhaustive_max=exhaustive_max, ignore_memory=True)
                        if (key, m, mode) not in cache:
                            cache[(key, m, mode)] = (cs, partition(table, cs, cluster, m, recompute=mode,
                                                                   exhaustive_max=exhaustive_max,
                                                                   relaxed=relaxed[(key, mode)]))
                    except ValueError as e:
                        # this VW fits nowhere: leave its devices out rather than fail the policy
                        cache[(key, m, mode)] = (cs, str(e))
                    src, part = cache[(key, m, mode)]
                    if isinstance(part, str):
                        left_out.append((vw, part, src, cs))
                    else:
                        parts.append(_relabel(part, src, cs))
                if not parts:
                    error = error or _rename(*left_out[0][1:])
                    continue
                stage_nodes = [_stage_nodes(p) for p in parts]
                # shards go to the nodes the VWs use (all of them unless a VW was left out)
                used = {n for sn in stage_nodes for _, _, n in sn}
                shards = place_layers(pb, [n for n in nodes if n in used], stage_nodes, num_ps_shards, ps_nodes)
                waves = [cost_model.vw_wave_time(p.bottleneck, p.round_trip,
                                                 cost_model.vw_sync_time(sn, pb, shards, cluster.node_link), m, d,
                                                 len(p.stages))
                         for p, sn in zip(parts, stage_nodes)]
                period = max(cost_model.shard_times(stage_nodes, pb, shards, all_nodes,
                                                    cluster.inter_node.bandwidth), default=0.0)
                thr = cost_model.cluster_throughput(waves, m, d, period, horizon)
                mem = sum(st.memory for p in parts for st in p.stages)
                value = score(thr, mem, [len(p.stages) for p in parts], m)
                cand = _Candidate(pol, m, mode, parts, shards, waves, thr, mem, value, left_out)
                if pol_best is None or cand.score > pol_best.score * (1 + 1e-9):
                    pol_best = cand
        found[pol] = pol_best if pol_best is not None else error
    return found


def make_plan(cluster: Any, profile: Any, policy: str = "auto", nm: Optional[int] = None, d: int = 0,
              minibatch_size: Optional[int] = None, num_ps_shards: Optional[int] = None, recompute: Any = False,
              *, vw_size: Optional[int] = None, objective: str = "throughput", horizon: Optional[int] = None,
              exhaustive_max: int = 8, derive_missing: bool = False, max_nm: Optional[int] = None,
              precision: str = "fp32", ps_nodes: Optional[Sequence[str]] = None, tf32: bool = False,
              noise_scale: Optional[float] = None, base_batch: Optional[float] = None,
              waves: str = "equal", staleness_costs: Any = None) -> Plan:
    """The HetPipe plan for ``profile`` (a ModelProfile, preset name or path) on ``cluster`` (a
    ClusterSpec, preset name, path or dict).

    policy: NP, ED, HD or auto. nm: minibatches in flight per VW (None: chosen). d: staleness bound.
    recompute: False / "none", True / "fit", or "all" (see :mod:`hetpipe.plan.recompute`).
    derive_missing: derive device types the profile lacks by speed ratio instead of failing.
    max_nm: the largest Nm tried when ``nm`` is None (default: twice the largest VW).
    exhaustive_max: VWs of at most this many devices are searched over every distinct device order
    (:func:`hetpipe.plan.partition.partition`); ``meta["search"]`` says, per VW, whether the
    partition is exact or how far from optimal it can be.
    A VW that fits nowhere is left out (``meta["left_out"]``: its devices and why, in bytes).
    precision: "fp32", "bf16" or "fp16"; under a half type float32 activations and their gradients
    cross stages in it, so the transfers cost half the profiled bytes (``meta["wire_factor"]``), and
    device speeds are those of the precision (:meth:`hetpipe.plan.cluster.ClusterSpec.at_precision`);
    the profile's times are used as given (measure or model them at the run's precision).
    tf32: an fp32 run whose float32 matmuls may use TF32 tensor cores: device speeds are those of
    their TF32 peak (:func:`hetpipe.plan.precision.speed_precision`).
    ps_nodes: the node of each PS shard, when the shards' ranks are already placed (discovery's PS
    slots); a node may be a host without devices. Excludes ``num_ps_shards``.
    objective: "throughput" (default), "memory_efficiency" (Hippie's, with ``recompute``) or
    "time-to-accuracy": the plan whose predicted time to a target accuracy is shortest, i.e. the largest
    *goodput* = predicted samples/s x the statistical efficiency of its batch per update
    (:mod:`hetpipe.plan.time_to_accuracy`). Its candidates are every ``policy`` (under auto: NP, ED, HD
    and DP, one-device VWs over the devices that hold the whole model, and PP, one VW over every device)
    on the whole cluster and on the cluster without its slowest devices, one more left out at a time; a
    candidate that does not fit is skipped with its reason. The batch per update of a plan of ``N`` VWs is
    ``N x minibatch_size`` samples, under either aggregate (the VWs' gradients of one wave are taken on the
    same global weights; the aggregate scales the step, not the noise). ``meta["time_to_accuracy"]`` lists
    every candidate with its devices, VWs, predicted throughput, batch per update, efficiency, goodput and
    time to target relative to the best. noise_scale: the gradient noise scale ``B_noise`` in samples
    (required; :func:`hetpipe.run.pilot.measure_noise_scale` measures it); base_batch: the batch whose
    per-sample progress is the unit (default ``minibatch_size``). staleness_costs: also price the samples a
    candidate's own staleness and averaging cost (:func:`hetpipe.plan.efficiency.sample_cost`; ``d`` is
    the run's bound): "none" (default: Pollux's efficiency alone, optimistic for wide and deep plans),
    "fitted" (coefficients fitted on hetpipe's convergence benchmark) or a
    :class:`~hetpipe.plan.efficiency.StalenessCosts`.
    waves: "equal" (HetPipe's: every VW trains Nm minibatches per wave) or "speed" (a VW's wave
    proportional to its predicted speed, :mod:`hetpipe.plan.waves`), applied to the chosen plan.
    Raises ValueError naming the device, layer and bytes when nothing fits.
    """
    # Device speeds (VW formation, device orders, derived types) are those of the run's precision.
    cluster = load_cluster(cluster).at_precision(speed_precision(check_precision(precision, "make_plan"), tf32))
    profile = load_profile(profile)
    for name, value, lo, hi in (("d", d, 0, None), ("nm", nm, 1, MAX_NM), ("max_nm", max_nm, 1, MAX_NM),
                                ("horizon", horizon, 1, None), ("minibatch_size", minibatch_size, 0, None)):
        check_integer("make_plan", name, value, lo, hi)
    check_integer("make_plan", "num_ps_shards", num_ps_shards, 1, profile.num_layers,
                  f"a shard owns whole layers and the model has {profile.num_layers}")
    check_integer("make_plan", "vw_size", vw_size, 1, profile.num_layers,
                  f"every stage needs a layer and the model has {profile.num_layers}")
    if ps_nodes is not None:
        ps_nodes = [str(n) for n in ps_nodes]
        if num_ps_shards is not None and num_ps_shards != len(ps_nodes):
            raise ValueError(f"make_plan: num_ps_shards={num_ps_shards} but ps_nodes names {len(ps_nodes)} shards")
        if not ps_nodes:
            ps_nodes = None
    given_vw_size = vw_size
    if vw_size is None and default_vw_size(cluster) > profile.num_layers:
        vw_size = profile.num_layers     # nodes with more devices than layers: VWs of one stage per layer
    check_wave_rule("make_plan", waves)
    if objective not in OBJECTIVES:
        raise ValueError(f"make_plan: unknown objective {objective!r} (known: {', '.join(OBJECTIVES)})")
    if objective == TIME_TO_ACCURACY:
        from hetpipe.plan.efficiency import staleness_costs as staleness_costs_of
        from hetpipe.plan.time_to_accuracy import check_statistics

        check_statistics("make_plan", noise_scale, base_batch,
                         minibatch_size if minibatch_size is not None else profile.minibatch_size)
        costs = staleness_costs_of("none" if staleness_costs is None else staleness_costs)
    elif noise_scale is not None or base_batch is not None or staleness_costs is not None:
        raise ValueError(f"make_plan: noise_scale, base_batch and staleness_costs are for "
                         f"objective={TIME_TO_ACCURACY!r}, not {objective!r}")
    used_types = sorted({dv.type for dv in cluster.devices})
    if derive_missing:
        profile = profile.derive_types({t: cluster.device_types[t].speed for t in used_types})
    table = LayerTable(profile, used_types, d, wire_factor(check_precision(precision, "make_plan"),
                                                          profile.activation_dtype))
    check_fits_cluster(table, cluster, profile)
    if not isinstance(policy, str):
        raise ValueError(f"make_plan: policy must be one of {', '.join(POLICIES)} or auto, got {policy!r}")
    if policy.lower() == "auto":
        policies = list(POLICIES)
    elif policy.upper() in POLICIES:
        policies = [policy.upper()]
    else:
        raise ValueError(f"make_plan: unknown policy {policy!r} (known: {', '.join(POLICIES)}, auto)")
    if recompute is True or recompute == "fit":
        modes = ["fit"]
    elif recompute is False or recompute is None or recompute == "none":
        modes = ["none"]
    elif recompute == "all":
        modes = ["all"]
    else:
        raise ValueError(f"make_plan: recompute must be a bool, 'none', 'fit' or 'all', got {recompute!r}")
    if objective == "memory_efficiency" and recompute is not False:
        modes = ["none", "fit", "all"]

    single = single_device_throughput(table, used_types)
    if objective == TIME_TO_ACCURACY:
        from hetpipe.plan.time_to_accuracy import plan_for_time_to_accuracy

        return with_waves(plan_for_time_to_accuracy(
            cluster, table, profile, policies, given_vw_size, noise_scale, base_batch,
            minibatch_size if minibatch_size is not None else profile.minibatch_size,
            dict(nm=nm, d=d, modes=modes, exhaustive_max=exhaustive_max, max_nm=max_nm, horizon=horizon,
                 num_ps_shards=num_ps_shards, ps_nodes=ps_nodes),
            lambda best, sub, outcomes, extra: _to_plan(best, table, sub, profile, d, minibatch_size, objective,
                                                        outcomes, precision, extra), waves, costs), waves)

    def score(thr: float, mem: int, stage_counts: List[int], m: int) -> float:
        return thr if objective == "throughput" else memory_efficiency(thr, single, mem)

    found = search(cluster, table, policies, vw_size, score, nm=nm, d=d, modes=modes, exhaustive_max=exhaustive_max,
                   max_nm=max_nm, horizon=horizon, num_ps_shards=num_ps_shards, ps_nodes=ps_nodes)
    best: Optional[_Candidate] = None
    errors: Dict[str, str] = {}
    outcomes: Dict[str, Any] = {}
    for pol, pol_best in found.items():
        if isinstance(pol_best, str):
            errors[pol] = pol_best
            outcomes[pol] = "infeasible"
            continue
        outcomes[pol] = pol_best.throughput
        if best is None or pol_best.score > best.score * (1 + 1e-9):
            best = pol_best
    if best is None:
        detail = "; ".join(f"{p}: {e}" for p, e in errors.items())
        raise ValueError(f"make_plan: no plan of {profile.name!r} fits cluster {cluster.name!r}: {detail}")
    return with_waves(_to_plan(best, table, cluster, profile, d, minibatch_size, objective, outcomes, precision), waves)


def _to_plan(c: _Candidate, table: LayerTable, cluster: ClusterSpec, profile: ModelProfile, d: int,
             minibatch_size: Optional[int], objective: str, outcomes: Dict[str, Any], precision: str,
             extra: Optional[Dict[str, Any]] = None) -> Plan:
    vws = []
    for v, (part, wave) in enumerate(zip(c.parts, c.wave_times)):
        stages = tuple(
            StagePlan(device=sl.device, device_type=sl.device_type, start=st.start, stop=st.stop,
                      fwd_time=st.fwd, bwd_time=st.bwd, send_time=st.send, memory_bytes=st.memory,
                      memory_capacity=sl.memory_bytes,
                      recompute=st.recompute_layers)
            for st, sl in zip(part.stages, part.stage_devs))
        vws.append(VirtualWorkerPlan(v, stages, c.nm / wave if wave > 0 else 0.0))
    meta = {
        "cluster": cluster.name, "profile": profile.name, "emulated": cluster.emulated,
        "recompute_mode": c.mode, "objective": objective, "memory_bytes": int(c.memory),
        "bottleneck_s": [p.bottleneck for p in c.parts], "wave_time_s": list(c.wave_times),
        "policies": {k: v for k, v in outcomes.items()},
        "devices": "modelled" if not cluster.emulated else "emulated",
        "search": ["exact" if p.optimal else
                   f"bottleneck within {p.bottleneck / p.lower_bound:.3g}x of optimal" if p.lower_bound > 0 else
                   "heuristic" for p in c.parts],
        "wire_factor": table.wire_factor,
    }
    if c.left_out:
        meta["left_out"] = [{"devices": [s.device for s in vw], "reason": _rename(why, src, dst)}
                            for vw, why, src, dst in c.left_out]
    meta.update(extra or {})
    return Plan(num_layers=table.num_layers, nm=c.nm, d=d, policy=c.policy, virtual_workers=tuple(vws),
                ps_shards=c.shards, throughput=c.throughput,
                minibatch_size=minibatch_size if minibatch_size is not None else profile.minibatch_size,
                layer_names=profile.layer_names, meta=meta, precision=precision)
