"""PS shards as resources in the simulator, against hand-computed schedules (closed forms)."""

import pytest

from hetpipe.plan.cluster import cluster_from_dict
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.schedule import hetpipe_schedule, simulate, simulate_plan, vw_costs
from hetpipe.schedule.ps import Calendar, ShardTraffic, plan_traffic

INTRA_BW, INTRA_LAT = 1e9, 1e-3
INTER_BW, INTER_LAT = 2.5e8, 4e-3


def two_node_cluster():
    return cluster_from_dict({
        "name": "two", "device_types": {"g": {"memory_bytes": 1 << 30, "speed": 1.0}},
        "nodes": [{"name": "n0", "type": "g", "count": 2}, {"name": "n1", "type": "g", "count": 2}],
        "intra_node": {"bandwidth": INTRA_BW, "latency": INTRA_LAT},
        "inter_node": {"bandwidth": INTER_BW, "latency": INTER_LAT}})


def one_stage_plan(d=0, nm=1, vws=("n0.g0",), shard_node="n0"):
    workers = tuple(VirtualWorkerPlan(v, (StagePlan(dev, "g", 0, 1, 1.0, 2.0),)) for v, dev in enumerate(vws))
    return Plan(num_layers=1, nm=nm, d=d, policy="NP", virtual_workers=workers,
                ps_shards=(ShardPlan(0, shard_node, (0,)),))


def test_calendar_serves_one_at_a_time_and_fills_idle_gaps():
    c = Calendar()
    assert c.book(0.0, 1.0) == (0.0, 1.0)
    assert c.book(5.0, 1.0) == (5.0, 6.0)
    assert c.book(0.0, 2.0) == (1.0, 3.0)      # queued behind [0, 1), fits the gap before 5
    assert c.book(0.0, 3.0) == (6.0, 9.0)      # the gap [3, 5) is too short
    assert c.book(3.0, 2.0) == (3.0, 5.0)      # exactly fills it
    assert (c.starts, c.ends) == ([0.0], [9.0])
    assert c.busy_s == 9.0


def test_one_vw_one_shard_wave_is_compute_push_apply_pull():
    # D = 0, one stage: each wave computes (1 + 2 s), pushes 2e8 B over the node-local link
    # (1 ms + 0.2 s), the shard applies it at 1e9 B/s (0.2 s), the next wave pulls it back (0.201 s).
    plan = one_stage_plan()
    r = simulate_plan(plan, waves=3, cluster=two_node_cluster(), param_bytes=[2e8], apply_rate=1e9)
    sync = 0.201 + 0.2 + 0.201
    assert r.makespan_s == pytest.approx(3 * 3.0 + 2 * sync)
    assert r.wave_done_s[0] == pytest.approx([3.0, 6.0 + sync, 9.0 + 2 * sync])
    st = r.stages[0][0]
    assert st.pull_s == pytest.approx(2 * 0.201)
    assert st.wsp_wait_s == pytest.approx(2 * (0.201 + 0.2))
    assert r.shards[0].recv_s == pytest.approx(3 * 0.201) and r.shards[0].apply_s == pytest.approx(3 * 0.2)


def test_remote_shard_uses_the_inter_node_link():
    plan = one_stage_plan(shard_node="n1")
    r = simulate_plan(plan, waves=2, cluster=two_node_cluster(), param_bytes=[2e8], apply_rate=1e9)
    tx = INTER_LAT + 2e8 / INTER_BW                 # 0.804 s each way
    assert r.makespan_s == pytest.approx(2 * 3.0 + tx + 0.2 + tx)


def test_plan_traffic_per_stage_and_shard():
    # One VW of two stages (n0.g0: layers 0-1, n1.g0: layer 2); shard 0 on n0 owns 0 and 2, shard 1 on n1 owns 1.
    vw = VirtualWorkerPlan(0, (StagePlan("n0.g0", "g", 0, 2, 1.0, 1.0), StagePlan("n1.g0", "g", 2, 3, 1.0, 1.0)))
    plan = Plan(num_layers=3, nm=1, d=0, policy="HD", virtual_workers=(vw,),
                ps_shards=(ShardPlan(0, "n0", (0, 2)), ShardPlan(1, "n1", (1,))))
    t = plan_traffic(plan, two_node_cluster(), [1e8, 3e8, 5e7], apply_rate=5e8)
    local0, remote1 = INTRA_LAT + 1e8 / INTRA_BW, INTER_LAT + 3e8 / INTER_BW
    remote2 = INTER_LAT + 5e7 / INTER_BW
    assert t[0][0] == (ShardTraffic(0, local0, 0.2, local0), ShardTraffic(1, remote1, 0.6, remote1))
    assert t[0][1] == (ShardTraffic(0, remote2, 0.1, remote2),)


def test_two_vws_queue_at_one_shard():
    # Two identical one-stage VWs, D = 0, 2 waves; push 0.1 s, apply 0.5 s, pull 0.1 s per VW.
    # Both push at t = 3: receives [3, 3.1) and [3.1, 3.2); applies [3.1, 3.6) and [3.6, 4.1);
    # both pulls are ready at 4.1 and are sent [4.1, 4.2) and [4.2, 4.3); wave 1 computes 3 s more.
    s = hetpipe_schedule(1, 2, 1, 0)
    c = vw_costs([1.0], [2.0], ps=[[ShardTraffic(0, 0.1, 0.5, 0.1)]])
    r = simulate([s, s], [c, c])
    assert r.finish_s == pytest.approx([7.2, 7.3])
    assert [vw[0].wsp_wait_s for vw in r.stages] == pytest.approx([1.1, 1.1])
    assert [vw[0].pull_s for vw in r.stages] == pytest.approx([0.1, 0.2])
    alone = simulate([s], [c])
    assert alone.makespan_s == pytest.approx(3.0 + 0.1 + 0.5 + 0.1 + 3.0)


def test_a_shard_slower_than_compute_sets_the_pace_under_staleness():
    # Two one-stage VWs of 1 s per minibatch, Nm = 1, D = 1; the shard takes 1 s to apply each push,
    # so it needs 2 s per wave for both VWs: the steady wave period is 2 s, not the VWs' 1 s.
    s = hetpipe_schedule(1, 40, 1, 1)
    c = vw_costs([0.5], [0.5], ps=[[ShardTraffic(0, 0.0, 1.0, 0.0)]])
    r = simulate([s, s], [c, c])
    assert r.steady_throughput(0, 10) == pytest.approx(0.5, rel=0.02)
    free = simulate([s, s], [vw_costs([0.5], [0.5])] * 2)
    assert free.steady_throughput(0, 10) == pytest.approx(1.0)


def test_staleness_hides_ps_time_shorter_than_a_wave():
    # Nm = 4 >= 4 stages, D = 1: the four stages' pushes and applies (4 x (0.05 + 0.075) s) take less
    # than a wave (4 x 1.5 s), so the steady throughput stays 1 / slowest stage, as without the PS
    # (a pull blocks its stage, so it is left out here); with D = 0 they are exposed every wave.
    s = hetpipe_schedule(4, 4 * 30, 4, 1)
    ps = [[ShardTraffic(0, 0.05, 0.075, 0.0)]] * 4
    r = simulate([s], [vw_costs([0.5] * 4, [1.0] * 4, ps=ps)])
    assert r.steady_throughput(0, 5) == pytest.approx(1 / 1.5, rel=1e-6)
    d0 = simulate([hetpipe_schedule(4, 4 * 30, 4, 0)], [vw_costs([0.5] * 4, [1.0] * 4, ps=ps)])
    assert d0.steady_throughput(0, 5) < 1 / 1.5 * 0.8


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_fixed_push_and_pull_seconds_must_be_finite_and_non_negative(bad):
    with pytest.raises(ValueError, match="push"):
        vw_costs([1.0], [1.0], push=bad)
    with pytest.raises(ValueError, match="pull"):
        vw_costs([1.0], [1.0], pull=[bad])
    with pytest.raises(ValueError, match="apply_s"):
        ShardTraffic(0, 0.1, bad, 0.1)


def test_apply_rate_and_layer_sizes_are_checked():
    plan = one_stage_plan()
    with pytest.raises(ValueError, match="apply rate"):
        plan_traffic(plan, two_node_cluster(), [1.0], apply_rate=0.0)
    with pytest.raises(ValueError, match="1 layers"):
        plan_traffic(plan, two_node_cluster(), [1.0, 2.0])
