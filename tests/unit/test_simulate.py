"""simulate(): closed forms, transfer and PS timing, WSP across VWs, timeline export."""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.schedule import (
    gpipe_schedule, hetpipe_schedule, one_f_one_b_schedule, save_gantt, simulate, simulate_plan, vw_costs,
)
from hetpipe.schedule.trace import chrome_trace


def equal(k, f=1.0, b=1.0, **kw):
    return vw_costs([f] * k, [b] * k, **kw)


@pytest.mark.parametrize("gen", [gpipe_schedule, one_f_one_b_schedule])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (3, 4), (4, 8), (5, 2)])
def test_gpipe_and_1f1b_bubble_matches_closed_form(gen, p, m):
    r = simulate([gen(p, m)], [equal(p, 0.7, 1.3)])
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert r.makespan_s == pytest.approx((m + p - 1) * 2.0)


@settings(max_examples=15, deadline=None)
@given(times=st.lists(st.tuples(st.floats(0.5, 3.0), st.floats(0.5, 3.0)), min_size=1, max_size=5),
       extra=st.integers(0, 2))
def test_steady_throughput_is_one_over_slowest_stage(times, extra):
    k = len(times)
    nm = k + extra
    s = hetpipe_schedule(k, 40 * nm, nm, 1000)
    r = simulate([s], [vw_costs([f for f, _ in times], [b for _, b in times])])
    slowest = max(f + b for f, b in times)
    assert r.steady_throughput(0, skip_waves=5) == pytest.approx(1 / slowest, rel=0.02)
    assert r.wsp_wait_s == 0.0


# Stage times per VW (forward; backward is twice as long) for the monotonicity grid: equal stages, a
# slow middle stage, a slow first stage; the second VW of a pair is 1.5x slower.
_SHAPES = {"equal": lambda k: [1.0] * k, "slow middle": lambda k: [1.0 + (s == k // 2) for s in range(k)],
           "slow first": lambda k: [2.0 if s == 0 else 0.7 for s in range(k)]}


@pytest.mark.parametrize("shape", sorted(_SHAPES))
@pytest.mark.parametrize("vws", [1, 2])
def test_more_staleness_is_never_slower(shape, vws):
    # More staleness only relaxes constraints, so the model must never get slower as D grows. It did for
    # Nm < stages: the 1F1B rule run straight through waves stalled stages >= 1 (docs/design.md, "Schedules").
    slower = []
    for k in range(1, 5):
        f = _SHAPES[shape](k)
        costs = [vw_costs([x * (1 + 0.5 * v) for x in f], [2 * x * (1 + 0.5 * v) for x in f], transfer_s=0.2,
                          push=0.5, pull=0.3) for v in range(vws)]
        for nm in range(1, 5):
            spans = [simulate([hetpipe_schedule(k, 6 * nm, nm, d)] * vws, costs).makespan_s for d in range(4)]
            slower += [(k, nm, d + 1, a, b) for d, (a, b) in enumerate(zip(spans, spans[1:])) if b > a * (1 + 1e-12)]
    assert not slower, f"(stages, nm, D, makespan at D - 1, at D) where D is slower: {slower}"


def test_nm_below_stages_drains_stages_after_the_first_and_beats_d0():
    # 4 stages, nm = 2, F = 1, B = 2 (docs/design.md, "Schedules"): under D = 1 stage 0 starts the next
    # wave after its first backward, stages 1-3 finish the wave's backwards first; a wave then takes one
    # round trip, 12 s, against 15 s at D = 0 (fill, drain) and 18 s before stages 1-3 drained.
    r0, r1 = (simulate([hetpipe_schedule(4, 2 * 12, 2, d)], [equal(4, 1.0, 2.0)]) for d in (0, 1))
    assert (r0.makespan_s, r1.makespan_s) == (180.0, 147.0)
    assert {b - a for a, b in zip(r1.wave_done_s[0][1:], r1.wave_done_s[0][2:])} == {12.0}


def test_wsp_large_d_lets_each_vw_run_at_its_own_speed():
    s = hetpipe_schedule(3, 40 * 3, 3, 1000)
    r = simulate([s, s], [equal(3, 1.0, 1.0), equal(3, 2.0, 3.0)])
    assert r.steady_throughput(0, 5) == pytest.approx(1 / 2.0, rel=0.02)
    assert r.steady_throughput(1, 5) == pytest.approx(1 / 5.0, rel=0.02)
    assert r.wsp_wait_s == 0.0


def test_wsp_d0_makes_the_fast_vw_wait_for_the_slow_one_every_wave():
    s = hetpipe_schedule(3, 40 * 3, 3, 0)
    r = simulate([s, s], [equal(3, 1.0, 1.0), equal(3, 2.0, 3.0)])
    fast, slow = r.steady_throughput(0, 5), r.steady_throughput(1, 5)
    assert fast == pytest.approx(slow, rel=0.02)
    assert fast < 0.25
    assert all(st.wsp_wait_s > 0 for st in r.stages[0])
    waits = [e for e in r.timeline if e.kind == "WAIT" and e.vw == 0 and e.stage == 0]
    assert len(waits) == 39


def test_small_d_bounds_the_lead_of_the_fast_vw():
    s = hetpipe_schedule(2, 30 * 2, 2, 2)
    r = simulate([s, s], [equal(2, 1.0, 1.0), equal(2, 3.0, 3.0)])
    for c in range(3, 30):
        # the fast VW starts wave c only after the slow one finished wave c - d - 1
        assert r.wave_done_s[0][c] >= r.wave_done_s[1][c - 3]


def test_link_carries_one_transfer_at_a_time_with_latency():
    r = simulate([gpipe_schedule(2, 3)], [vw_costs([0, 0], [0, 0], transfer_s=1.0, latency_s=0.5)])
    starts = {(e.stage, e.kind, e.mb): e.start_s for e in r.timeline}
    assert [starts[(1, "F", j)] for j in range(3)] == [1.5, 2.5, 3.5]
    assert [starts[(0, "B", j)] for j in (2, 1, 0)] == [5.0, 6.0, 7.0]
    assert [x.comm_wait_s for x in r.stages[0]] == [7.0, 3.5]


def test_bandwidth_and_bytes_give_transfer_time():
    c = vw_costs([1, 1, 1], [1, 1, 1], act_bytes=[4e6, 2e6], bandwidth=2e6)
    assert c.act_s == (2.0, 1.0) and c.grad_s == (2.0, 1.0)


def test_push_is_non_blocking_but_gates_the_next_pull():
    s = hetpipe_schedule(1, 2, 1, 0)
    r = simulate([s], [vw_costs([1.0], [1.0], push=5.0, pull=0.5)])
    ev = [(e.kind, e.start_s, e.dur_s) for e in r.timeline]
    assert ev == [("F", 0.0, 1.0), ("B", 1.0, 1.0), ("A", 2.0, 0.0), ("WAIT", 2.0, 5.0),
                  ("PULL", 7.0, 0.5), ("F", 7.5, 1.0), ("B", 8.5, 1.0), ("A", 9.5, 0.0)]
    assert r.stages[0][0].wsp_wait_s == 5.0 and r.stages[0][0].pull_s == 0.5


def test_vws_with_different_schedules_share_the_global_clock():
    a, b = hetpipe_schedule(2, 20, 2, 0), hetpipe_schedule(3, 20, 2, 0)
    r = simulate([a, b], [equal(2, 1.0, 1.0), equal(3, 2.0, 2.0)])
    assert r.steady_throughput(0, 2) == pytest.approx(r.steady_throughput(1, 2), rel=0.05)
    assert [len(x) for x in r.stages] == [2, 3]


def test_split_startup_halves_the_first_minibatch():
    s = hetpipe_schedule(4, 4, 4, 0, split_startup=1)
    r = simulate([s], [equal(4, 1.0, 2.0)])
    halves = [e for e in r.timeline if e.mb in (0, 1) and e.kind in ("F", "B")]
    assert {e.dur_s for e in halves if e.kind == "F"} == {0.5}
    assert {e.dur_s for e in halves if e.kind == "B"} == {1.0}
    assert sum(e.dur_s for e in r.timeline if e.stage == 0) == pytest.approx(4 * 3.0)


def test_timeline_counts_and_chrome_trace():
    s = hetpipe_schedule(2, 6, 3, 0)
    r = simulate([s, s], [equal(2), equal(2, 2.0, 2.0)])
    tl = r.timeline
    for kind in ("F", "B", "A"):
        assert sum(1 for e in tl if e.kind == kind) == 2 * 2 * 6
    trace = json.loads(json.dumps(chrome_trace(tl, emulated=False)))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl)
    assert {(e["pid"], e["tid"]) for e in xs} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert any(e["cat"] == "WAIT" for e in xs)


def test_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="one bound"):
        simulate([hetpipe_schedule(2, 4, 2, 0), hetpipe_schedule(2, 4, 2, 1)], [equal(2), equal(2)])
    with pytest.raises(ValueError, match="costs for 3"):
        simulate([hetpipe_schedule(2, 4, 2, 0)], [equal(3)])
    with pytest.raises(ValueError, match="expected 2"):
        vw_costs([1, 1, 1], [1, 1, 1], transfer_s=[1.0])


def tiny_plan(nm=2, d=0):
    def stage(dev, start, stop, f, b, send=0.0):
        return StagePlan(dev, "t", start, stop, f, b, send_time=send)
    vws = (VirtualWorkerPlan(0, (stage("n0.g0", 0, 2, 1.0, 2.0, 0.1), stage("n0.g1", 2, 4, 1.0, 2.0))),
           VirtualWorkerPlan(1, (stage("n1.g0", 0, 2, 2.0, 4.0, 0.1), stage("n1.g1", 2, 4, 2.0, 4.0))))
    return Plan(num_layers=4, nm=nm, d=d, policy="ED", virtual_workers=vws,
                ps_shards=(ShardPlan(0, "n0", (0, 1, 2, 3)),))


def test_simulate_plan_uses_the_plan_costs():
    r = simulate_plan(tiny_plan(nm=2, d=100), waves=30)
    assert r.minibatches == [60, 60]
    assert r.steady_throughput(0, 5) == pytest.approx(1 / 3.0, rel=0.05)
    assert r.steady_throughput(1, 5) == pytest.approx(1 / 6.0, rel=0.05)
    slow = simulate_plan(tiny_plan(nm=2, d=100), waves=30, push=1.0, pull=1.0, latency_s=0.5)
    assert slow.makespan_s > r.makespan_s


def test_save_gantt_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    s = hetpipe_schedule(2, 4, 2, 0)
    r = simulate([s, s], [equal(2), equal(2, 2.0, 2.0)])
    out = tmp_path / "g.png"
    save_gantt(r, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_gantt_without_matplotlib_raises_a_clear_error(tmp_path):
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib':\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from hetpipe.schedule import hetpipe_schedule, simulate, vw_costs, save_gantt\n"
        "r = simulate([hetpipe_schedule(1, 2, 1, 0)], [vw_costs([1.0], [1.0])])\n"
        "try:\n"
        f"    save_gantt(r, {str(tmp_path / 'g.png')!r})\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "needs matplotlib" in out.stdout


def test_time_breakdown_of_a_stage_adds_up_to_its_wall_time():
    from hetpipe.schedule.trace import BREAKDOWN, TraceEvent, time_breakdown

    ev = [TraceEvent(0, 1, "RA", 0.5, 0.01, 0), TraceEvent(0, 1, "F", 0.51, 0.2, 0),
          TraceEvent(0, 1, "SA", 0.75, 0.02, 0), TraceEvent(0, 1, "RG", 1.0, 0.01, 0),
          TraceEvent(0, 1, "B", 1.01, 0.3, 0), TraceEvent(0, 1, "A", 1.31, 0.05, 0),
          TraceEvent(0, 1, "PUSH", 1.36, 0.04, -1, 0), TraceEvent(0, 1, "PULL", 1.6, 0.1, -1, 0),
          TraceEvent(0, 1, "DONE", 1.8, 0.05), TraceEvent(0, 0, "F", 0.0, 9.0, 0)]     # another stage's
    got = time_breakdown(ev, 0, 1)
    want = {"startup": 0.5, "compute": 0.55, "blocked_recv": 0.23, "recv": 0.02, "blocked_pull": 0.2,
            "pull": 0.1, "push": 0.04, "send": 0.06, "sync": 0.15, "other": 0.0, "total": 1.85}
    assert set(got) == set(BREAKDOWN) | {"total"}
    assert all(abs(got[k] - v) < 1e-12 for k, v in want.items()), got
    assert abs(sum(got[k] for k in BREAKDOWN) - got["total"]) < 1e-12
    assert time_breakdown(ev, 1, 0)["total"] == 0.0


def test_time_breakdown_counts_overlapping_instructions_once():
    """An instruction whose attempt began before the previous one ended (an early pull's reply taken
    while a compute ran) overlaps it: the overlap is counted once, so the parts still sum to the wall
    time, and an instruction wholly inside another adds nothing."""
    from hetpipe.schedule.trace import BREAKDOWN, TraceEvent, time_breakdown

    ev = [TraceEvent(0, 0, "F", 0.0, 1.0, 0), TraceEvent(0, 0, "PULL", 0.8, 0.5, -1, 0),
          TraceEvent(0, 0, "SA", 0.9, 0.1, 0), TraceEvent(0, 0, "B", 1.5, 1.0, 0)]
    got = time_breakdown(ev, 0, 0)
    assert abs(got["compute"] - 2.0) < 1e-12 and abs(got["pull"] - 0.3) < 1e-12
    assert got["send"] == 0.0 and abs(got["other"] - 0.2) < 1e-12 and got["total"] == 2.5
    assert abs(sum(got[k] for k in BREAKDOWN) - got["total"]) < 1e-12
