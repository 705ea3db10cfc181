"""Bad input to the planner: one line naming the culprit, at once (cluster specs, profiles, plans, make_plan, CLI)."""

import json

import pytest

from hetpipe.cli import main
from hetpipe.plan.cluster import load_cluster
from hetpipe.plan import Plan, make_plan
from hetpipe.plan.profile import load_profile


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def spec(**over):
    base = {"name": "c", "device_types": {"titan_v": {"memory_bytes": 12884901888, "peak_flops": 14.9e12}},
            "nodes": [{"name": "n0", "type": "titan_v", "count": 2}],
            "intra_node": {"bandwidth": 15.75e9, "latency": 1e-5}, "inter_node": {"bandwidth": 7e9}}
    base.update(over)
    return base


@pytest.mark.parametrize("where,value,culprit", [
    ("intra_node", {"bandwidth": float("nan")}, r"intra_node\.bandwidth must be a finite number, got nan"),
    ("inter_node", {"bandwidth": 7e9, "latency": float("inf")}, r"inter_node\.latency must be a finite number"),
    ("device_types", {"titan_v": {"memory_bytes": 1e10, "speed": float("nan")}},
     r"device type 'titan_v': speed must be a finite number, got nan"),
    ("device_types", {"titan_v": {"memory_bytes": float("inf"), "peak_flops": 1e13}},
     r"device type 'titan_v': memory_bytes must be a finite number, got inf"),
    ("device_types", {"titan_v": {"memory_bytes": 0.5, "peak_flops": 1e13}},
     r"device type 'titan_v': memory_bytes must be at least 1 byte"),
])
def test_cluster_numbers_must_be_finite(where, value, culprit):
    with pytest.raises(ValueError, match=culprit) as e:
        load_cluster(spec(**{where: value}))
    one_line(e)


def test_cluster_file_with_infinity_and_nan(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(spec()).replace("12884901888", "Infinity"))
    with pytest.raises(ValueError, match="memory_bytes must be a finite number, got inf"):
        load_cluster(p)
    p.write_text(json.dumps(spec()).replace("15750000000.0", "NaN"))
    with pytest.raises(ValueError, match=r"intra_node\.bandwidth must be a finite number, got nan"):
        load_cluster(p)


@pytest.mark.parametrize("kwargs,culprit", [
    ({"nm": 2.5}, "nm must be an integer, got 2.5"),
    ({"nm": True}, "nm must be an integer, got True"),
    ({"d": 1.5}, "d must be an integer, got 1.5"),
    ({"d": "1"}, "d must be an integer, got '1'"),
    ({"nm": 10**9}, "nm must be <= 1024, got 1000000000"),
    ({"max_nm": 4.0}, "max_nm must be an integer"),
    ({"num_ps_shards": 10**6}, r"num_ps_shards must be <= 19 \(a shard owns whole layers"),
    ({"num_ps_shards": 0}, "num_ps_shards must be >= 1"),
    ({"vw_size": 10**6}, "vw_size must be <= 19"),
    ({"horizon": 0.5}, "horizon must be an integer"),
])
def test_make_plan_arguments(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit) as e:
        make_plan("hetpipe-testbed", "vgg19", **kwargs)
    one_line(e)


def test_node_with_more_devices_than_layers_plans():
    # 2000 GPUs on one node, 19 layers: VWs of at most one stage per layer, planned at once
    plan = make_plan(spec(nodes=[{"name": "n0", "type": "titan_v", "count": 2000}]), "vgg19", policy="NP", nm=2)
    assert all(len(vw.stages) <= 19 for vw in plan.virtual_workers)
    assert sum(len(vw.stages) for vw in plan.virtual_workers) == 2000


def plan_dict():
    return json.loads(make_plan("hetpipe-testbed", "vgg19", policy="ED", nm=2).to_json())


@pytest.mark.parametrize("edit,culprit", [
    (lambda d: d.update(nm=2.5), "plan: nm must be an integer, got 2.5"),
    (lambda d: d.update(d="1"), "plan: d must be an integer, got '1'"),
    (lambda d: d.update(nm=10**9), "plan: nm must be <= 1024"),
    (lambda d: d["virtual_workers"][1].update(index=5), "virtual worker at position 1 has index 5"),
    (lambda d: d["ps_shards"][0].update(index=3), "PS shard at position 0 has index 3"),
    (lambda d: d.update(ps_shards=[]), "4 virtual workers but no PS shards"),
    (lambda d: d["virtual_workers"][0]["stages"][0].update(stop=2.5), r"VW 0 stage 0 on \S+: stop must be an integer"),
])
def test_plan_file_checks(edit, culprit):
    d = plan_dict()
    edit(d)
    with pytest.raises(ValueError, match=culprit) as e:
        Plan.from_dict(d)
    one_line(e)


@pytest.mark.parametrize("edit,culprit", [
    (lambda p: p.update(minibatch_size="32"), "minibatch_size must be an integer >= 0, got '32'"),
    (lambda p: p.update(minibatch_size=2.5), "minibatch_size must be an integer >= 0, got 2.5"),
    (lambda p: p.update(input_bytes=float("nan")), "input_bytes must be an integer >= 0, got nan"),
    (lambda p: p["layers"][3].update(flops="abc"), r"layer 3 \('conv2_2'\): flops must be a finite number"),
    (lambda p: p["layers"][0].update(derived="yes"), r"layer 0 \('conv1_1'\): derived must be an object"),
])
def test_profile_top_level_fields(edit, culprit):
    p = load_profile("vgg19").to_dict()
    edit(p)
    with pytest.raises(ValueError, match=culprit) as e:
        load_profile(p)
    one_line(e)


@pytest.mark.parametrize("args,culprit", [
    (["--nm", "1000000000"], "hetpipe plan: make_plan: nm must be <= 1024, got 1000000000"),
    (["--ps-shards", "1000000"], "hetpipe plan: make_plan: num_ps_shards must be <= 19"),
])
def test_cli_plan_bad_numbers(args, culprit, capsys):
    assert main(["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19"] + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(culprit) and "\n" not in err


@pytest.mark.parametrize("args, culprit", [
    (["--nm", "1e9"], "argument --nm: --nm must be a whole number >= 1, got '1e9'"),
    (["--d", "-1"], "argument --d: --d must be a whole number >= 0, got -1"),
])
def test_cli_plan_numbers_argparse_refuses(args, culprit, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19", *args])
    assert e.value.code == 2
    assert culprit in capsys.readouterr().err
