"""Restart by re-planning (launch/restart.py): the planner runs again on the cluster without the failed
devices, and the new plan names the surviving devices by their own ids (a GPU stays the GPU it was)."""

import pytest

from hetpipe.launch.restart import replan
from hetpipe.plan import make_plan
from hetpipe.plan.cluster import load_cluster
from hetpipe.plan.profile import load_profile


def _planning():
    cluster, profile = load_cluster("hetpipe-testbed"), load_profile("resnet152")
    planning = {"cluster": cluster.to_dict(), "profile": profile.to_dict(), "policy": "ED", "nm": 4, "d": 0,
                "minibatch_size": 32, "precision": "fp32"}
    return make_plan(cluster, profile, policy="ED", nm=4, d=0, minibatch_size=32), planning


def test_the_survivors_keep_their_device_ids():
    plan, planning = _planning()
    new = replan(plan, ["n0.g0", "n2.g3"], planning)
    devices = {st.device for vw in new.virtual_workers for st in vw.stages}
    everyone = {st.device for vw in plan.virtual_workers for st in vw.stages}
    assert devices <= everyone - {"n0.g0", "n2.g3"}
    assert {"n0.g1", "n0.g2", "n0.g3", "n2.g0"} & devices            # not renumbered down to n0.g0
    assert new.meta["replanned_without"] == ["n0.g0", "n2.g3"] and new.throughput > 0


def test_nothing_left_is_named():
    plan, planning = _planning()
    everyone = [st.device for vw in plan.virtual_workers for st in vw.stages]
    with pytest.raises(ValueError, match="no device of the cluster is left"):
        replan(plan, everyone, planning)


def test_a_later_attempt_re_plans_with_the_run_s_planning_inputs(tmp_path):
    """Attempt 2 resumed a re-planned plan and planned nothing itself (no planning.json of its own): a
    device it loses is still planned around, with attempt 0's inputs, every device failed so far left out."""
    import json

    from hetpipe.launch.restart import _next_plan

    plan, planning = _planning()
    for k in range(3):
        (tmp_path / f"attempt-{k}").mkdir()
    (tmp_path / "attempt-0" / "planning.json").write_text(json.dumps(planning))
    new, how = _next_plan(plan, {"n0.g0", "n2.g3"}, tmp_path / "attempt-2")
    assert how.startswith("re-planned the ") and new.meta["replanned_without"] == ["n0.g0", "n2.g3"]
    assert not {"n0.g0", "n2.g3"} & {st.device for vw in new.virtual_workers for st in vw.stages}
    (tmp_path / "attempt-0" / "planning.json").unlink()
    _, how = _next_plan(plan, {"n0.g0"}, tmp_path / "attempt-2")
    assert how.startswith("dropped the VW(s) that held them (the run saved no planning inputs")


def test_a_plan_without_a_failed_device_still_formats():
    """plan_without records what it left out as the planner does, so the plan prints (it raised before)."""
    from hetpipe.launch.restart import plan_without
    from hetpipe.plan.format import format_plan

    plan, _ = _planning()
    dev = plan.virtual_workers[0].stages[0].device
    new = plan_without(plan, [dev])
    assert new.meta["left_out"] == [{"devices": list(plan.virtual_workers[0].devices),
                                     "reason": f"device(s) {[dev]} failed"}]
    assert dev in format_plan(new)


def test_a_plan_for_time_to_accuracy_is_re_planned_for_it():
    """The restart keeps the objective the plan was made for, with its noise scale: the same choice as
    make_plan makes on the surviving devices for that objective."""
    cluster, profile = load_cluster("hetpipe-testbed"), load_profile("resnet152")
    planning = {"cluster": cluster.to_dict(), "profile": profile.to_dict(), "policy": "auto", "nm": None, "d": 0,
                "minibatch_size": 32, "precision": "fp32"}
    plan = make_plan(cluster, profile, minibatch_size=32, objective="time-to-accuracy", noise_scale=50.0)
    gone = plan.virtual_workers[0].stages[0].device
    new = replan(plan, [gone], planning)
    assert new.meta["objective"] == "time-to-accuracy"
    assert new.meta["time_to_accuracy"]["noise_scale"] == 50.0
    assert gone not in {st.device for vw in new.virtual_workers for st in vw.stages}


def test_a_plan_with_waves_by_speed_is_re_planned_with_them():
    """NP on the testbed: VWs of one GPU type each, about 3x apart in speed. Without one device the new
    plan's waves follow the new VWs' speed, as make_plan gives them on the surviving devices."""
    cluster, profile = load_cluster("hetpipe-testbed"), load_profile("vgg19")
    planning = {"cluster": cluster.to_dict(), "profile": profile.to_dict(), "policy": "NP", "nm": None, "d": 0,
                "minibatch_size": 32, "precision": "fp32"}
    plan = make_plan(cluster, profile, policy="NP", minibatch_size=32, waves="speed")
    assert not plan.equal_waves
    new = replan(plan, ["n3.g3"], planning)
    assert new.meta["waves"]["rule"] == "speed"
    want = make_plan(cluster.to_dict() | {"nodes": new_nodes(cluster, "n3.g3")}, profile, policy="NP",
                     minibatch_size=32, waves="speed")
    assert new.wave_minibatches == want.wave_minibatches and not new.equal_waves


def new_nodes(cluster, gone):
    """The cluster's nodes (JSON data) without the device ``gone``."""
    out = []
    for node in cluster.to_dict()["nodes"]:
        kept = [t for j, t in enumerate(node["devices"]) if f"{node['name']}.g{j}" != gone]
        if kept:
            out.append({"name": node["name"], "devices": kept})
    return out
