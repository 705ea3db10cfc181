"""Simulator benchmark: speed at cluster scale, and simulate() beside closed forms and the planner.

    python bench/simulator.py [--plan plan.json] [--vws 64 --stages 16 --waves 100 --nm 16]

Prints one table: each quantity as simulate() measures it, the closed form (or the planner's
prediction stored in the plan), and the relative difference. Not a test.
"""

from __future__ import annotations

import argparse
import random
import time

from hetpipe.schedule import (
    ShardTraffic, gpipe_schedule, hetpipe_schedule, one_f_one_b_schedule, simulate, vw_costs,
)


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


def closed_forms(rows) -> None:
    for gen in (gpipe_schedule, one_f_one_b_schedule):
        p, m = 4, 8
        r = simulate([gen(p, m)], [vw_costs([1.0] * p, [2.0] * p)])
        _row(rows, f"{gen.__name__}({p}, {m}) bubble vs (p-1)/(m+p-1)", r.bubble_fraction, (p - 1) / (m + p - 1))

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


def against_plan(rows, path: str, waves: int) -> None:
    from hetpipe.plan.types import Plan
    from hetpipe.schedule import simulate_plan

    plan = Plan.load(path)
    r = simulate_plan(plan, waves=waves)     # shards serving at once, as the planner's cost model assumes
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
    args = ap.parse_args()
    rows = []
    scale(rows, args.vws, args.stages, args.waves, args.nm)
    closed_forms(rows)
    if args.plan:
        against_plan(rows, args.plan, 20)
    head = ("quantity", "simulate()", "reference", "rel. diff")
    width = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    for r in [head, tuple("-" * w for w in width)] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, width)))


if __name__ == "__main__":
    main()
