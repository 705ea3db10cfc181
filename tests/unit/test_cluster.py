"""Cluster specs: presets, file loading, links, and clear errors for malformed specs."""

import json

import pytest

from hetpipe.plan.cluster import ClusterSpec, load_cluster, presets


def test_presets():
    assert {"hetpipe-testbed", "cpu-emulated", "cpu-emulated-6"} <= set(presets())
    tb = load_cluster("hetpipe-testbed")
    assert len(tb.devices) == 16 and tb.nodes == ("n0", "n1", "n2", "n3")
    assert {d.type for d in tb.devices_of("n2")} == {"rtx2060"}
    assert tb.device_types["titan_v"].memory_bytes == 12 * 2**30
    assert tb.device_types["titan_rtx"].speed > tb.device_types["titan_v"].speed > tb.device_types["rtx2060"].speed
    assert not tb.emulated
    emu = load_cluster("cpu-emulated")
    assert emu.emulated and len(emu.devices) == 4 and len(emu.nodes) == 2 and len(emu.device_types) >= 2
    assert all(t.speed < 1 for t in emu.device_types.values())     # slower than the host
    six = load_cluster("cpu-emulated-6")
    assert len(six.devices) >= 6 and len(six.device_types) == 3


def test_links():
    tb = load_cluster("hetpipe-testbed")
    assert tb.link("n0.g0", "n0.g1") == (tb.intra_node.bandwidth, tb.intra_node.latency)
    assert tb.link("n0.g0", "n3.g1") == (7e9, tb.inter_node.latency)
    assert tb.intra_node.time(0) == 0.0


def test_round_trip_through_dict_and_file(tmp_path):
    tb = load_cluster("hetpipe-testbed")
    again = load_cluster(json.loads(tb.to_json()))
    assert again == tb
    path = tmp_path / "c.json"
    path.write_text(tb.to_json())
    assert load_cluster(str(path)) == tb
    assert load_cluster(tb) is tb


def base():
    return {"name": "x", "device_types": {"g": {"memory_bytes": 100, "speed": 1.0}},
            "nodes": [{"name": "n0", "devices": ["g"]}],
            "intra_node": {"bandwidth": 1e9}, "inter_node": {"bandwidth": 1e8, "latency": 1e-5}}


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(nodes=[]), "no nodes"),
    (lambda d: d["nodes"][0].update(devices=[]), "no devices"),
    (lambda d: d["nodes"][0].update(devices=["g", "h100"]), r"device n0\.g1 has unknown device type 'h100'"),
    (lambda d: d["device_types"]["g"].update(memory_bytes=-1), r"device type 'g': memory_bytes must be > 0"),
    (lambda d: d["device_types"]["g"].pop("speed"), r"device type 'g': needs speed or peak_flops"),
    (lambda d: d["device_types"]["g"].update(colour=1), r"unknown field\(s\) \['colour'\]"),
    (lambda d: d.pop("inter_node"), "missing inter_node"),
    (lambda d: d["intra_node"].update(bandwidth=0), r"intra_node\.bandwidth must be > 0"),
    (lambda d: d["nodes"].append({"name": "n1", "type": "g", "count": 0}), "count must be an integer >= 1"),
])
def test_malformed_specs_name_the_culprit(change, message):
    d = base()
    change(d)
    with pytest.raises(ValueError, match=message):
        load_cluster(d)


def test_bad_names_and_files(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        load_cluster("no-such-cluster")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_cluster(str(bad))
    with pytest.raises(ValueError, match="no such file"):
        load_cluster(str(tmp_path / "missing.json"))


def test_empty_cluster_object():
    with pytest.raises(ValueError, match="no devices"):
        ClusterSpec("e", {}, (), None, None)
