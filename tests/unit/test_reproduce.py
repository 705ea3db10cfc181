"""`hetpipe reproduce` and `hetpipe simulate` with the PS modelled, on the shipped presets."""

import re

import pytest

from hetpipe.cli import main
from hetpipe.cluster import cluster_from_dict
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.reproduce import round_robin, remote_share


def test_round_robin_and_remote_share_by_hand():
    cluster = cluster_from_dict({
        "name": "two", "device_types": {"g": {"memory_bytes": 1 << 30, "speed": 1.0}},
        "nodes": [{"name": "n0", "type": "g", "count": 1}, {"name": "n1", "type": "g", "count": 1}],
        "intra_node": {"bandwidth": 1e9}, "inter_node": {"bandwidth": 1e8}})
    vw = VirtualWorkerPlan(0, (StagePlan("n0.g0", "g", 0, 2, 1.0, 1.0), StagePlan("n1.g0", "g", 2, 3, 1.0, 1.0)))
    plan = Plan(num_layers=3, nm=1, d=0, policy="ED", virtual_workers=(vw,),
                ps_shards=(ShardPlan(0, "n0", (0, 1)), ShardPlan(1, "n1", (2,))))
    pb = [1.0, 2.0, 4.0]
    assert remote_share(plan, cluster, pb) == 0.0
    rr = round_robin(plan, pb)
    assert [(s.layers, s.param_bytes) for s in rr.ps_shards] == [((0, 2), 5), ((1,), 2)]
    # layer 1 (2 B, on n0) now lives on n1, layer 2 (4 B, on n1) on n0: 6 of 7 bytes remote
    assert remote_share(rr, cluster, pb) == pytest.approx(6 / 7)


def test_reproduce_prints_the_table_and_a_verdict_per_finding(capsys):
    assert main(["reproduce", "--models", "resnet152,vgg19", "--nm", "4", "--d", "0,1,4", "--waves", "6"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("resnet152 ", "vgg19 "))]
    assert {(r[0], r[1]) for r in rows} == {(m, p) for m in ("resnet152", "vgg19") for p in ("NP", "ED", "HD", "ED-rr")}
    verdicts = re.findall(r"^(AGREES|DIFFERS) +(F\d)", out, re.M)
    assert sorted({f for _, f in verdicts}) == ["F1", "F2", "F3"]
    assert "modelled devices" in out


@pytest.mark.parametrize("flag,value", [("--d", "0,-1"), ("--nm", "2,x"), ("--waves", "1e9"), ("--models", "nope")])
def test_reproduce_rejects_bad_input_in_one_line(capsys, flag, value):
    assert main(["reproduce", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("hetpipe reproduce: ") and (flag in err or value in err), err


def test_simulate_models_the_ps_of_a_preset_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19", "--policy", "ED", "--nm", "4",
                 "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", str(path), "--waves", "4"]) == 0
    modelled = capsys.readouterr().out
    assert "PS shards: modelled" in modelled and "apply s" in modelled
    plan = Plan.load(path)
    assert main(["simulate", "--plan", str(path), "--waves", "4", "--ps-apply-rate", "1e12"]) == 0
    fast = capsys.readouterr().out

    def thr(text):
        return float(re.search(r"throughput ([0-9.]+) minibatches/s", text).group(1))

    # D = 0 exposes every wave's PS round trip: a faster apply must raise the throughput
    assert plan.d == 0 and thr(fast) > thr(modelled)
