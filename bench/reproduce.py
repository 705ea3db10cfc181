"""HetPipe's (ATC'20) policy and staleness findings, as the simulator predicts them with the PS modelled.

For each model, each VW formation policy (NP, ED, HD, and ED with the paper's default round-robin
PS placement, ``ED-rr``) and each Nm, the planner partitions the VWs once, at the largest D of the
sweep it can fit (a larger D keeps more wave deltas in memory), so that a row's columns differ in D
alone; :func:`hetpipe.schedule.simulate_plan` then plays ``waves`` waves at each D with the PS
shards as resources that take time (:mod:`hetpipe.schedule.ps`). Throughput is minibatches per
second of the whole cluster over the run (every VW runs the same number of waves). All devices are
modelled; the simulation is deterministic, so D buys overlap of the PS traffic with compute and
slack between VWs of different speeds, not tolerance of run-time variance (not modelled).

The findings checked, from the paper's evaluation:

* F1: for ResNet-152, ED is the best policy.
* F2: for VGG-19, whose parameters (575 MB) make PS traffic dominate, keeping that traffic local
  wins: the best policy is the one with the least PS traffic over the network, and local placement
  (ED) gains more over round-robin placement (ED-rr) for VGG-19 than for ResNet-152 (checked at
  each policy's best Nm and D, and at D = 0, where the PS traffic is not overlapped).
* F3: a larger D raises throughput, with diminishing returns (D 0 -> 1 gains more than 4 -> 32);
  checked on the best Nm per policy, and on every row (no configuration loses throughput as D grows).

``--tta JSON`` adds the modelled time to accuracy of :mod:`reproduce_tta` (samples to target measured
by bench/convergence over these throughputs, beside a Horovod-style baseline).

    python bench/reproduce.py [--models resnet152,vgg19] [--nm 2,4,8] [--d 0,1,2,4,32] [--waves 40]
    python bench/reproduce.py --tta bench/convergence/results/convergence-full.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from hetpipe.plan import make_plan
from hetpipe.plan.cluster import ClusterSpec, load_cluster
from hetpipe.plan.formation import default_vw_size
from hetpipe.plan.profile import load_profile
from hetpipe.plan.types import Plan, ShardPlan
from hetpipe.schedule.ps import DEFAULT_APPLY_RATE
from hetpipe.schedule.simulate import MAX_MINIBATCH_STAGES, simulate_plan
from hetpipe.util.numbers import number

CLUSTER = "hetpipe-testbed"
MODELS = ("resnet152", "vgg19")
POLICIES = ("NP", "ED", "HD", "ED-rr")
DS = (0, 1, 2, 4, 32)
NMS = (2, 4, 8)
MEANINGFUL = 0.05       # a relative gain smaller than this does not count as a policy or placement winning


@dataclass(frozen=True)
class Point:
    """One simulated configuration: throughput with the PS modelled and with it serving at once
    (``free_ps_throughput``, at D = 0 only, else 0), and the share of PS bytes that cross the network."""

    model: str
    policy: str
    nm: int
    d: int
    throughput: float
    free_ps_throughput: float
    remote_share: float


def round_robin(plan: Plan, param_bytes: Sequence[float]) -> Plan:
    """``plan`` with its layers dealt to its shards round-robin by layer index, wherever they are used."""
    n = len(plan.ps_shards)
    shards = tuple(ShardPlan(sh.index, sh.node, tuple(range(i, plan.num_layers, n)),
                             int(sum(param_bytes[lay] for lay in range(i, plan.num_layers, n))))
                   for i, sh in enumerate(plan.ps_shards))
    return dataclasses.replace(plan, ps_shards=shards, policy=plan.policy + "-rr")


def remote_share(plan: Plan, cluster: ClusterSpec, param_bytes: Sequence[float]) -> float:
    """Fraction of the plan's PS bytes per wave whose stage is on another node than its shard."""
    node = {sh.index: sh.node for sh in plan.ps_shards}
    owner = {lay: sh.index for sh in plan.ps_shards for lay in sh.layers}
    total = remote = 0.0
    for vw in plan.virtual_workers:
        for st in vw.stages:
            for lay in st.layers:
                total += param_bytes[lay]
                if cluster.device(st.device).node != node[owner[lay]]:
                    remote += param_bytes[lay]
    return remote / total if total else 0.0


def run(models: Sequence[str] = MODELS, nms: Sequence[int] = NMS, ds: Sequence[int] = DS, waves: int = 40,
        apply_rate: float = DEFAULT_APPLY_RATE) -> List[Point]:
    """Plan and simulate every (model, policy, Nm, D); D values no partition fits are left out."""
    cluster = load_cluster(CLUSTER)
    if not nms or not ds:
        raise ValueError("needs at least one Nm and one D")
    work = waves * max(nms) * default_vw_size(cluster)
    if work > MAX_MINIBATCH_STAGES:
        raise ValueError(f"--waves {waves} x Nm {max(nms)} x {default_vw_size(cluster)} stages is more than "
                         f"the {MAX_MINIBATCH_STAGES} minibatch-stages a simulation may play")
    plans = []
    for model in models:
        profile = load_profile(model)
        pb = [float(layer.param_bytes) for layer in profile.layers]
        for policy in POLICIES:
            for nm in nms:
                plan = _plan_at_largest_d(cluster, profile, policy, nm, ds)
                if plan is not None:
                    plans.append((model, policy, pb, round_robin(plan, pb) if policy.endswith("-rr") else plan))
    points = []
    for nm in nms:                      # one (Nm, D) at a time: every plan shares its schedule
        for d in sorted(ds):
            for model, policy, pb, plan in plans:
                if plan.nm != nm or d > plan.d:
                    continue
                at_d = dataclasses.replace(plan, d=d)
                modelled = simulate_plan(at_d, waves, cluster=cluster, param_bytes=pb, apply_rate=apply_rate)
                free = simulate_plan(at_d, waves).throughput if d == 0 else 0.0
                points.append(Point(model, policy, nm, d, modelled.throughput, free,
                                    remote_share(plan, cluster, pb)))
    order = {(m, p, plan.nm): i for i, (m, p, _, plan) in enumerate(plans)}
    return sorted(points, key=lambda p: (order[(p.model, p.policy, p.nm)], p.d))


def _plan_at_largest_d(cluster: ClusterSpec, profile, policy: str, nm: int, ds: Sequence[int]) -> Optional[Plan]:
    for d in sorted(ds, reverse=True):
        try:
            return make_plan(cluster, profile, policy=policy.split("-")[0], nm=nm, d=d)
        except ValueError:
            continue
    return None


def table(points: Sequence[Point], ds: Sequence[int]) -> str:
    """One row per (model, policy, Nm): throughput per D, PS modelled, then at D = 0 with the PS
    serving at once, and the remote share of PS bytes."""
    rows: Dict[Tuple[str, str, int], Dict[int, Point]] = {}
    for p in points:
        rows.setdefault((p.model, p.policy, p.nm), {})[p.d] = p
    head = (f"{'model':<10} {'policy':<6} {'Nm':>3} " + " ".join(f"{'D=' + str(d):>7}" for d in ds)
            + f" {'D=0 free':>8} {'remote':>7}")
    lines = [head, "-" * len(head)]
    for (model, policy, nm), by_d in rows.items():
        cells = " ".join(f"{by_d[d].throughput:>7.2f}" if d in by_d else f"{'-':>7}" for d in ds)
        free = f"{by_d[0].free_ps_throughput:>8.2f}" if 0 in by_d else f"{'-':>8}"
        share = next(iter(by_d.values())).remote_share
        lines.append(f"{model:<10} {policy:<6} {nm:>3} {cells} {free} {share:>7.0%}")
    return "\n".join(lines)


def _best(points: Sequence[Point], model: str, policy: str, d: Optional[int] = None) -> Optional[Point]:
    """The best Nm's point of ``model`` under ``policy`` (at ``d``, or over all D)."""
    cand = [p for p in points if p.model == model and p.policy == policy and (d is None or p.d == d)]
    return max(cand, key=lambda p: p.throughput, default=None)


def findings(points: Sequence[Point], ds: Sequence[int]) -> List[Tuple[str, bool, str]]:
    """``(finding, simulator agrees, the figures behind the verdict)`` for F1-F3."""
    out = []
    models = sorted({p.model for p in points})
    if "resnet152" in models:
        wins = []
        for d in ds:
            best = {pol: _best(points, "resnet152", pol, d) for pol in ("NP", "ED", "HD")}
            best = {k: v for k, v in best.items() if v is not None}
            if best:
                wins.append((d, max(best, key=lambda k: best[k].throughput)))
        ok = bool(wins) and all(w == "ED" for _, w in wins)
        out.append(("F1 ResNet-152: ED is the best policy", ok,
                    "best policy per D: " + ", ".join(f"D={d} {w}" for d, w in wins)))
    if "vgg19" in models:
        best = {pol: _best(points, "vgg19", pol) for pol in POLICIES}
        best = {k: v for k, v in best.items() if v is not None}
        if best:
            top = max(best, key=lambda k: best[k].throughput)
            least = min(best, key=lambda k: best[k].remote_share)
            ok = best[top].remote_share <= best[least].remote_share + 1e-9
            out.append(("F2 VGG-19: the policy with the least remote PS traffic wins", ok,
                        f"winner {top} ({best[top].remote_share:.0%} remote); least remote: {least} "
                        f"({best[least].remote_share:.0%})"))
        for d, where in ((None, "at each policy's best (Nm, D)"), (0, "at D=0, best Nm")):
            gain = {}
            for model in models:
                ed, rr = _best(points, model, "ED", d), _best(points, model, "ED-rr", d)
                if ed and rr:
                    gain[model] = ed.throughput / rr.throughput
            if "resnet152" in gain and "vgg19" in gain:
                ok = gain["vgg19"] > gain["resnet152"] and gain["vgg19"] >= 1 + MEANINGFUL
                out.append((f"F2 local PS placement (ED over ED-rr) gains more for VGG-19 than for ResNet-152 {where}",
                            ok, ", ".join(f"{m} x{g:.2f}" for m, g in gain.items())))
    if len(ds) >= 3 and 0 in ds:
        details, ok = [], True
        for model in models:
            for pol in ("NP", "ED", "HD"):
                by = {d: _best(points, model, pol, d) for d in sorted(ds)}
                by = {d: p for d, p in by.items() if p is not None}
                if len(by) < 3 or 0 not in by:
                    continue
                dd = sorted(by)
                thr = [by[d].throughput for d in dd]
                rising = all(b >= a * (1 - 1e-6) for a, b in zip(thr, thr[1:]))
                first = thr[1] - thr[0]
                last = thr[-1] - thr[-2]
                ok &= rising and first > 0 and last < first
                details.append(f"{model} {pol}: D=0->{dd[1]} {first:+.2f}, D={dd[-2]}->{dd[-1]} {last:+.2f}"
                               + ("" if rising else " (not monotone)"))
        out.append(("F3 larger D raises the best Nm's throughput with diminishing returns", ok, "; ".join(details)))
        rows: Dict[Tuple[str, str, int], List[Point]] = {}
        for p in points:
            rows.setdefault((p.model, p.policy, p.nm), []).append(p)
        losing = [f"{m} {pol} Nm={nm}" for (m, pol, nm), ps in rows.items()
                  if any(b.throughput < a.throughput * (1 - 1e-6)
                         for a, b in zip(sorted(ps, key=lambda p: p.d), sorted(ps, key=lambda p: p.d)[1:]))]
        out.append(("F3 no configuration loses throughput as D grows", not losing,
                    "losing: " + ", ".join(losing) if losing else "none loses"))
    return out


def report(points: Sequence[Point], ds: Sequence[int], waves: int, apply_rate: float) -> str:
    """The table and the findings with the simulator's verdict on each."""
    lines = [f"HetPipe (ATC'20) reproduction on {CLUSTER}: modelled devices, simulated {waves} waves per VW, "
             f"PS shards as resources (apply {apply_rate / 1e9:g} GB/s); minibatches/s of the whole cluster",
             "(one partition per row, the planner's at the largest D it fits, '-' beyond; ED-rr: ED with layers dealt",
             " round-robin to shards; D=0 free: D = 0 with shards serving at once; remote: share of PS bytes crossing",
             " the network)", "", table(points, ds), ""]
    for text, ok, why in findings(points, ds):
        lines.append(f"{'AGREES ' if ok else 'DIFFERS'} {text}: {why}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Print the table and the findings (and with ``--tta`` the modelled time to accuracy); 2 on bad
    input, said in one line."""
    p = argparse.ArgumentParser(prog="reproduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="profile presets (default resnet152,vgg19)")
    p.add_argument("--nm", default=",".join(map(str, NMS)), help="Nm values (default 2,4,8)")
    p.add_argument("--d", default=",".join(map(str, DS)), help="D values (default 0,1,2,4,32)")
    p.add_argument("--waves", default="40", help="waves per VW per simulation (default 40)")
    p.add_argument("--ps-apply-rate", default=None, help="bytes/s a PS shard applies pushed deltas at (default 4e9)")
    p.add_argument("--tta", metavar="JSON", help="also model time to accuracy: samples to target measured in this "
                                                 "bench/convergence JSON over the modelled throughputs, beside a "
                                                 "Horovod-style baseline")
    p.add_argument("--tta-aggregate", default="sum", help="the hetpipe rows of --tta's JSON to use (sum or mean)")
    args = p.parse_args(argv)
    try:
        models = [m for m in args.models.split(",") if m]
        nms = [number("--nm", x, integer=True, positive=True) for x in args.nm.split(",")]
        ds = [number("--d", x, integer=True) for x in args.d.split(",")]
        waves = number("--waves", args.waves, integer=True, positive=True)
        rate = DEFAULT_APPLY_RATE if args.ps_apply_rate is None else number(
            "--ps-apply-rate", args.ps_apply_rate, positive=True)
        points = run(models, nms, ds, waves, rate)
    except ValueError as e:
        print(f"reproduce: {e}", file=sys.stderr)
        return 2
    print(report(points, ds, waves, rate))
    if args.tta:
        return _print_tta(args, models, points)
    return 0


def _print_tta(args, models, points) -> int:
    import json
    from pathlib import Path

    import reproduce_tta

    try:
        conv = json.loads(Path(args.tta).read_text())
        cluster = load_cluster(CLUSTER)
        profiles = {m: load_profile(m) for m in models}
        rows = reproduce_tta.rows(points, profiles, cluster, conv, args.tta_aggregate)
        hv = [reproduce_tta.horovod(cluster, p) for p in profiles.values()]
    except (OSError, ValueError, KeyError) as e:
        print(f"reproduce --tta: {e}", file=sys.stderr)
        return 2
    print()
    print(reproduce_tta.report(rows, hv, Path(args.tta).name, conv, args.tta_aggregate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
