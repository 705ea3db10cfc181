"""Planning for time to accuracy: the plan whose predicted time to a target is shortest, by goodput.

Throughput counts every sample alike; a sample is worth less in a larger batch per update
(:mod:`hetpipe.plan.efficiency`: Pollux's efficiency ``E(M) = (B_noise + M0) / (B_noise + M)`` of a batch of
``M`` samples per update against a base batch ``M0``, from the gradient noise scale ``B_noise``). The time
a plan needs to reach a target is predicted as ``samples_to_target(M0) / (throughput x E(M))``, so the plan
to run is the one of the largest *goodput* ``throughput x E(M)`` (samples/s); the time of every other plan
relative to it is the ratio of their goodputs (the unknown ``samples_to_target(M0)`` cancels).

**The batch per update of a plan** of ``N`` VWs with minibatches of ``b`` samples is ``M = N x b``
(:func:`batch_per_update`), whatever the PS's aggregate:

* ``aggregate="mean"``: a wave moves the global weights by the average of the VWs' wave deltas. To first
  order in the learning rate each VW's delta is ``-lr`` times the sum of its ``Nm`` minibatch gradients,
  so the average is ``Nm`` steps each along the mean of ``N`` minibatch gradients taken on the same global
  weights: ``Nm`` steps of a batch of ``N x b``. A VW's own ``Nm`` steps stay sequential, which is why
  ``Nm`` does not enlarge the batch.
* ``aggregate="sum"``: the deltas are added, so a wave moves the weights ``N`` times as far, but along the
  same direction: to first order the sum is the mean with an ``N`` times larger learning rate. The ``N``
  VWs' steps of one wave are taken on the same global weights (each VW sees only its own until the wave
  is applied), not one after another, so their noise averages as one batch of ``N x b``; what the sum
  adds is a larger step, which pays only while the batch is below the noise scale (the linear scaling
  rule), the regime where ``E`` is near 1 anyway. Counting the sum's steps as ``N`` sequential steps of
  ``b`` samples would predict that more VWs never cost progress per sample, which fails exactly when
  ``N x b`` passes ``B_noise``: the ``N`` equal steps overshoot together.

Limits: the model is first order over a wave (the VWs' local trajectories stay close to the global
weights); by default it ignores staleness (a VW's forward sees up to ``Nm - 1`` of its own updates late,
and with ``D >= 1`` the other VWs' waves arrive up to ``D`` waves late) and the drift of local steps between
synchronisations, both of which cost progress per sample on top of ``E``, more for wider and staler
plans. ``staleness`` prices them as a factor on the samples a candidate needs
(:func:`hetpipe.plan.efficiency.sample_cost`, its coefficients empirical: "fitted" were fitted on hetpipe's
convergence benchmark and cut the error of the predicted samples on the regime left out of the fit from
1.60x to 1.30x, docs/performance.md); a candidate's goodput is then divided by its cost. The model
assumes the learning rate is suited to each batch (Pollux adapts it, AdaScale-style; a run here keeps the
one it is given). ``B_noise`` changes during training; a plan uses one measurement
(:func:`hetpipe.run.pilot.measure_noise_scale`).

**The candidates**: the whole cluster, then the cluster without its slowest device, its two slowest, ...
(slowest by the profile's time of the whole model on the device's type; among equals, the last device
of the last node first, so the devices kept keep their ids and every slower type goes before a faster
one, which makes dropping whole types slowest first part of the sequence). On each, every policy
(:mod:`hetpipe.plan.formation`) and, when all are asked for, ``DP``: one-device VWs, pure data
parallelism over the devices that hold the whole model (the others left out as any VW that fits
nowhere), and ``PP``: one VW over every device, pure pipelining (a batch per update of one minibatch),
searched over Nm only up to twice a node's devices, the most a policy's VW may take, since a pipeline's
own staleness (up to ``Nm - 1`` of its updates) is not in the model. Policies that form the same VWs are
one candidate. Each is searched over Nm (and the recomputation modes asked for) for its best goodput. A
device set whose memory cannot hold the model is skipped with the reason, and so are the smaller ones
after it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

from hetpipe.plan.cluster import ClusterSpec
from hetpipe.plan.efficiency import NO_STALENESS_COSTS, StalenessCosts, efficiency, sample_cost
from hetpipe.plan.formation import POLICIES, default_vw_size, form_virtual_workers
from hetpipe.plan.profile import ModelProfile
from hetpipe.plan.stage_cost import LayerTable
from hetpipe.plan.types import Plan
from hetpipe.plan.waves import speed_lengths, speed_throughput

DP = "DP"       # the layout of one-device VWs (pure data parallelism)
PP = "PP"       # the layout of one VW over every device of the set (pure pipelining)
FORMATION = {DP: "NP", PP: "ED"}  # the policy forming each layout's VWs (ED: one VW when its size is the set's)
NEEDS_NOISE_SCALE = ("measure the gradient noise scale (samples) with a short pilot on the model and its data: "
                     "hetpipe.run.pilot.measure_noise_scale(model, loss_fn, data)")


def batch_per_update(num_vws: int, minibatch_size: int) -> int:
    """Samples per update of a plan of ``num_vws`` VWs with minibatches of ``minibatch_size`` samples:
    ``num_vws x minibatch_size``, under either aggregate (see the module docstring)."""
    return num_vws * minibatch_size


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_statistics(where: str, noise_scale: Any, base_batch: Any, minibatch_size: Any) -> None:
    """ValueError in one line naming the argument: ``noise_scale`` missing, not a finite number >= 0;
    ``base_batch`` not a finite number > 0; no minibatch size (the profile's or ``minibatch_size``)."""
    if noise_scale is None:
        raise ValueError(f"{where}: objective 'time-to-accuracy' needs noise_scale: {NEEDS_NOISE_SCALE}")
    if not _number(noise_scale) or not math.isfinite(noise_scale) or noise_scale < 0:
        raise ValueError(f"{where}: noise_scale must be a finite number >= 0 (samples), got {noise_scale!r}"
                         + (" (an infinite noise scale makes every batch as efficient: use the throughput "
                            "objective)" if _number(noise_scale) and noise_scale == math.inf else ""))
    if base_batch is not None and (not _number(base_batch) or not math.isfinite(base_batch) or base_batch <= 0):
        raise ValueError(f"{where}: base_batch must be a finite number > 0 (samples), got {base_batch!r}")
    if not minibatch_size:
        raise ValueError(f"{where}: the time-to-accuracy objective needs the minibatch size in samples: give "
                         f"minibatch_size (the profile has none)")


def slowest_first(cluster: ClusterSpec, profile: ModelProfile) -> List[str]:
    """The cluster's device ids, slowest first: by the profile's time of the whole model (forward and
    backward) on the device's type, then type name; among equals, the last device of the cluster first."""
    def model_time(t: str) -> float:
        return sum(layer.fwd_time[t] + layer.bwd_time[t] for layer in profile.layers)

    times = {t: model_time(t) for t in {d.type for d in cluster.devices}}
    pos = {d.id: i for i, d in enumerate(cluster.devices)}
    return [d.id for d in sorted(cluster.devices, key=lambda d: (-times[d.type], d.type, -pos[d.id]))]


def without(cluster: ClusterSpec, devices: Sequence[str]) -> ClusterSpec:
    """``cluster`` without ``devices`` (the others keep their ids and nodes)."""
    out = set(devices)
    return replace(cluster, devices=tuple(d for d in cluster.devices if d.id not in out))


def describe_devices(cluster: ClusterSpec, ids: Sequence[str]) -> str:
    """Device ids in few words: a node whose devices are all named is its name and type count
    (``n3 (4 quadro_p4000)``), the others their ids; "-" for none."""
    chosen = set(ids)
    words = []
    for node in cluster.nodes:
        devs = cluster.devices_of(node)
        mine = [d for d in devs if d.id in chosen]
        if not mine:
            continue
        if len(mine) == len(devs):
            kinds: Dict[str, int] = {}
            for d in mine:
                kinds[d.type] = kinds.get(d.type, 0) + 1
            words.append(f"{node} ({', '.join(f'{n} {t}' for t, n in kinds.items())})")
        else:
            words.extend(d.id for d in mine)
    return ", ".join(words) or "-"


def _shape(sizes: Sequence[int]) -> str:
    """VW sizes as ``3x4+1x3`` (three VWs of four devices and one of three)."""
    counts: Dict[int, int] = {}
    for s in sizes:
        counts[s] = counts.get(s, 0) + 1
    return "+".join(f"{n}x{s}" for s, n in sorted(counts.items(), reverse=True))


def noise_schedule(rows: Sequence[Dict[str, Any]], noise_scale: float, chosen: int) -> List[Dict[str, Any]]:
    """Which candidate has the largest goodput as the noise scale grows from ``noise_scale`` (it grows
    along training, and a plan is made for one value): ``[{"candidate", "from", "to"}, ...]``, the
    noise-scale intervals (samples) in order, the first the ``chosen`` candidate's (unless another ties
    it there), the last ending at
    ``math.inf`` with the candidate of the largest throughput (where every batch is as efficient).

    Exact, not sampled: with throughput ``T`` (samples/s, over the candidate's sample cost, which does not
    depend on ``B``) and batch per update ``M``, a candidate's goodput is ``T (B + M0) / (B + M)``, so
    candidate ``j`` overtakes the current one ``c`` at the one noise scale where ``T_j (B + M_c) =
    T_c (B + M_j)``: ``B* = (T_c M_j - T_j M_c) / (T_j - T_c)``, for a ``j`` of larger throughput (one of
    larger throughput and no larger batch would already have the larger goodput).
    The next interval's candidate is the first to overtake; among those overtaking at the same ``B*``, the
    one of the largest throughput (it stays ahead beyond)."""
    feasible = {r["index"]: r for r in rows if "goodput" in r}
    # the samples/s a candidate is worth before its efficiency: its throughput over its sample cost
    worth = {j: r["samples_per_s"] / r.get("sample_cost", 1.0) for j, r in feasible.items()}
    out: List[Dict[str, Any]] = []
    current, at = chosen, noise_scale
    while True:
        c, tc = feasible[current], worth[current]
        crossings = []
        for j, r in feasible.items():
            tj = worth[j]
            if tj > tc * (1 + 1e-12):
                b = (tc * r["batch_per_update"] - tj * c["batch_per_update"]) / (tj - tc)
                crossings.append((max(b, at), -tj, j))
        if not crossings:
            out.append({"candidate": current, "from": at, "to": math.inf})
            return out
        b, _, nxt = min(crossings)
        if b > at:                  # (a candidate tying the current one at ``at`` leaves no interval)
            out.append({"candidate": current, "from": at, "to": b})
        current, at = nxt, b


def plan_for_time_to_accuracy(cluster: ClusterSpec, table: LayerTable, profile: ModelProfile, policies: Sequence[str],
                              vw_size: Optional[int], noise_scale: float, base_batch: Optional[float],
                              minibatch_size: int, search_args: Dict[str, Any],
                              to_plan: Callable[[Any, ClusterSpec, Dict[str, Any], Dict[str, Any]], Plan],
                              waves: str = "equal", staleness: StalenessCosts = NO_STALENESS_COSTS) -> Plan:
    """The candidate of the largest goodput as a plan (see the module docstring), its ``meta`` carrying
    ``time_to_accuracy``: the statistics and every candidate. ``to_plan(candidate, cluster, outcomes,
    extra_meta)`` builds the plan (the planner's); ``search_args``: the planner's search settings; ``waves``:
    the plan's wave rule, under which each candidate's throughput is predicted (``"speed"``:
    :func:`hetpipe.plan.waves.speed_throughput`); ``staleness``: the coefficients of the samples a plan's
    own staleness and averaging cost (:func:`hetpipe.plan.efficiency.sample_cost`; the default prices
    none, so the goodput is Pollux's alone)."""
    from hetpipe.plan.planner import check_fits_cluster, search

    base = float(base_batch) if base_batch is not None else float(minibatch_size)
    d = search_args.get("d", 0)

    def score(thr: float, mem: int, stage_counts: List[int], nm: int) -> float:
        eff = efficiency(batch_per_update(len(stage_counts), minibatch_size), noise_scale, base)
        return thr * minibatch_size * eff / sample_cost(stage_counts, nm, d, staleness)

    layouts: List[Any] = [(p, vw_size) for p in policies]
    if set(policies) == set(POLICIES):
        layouts += [(DP, 1), (PP, None)]
    order = slowest_first(cluster, profile)
    rows: List[Dict[str, Any]] = []
    chosen = None                   # (candidate, row, device set, the device set's outcomes)
    for k in range(len(order)):
        dropped = order[:k]
        sub = without(cluster, dropped)
        head = {"devices": [d.id for d in sub.devices], "without": list(dropped),
                "without_text": describe_devices(cluster, dropped)}
        try:
            check_fits_cluster(table, sub, profile)
        except ValueError as e:
            rows.append({**head, "layout": "any", "skipped": str(e)})
            break                   # the smaller device sets after it hold less
        formed: Dict[Any, Dict[str, Any]] = {}
        outcomes: Dict[str, Any] = {}
        for label, lsize in layouts:
            if label == PP:
                lsize = len(sub.devices)
                if lsize > profile.num_layers:
                    rows.append({**head, "layout": label, "skipped": f"one VW over {lsize} devices needs a "
                                 f"layer per stage and the model has {profile.num_layers}"})
                    outcomes[label] = "infeasible"
                    continue
            vws = form_virtual_workers(sub, FORMATION.get(label, label), lsize)
            key = tuple(sorted(tuple(v) for v in vws))
            if key in formed:
                formed[key]["layout"] += f"/{label}"
                outcomes[label] = outcomes[formed[key]["layout"].split("/")[0]]
                continue
            args = search_args
            if label == PP and args.get("max_nm") is None:
                # Nm no larger than a policy's VW may take: a pipeline's own staleness (up to Nm - 1 of its
                # updates) is not in the model, so this layout adds none the others do not have
                args = {**args, "max_nm": 2 * default_vw_size(sub)}
            found = search(sub, table, [FORMATION.get(label, label)], lsize, score, **args)
            cand = next(iter(found.values()))
            row = {**head, "layout": label}
            formed[key] = row
            rows.append(row)
            if isinstance(cand, str):
                row["skipped"] = cand
                outcomes[label] = "infeasible"
                continue
            cand.policy = label
            outcomes[label] = cand.throughput
            n = len(cand.parts)
            batch = batch_per_update(n, minibatch_size)
            eff = efficiency(batch, noise_scale, base)
            stages = [len(p.stages) for p in cand.parts]
            thr = cand.throughput
            if waves == "speed":
                thr = speed_throughput(cand.nm, list(cand.wave_times), stages) or thr
                row["waves"] = speed_lengths(cand.nm, list(cand.wave_times), stages)
            cost = sample_cost(stages, cand.nm, d, staleness)
            row.update(devices=[st.device for p in cand.parts for st in p.stage_devs],
                       vws=stages, vws_text=_shape(stages),
                       nm=cand.nm, throughput=thr, samples_per_s=thr * minibatch_size,
                       batch_per_update=batch, efficiency=eff, sample_cost=cost,
                       goodput=thr * minibatch_size * eff / cost)
            if cand.left_out:
                row["left_out"] = [s.device for vw, *_ in cand.left_out for s in vw]
            if chosen is None or row["goodput"] > chosen[1]["goodput"] * (1 + 1e-9):
                chosen = (cand, row, sub, outcomes)
    if chosen is None:
        detail = "; ".join(f"{r['layout']} on {len(r['devices'])} devices: {r['skipped']}" for r in rows[:4])
        raise ValueError(f"make_plan: no plan of {profile.name!r} fits cluster {cluster.name!r}: {detail}")
    best, best_row, sub, outcomes = chosen
    fastest = max((r for r in rows if "goodput" in r), key=lambda r: r["samples_per_s"])
    for i, r in enumerate(rows):
        r["index"] = i
        if "goodput" in r:
            r["relative_time"] = best_row["goodput"] / r["goodput"] if r["goodput"] > 0 else math.inf
    extra = {"time_to_accuracy": {
        "noise_scale": float(noise_scale), "base_batch": base, "minibatch_size": minibatch_size,
        "batch_model": "N x minibatch (the VWs' gradients of a wave share the global weights)",
        "staleness_costs": asdict(staleness),
        "chosen": best_row["index"], "fastest": fastest["index"], "candidates": rows,
        "schedule": noise_schedule(rows, float(noise_scale), best_row["index"])}}
    if best_row["without"]:
        extra["not_used"] = {"devices": list(best_row["without"]), "text": best_row["without_text"]}
    return to_plan(best, sub, outcomes, extra)
