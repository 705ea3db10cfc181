"""Simulator benchmark: speed at cluster scale, and simulate() beside closed forms and the planner.

    python bench/simulator.py [--plan plan.json [--schedule NAME]] [--vws 64 --stages 16 --waves 100 --nm 16]

Prints one table: each quantity as simulate() measures it, the closed form (or the planner's
prediction stored in the plan, or the registered schedule's cost-model wave time), and the relative
difference. Devices are modelled (no run). Not a test.
"""

from __future__ import annotations

import argparse
import random
import time

from hetpipe.schedule import ShardTraffic, hetpipe_schedule, simulate, vw_costs
from hetpipe.schedule.registry import ScheduleOptions, generate, get_schedule, schedule_names


def _row(rows, name, sim, ref):
    diff = abs(sim - ref) / abs(ref) if ref else float("nan")
    rows.append((name, f"{sim:.4f}", f"{ref:.4f}", f"{diff:.2%}"))


def scale(rows, vws: int, stages: int, waves: int, nm: int) -> None:
    rng = random.Random(0)
    t0 = time.perf_counter()
    sched = hetpipe_schedule(stages, waves * nm, nm, 1)
    t1 = time.perf_counter()
    costs = [vw_costs([rng.uniform(1e-3, 2e-3) for _ in range(stages)],
                      [rng.uniform(2e-3, 4e-3) for _ in range(stages)],
                      transfer_s=2e-4, latency_s=5e-5, push=5e-3, pull=5e-3) for _ in range(vws)]
    result = simulate([sched] * vws, costs)
    t2 = time.perf_counter()
    rows.append((f"time: generate {stages} stages x {waves * nm} minibatches (s)", f"{t1 - t0:.2f}", "", ""))
    rows.append((f"time: simulate {vws} VWs x {stages} stages x {waves} waves (s)", f"{t2 - t1:.2f}", "< 30", ""))
    rows.append(("  cluster throughput (minibatches/s)", f"{result.throughput:.1f}", "", ""))
    shards = max(1, stages // 4)
    ps = [[ShardTraffic(s % shards, 1e-3, 2e-3, 1e-3)] for s in range(stages)]
    with_ps = [vw_costs(list(c.fwd), list(c.bwd), transfer_s=2e-4, latency_s=5e-5, ps=ps) for c in costs]
    t3 = time.perf_counter()
    simulate([sched] * vws, costs)                  # again, the schedule now compiled: the baseline
    t4 = time.perf_counter()
    modelled = simulate([sched] * vws, with_ps)
    t5 = time.perf_counter()
    rows.append((f"time: same again, {shards} PS shards modelled vs serving at once (s)", f"{t5 - t4:.2f}",
                 f"{t4 - t3:.2f}", f"{(t5 - t4) / (t4 - t3) - 1:+.0%}"))
    rows.append(("  cluster throughput, PS modelled (minibatches/s)", f"{modelled.throughput:.1f}", "", ""))


def registered(rows) -> None:
    """Every registered schedule, 4 equal stages (F = 1 s, B = 2 s): simulated seconds per wave beside
    the cost model's closed form (the spec's ``wave_time``), at the options each takes."""
    k = 4
    for name in schedule_names():
        spec = get_schedule(name)
        for nm, d in ((4, 1), (2, 0), (2, 1)) if "nm" in spec.takes and "d" in spec.takes else ((1, 0),):
            waves = 20 if "nm" in spec.takes else 1
            m = waves * nm if "nm" in spec.takes else 8
            o = ScheduleOptions(k, m, nm, d)
            r = simulate([generate(name, o)], [vw_costs([1.0] * k, [2.0] * k)])
            done = r.wave_done_s[0]
            sim = (done[-1] - done[-2]) if len(done) > 1 else r.makespan_s
            ref = spec.wave_time(1.0 + 2.0, k * (1.0 + 2.0), 0.0, ScheduleOptions(k, nm if waves > 1 else m, nm, d))
            _row(rows, f"{name} {k} stages, {m} minibatches, Nm={nm}, D={d}: s per wave vs cost model", sim, ref)


def closed_forms(rows) -> None:
    for name in ("gpipe", "1f1b"):
        p, m = 4, 8
        r = simulate([generate(name, ScheduleOptions(p, m))], [vw_costs([1.0] * p, [2.0] * p)])
        _row(rows, f"{name} ({p} stages, {m} minibatches) bubble vs (p-1)/(m+p-1)", r.bubble_fraction,
             (p - 1) / (m + p - 1))

    f, b = [1.0, 2.0, 0.5, 1.5], [2.0, 2.5, 1.0, 3.0]
    r = simulate([hetpipe_schedule(4, 50 * 4, 4, 1000)], [vw_costs(f, b)])
    _row(rows, "hetpipe 4 stages, Nm=4: steady throughput vs 1/slowest", r.steady_throughput(0, 5),
         1 / max(x + y for x, y in zip(f, b)))

    s = hetpipe_schedule(4, 50 * 4, 4, 1000)
    fast, slow = vw_costs([1.0] * 4, [2.0] * 4), vw_costs([2.0] * 4, [3.0] * 4)
    r = simulate([s, s], [fast, slow])
    _row(rows, "WSP D=1000: fast VW vs its own 1/slowest", r.steady_throughput(0, 5), 1 / 3.0)
    _row(rows, "WSP D=1000: slow VW vs its own 1/slowest", r.steady_throughput(1, 5), 1 / 5.0)
    s0 = hetpipe_schedule(4, 50 * 4, 4, 0)
    r = simulate([s0, s0], [fast, slow])
    _row(rows, "WSP D=0: fast VW vs slow VW throughput", r.steady_throughput(0, 5), r.steady_throughput(1, 5))
    rows.append(("  WSP D=0: wait time of the fast VW (s)", f"{sum(x.wsp_wait_s for x in r.stages[0]):.1f}", "", ""))

    c = vw_costs([1.0], [2.0], ps=[[ShardTraffic(0, 0.1, 0.5, 0.1)]])
    r = simulate([hetpipe_schedule(1, 10, 1, 0)], [c])
    _row(rows, "PS, 1 VW, 1 stage, D=0: wave vs compute+push+apply+pull", r.wave_done_s[0][5] - r.wave_done_s[0][4],
         3.0 + 0.1 + 0.5 + 0.1)
    s1 = hetpipe_schedule(1, 40, 1, 1)
    c = vw_costs([0.5], [0.5], ps=[[ShardTraffic(0, 0.0, 1.0, 0.0)]])
    _row(rows, "PS, 2 VWs queue at 1 shard (apply 1 s each), D=1: steady vs 1 / (2 x apply)",
         simulate([s1, s1], [c, c]).steady_throughput(0, 10), 0.5)

    one = simulate([hetpipe_schedule(4, 4, 4, 0)], [vw_costs([1.0] * 4, [2.0] * 4)])
    split = simulate([hetpipe_schedule(4, 4, 4, 0, split_startup=1)], [vw_costs([1.0] * 4, [2.0] * 4)])
    rows.append(("AutoPipe-H split start-up: one-wave makespan, split=1 vs none",
                 f"{split.makespan_s:.2f}", f"{one.makespan_s:.2f}", ""))


def against_plan(rows, path: str, waves: int, schedule: str) -> None:
    from hetpipe.plan.types import Plan
    from hetpipe.schedule import simulate_plan

    plan = Plan.load(path)
    r = simulate_plan(plan, waves=waves, schedule=schedule)    # shards serving at once, as the cost model assumes
    if plan.throughput:
        _row(rows, "plan: cluster throughput vs planner cost model", r.throughput, plan.throughput)
    for v, vw in enumerate(plan.virtual_workers):
        if vw.throughput and waves > 2:
            _row(rows, f"plan: VW {v} steady throughput vs planner", r.steady_throughput(v, 2), vw.throughput)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan")
    ap.add_argument("--vws", type=int, default=64)
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--waves", type=int, default=100)
    ap.add_argument("--nm", type=int, default=16)
    ap.add_argument("--schedule", choices=schedule_names(), default="hetpipe", help="schedule of the --plan rows")
    args = ap.parse_args()
    rows = []
    scale(rows, args.vws, args.stages, args.waves, args.nm)
    closed_forms(rows)
    registered(rows)
    if args.plan:
        against_plan(rows, args.plan, 20, args.schedule)
    head = ("quantity", "simulate()", "reference", "rel. diff")
    width = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    for r in [head, tuple("-" * w for w in width)] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, width)))


if __name__ == "__main__":
    main()
