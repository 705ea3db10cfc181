"""Discovery under real mpiexec, with several "hosts" on this machine (HETPIPE_HOST per rank) and
emulated device types (HETPIPE_EMULATE per rank): the world's own cluster, each type profiled on a
rank that holds it, and each rank running the part of the plan on its own device."""

import json
import re

import pytest

from mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

# Interleaved on purpose: the PS slot is world rank 0 and the hosts alternate, so that plan order and
# world order differ.
WORLD = {"HETPIPE_HOST": "hA,hB,hA,hB,hA", "HETPIPE_EMULATE": "ps,emu_slow,emu_fast,emu_slow,emu_fast"}


def test_auto_cluster_runs_each_stage_on_the_rank_holding_its_device_and_equals_replay(tmp_path):
    proc = run_mpi(5, "discovered_run.py", "auto", str(tmp_path / "cache"), env=WORLD)
    assert proc.returncode == 0, proc.stderr
    out = {r["world"]: r for r in results(proc)}
    assert sorted(out) == list(range(5))
    lead = next(r for r in out.values() if "plan" in r)
    plan = lead["plan"]
    assert lead["replay_equal"], "the discovered run differs from a one-process replay of its plan"
    # every stage runs on a rank of the host its device is on; the PS shard on the device-less rank
    for r in out.values():
        if "ps shard" in r["role"]:
            assert r["world"] == 0
            continue
        vw, stage = (int(x) for x in re.search(r"\(vw (\d+) stage (\d+) on ", r["role"]).groups())
        device = plan["virtual_workers"][vw]["stages"][stage]["device"]
        assert device.split(".")[0] == r["host"]
        assert r["role"].endswith(f" on {r['host']})")
    assert sorted(out[w]["role"].split()[1] for w in out) == [str(w) for w in range(5)]     # world ranks named
    assert "cluster 'discovered' (discovered): 4 device(s) on 2 node(s), 1 PS slot(s)" in proc.stderr
    saved = json.loads((tmp_path / "cache" / "cluster.json").read_text())
    assert [n["name"] for n in saved["nodes"]] == ["hB", "hA"] and saved["emulated"] is True
    profile = json.loads((tmp_path / "cache" / "profile.json").read_text())
    assert not any(any(layer["derived"].values()) for layer in profile["layers"])
    # The saved cluster goes back in as cluster= (matched onto the ranks by host) and reuses the cache.
    again = run_mpi(5, "discovered_run.py", str(tmp_path / "cache" / "cluster.json"), str(tmp_path / "cache"),
                    env=WORLD)
    assert again.returncode == 0, again.stderr
    assert "plan cache: reusing the cached plan" in again.stderr
    assert next(r for r in results(again) if "plan" in r)["losses"] == lead["losses"]


def test_each_emulated_type_is_profiled_on_its_holder_under_its_pacer():
    proc = run_mpi(3, "profile_types.py", env={"HETPIPE_EMULATE": "emu_fast,emu_slow,ps"})
    assert proc.returncode == 0, proc.stderr
    got = {r["type"]: r for r in results(proc)}
    assert sorted(got) == ["emu_fast", "emu_slow"]
    assert "emu_fast by rank 0, emu_slow by rank 1" in got["emu_fast"]["source"]
    for t, r in got.items():
        # The world's profile holds a measurement of the type (positive, not derived by speed ratio).
        assert not r["derived"] and r["profiled"] > 0, (t, r)
        # Under its pacer a layer's section lasts at least its host time / speed (the pacer sleeps until
        # then), so the paced figure is at least the host figure / speed; unpaced, at speed < 1, it would
        # be about the host figure. (Within rounding: both are sums of per-layer medians of clock differences.)
        assert r["speed"] < 1 and r["paced"] >= r["host"] / r["speed"] * (1 - 1e-6), (t, r)


@pytest.mark.parametrize("env, message", [
    ({"HETPIPE_EMULATE": "emu_fast,emu_fast"}, "PS shard 0 belongs on node .* no rank there is free"),
    ({"HETPIPE_EMULATE": "emu_fast,emu_zzz"}, "rank 1 .*unknown emulated type 'emu_zzz'"),
    ({"HETPIPE_EMULATE": "ps,ps"}, "none of the 2 rank"),
])
def test_bad_worlds_end_every_rank_with_one_line(env, message):
    import re

    proc = run_mpi(2, "discovered_run.py", "auto", env=env, timeout=120)
    assert proc.returncode != 0
    assert re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_cli_discovers_the_world_and_derives_unmeasured_types(tmp_path):
    import os
    import subprocess
    import sys

    from mpirun import mpiexec
    from hetpipe.plan.cluster import load_cluster
    from hetpipe.plan.profile import analytic_profile
    from hetpipe.plan.types import Plan

    # A profile measured on emu_fast only (modelled numbers standing in for a saved measurement).
    fast = load_cluster("cpu-emulated").device_types["emu_fast"]
    profile = analytic_profile("vgg19", {"emu_fast": type(fast)("emu_fast", fast.memory_bytes, 1.0, 1e9)})
    profile.save(tmp_path / "fast.json")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")},
           "HETPIPE_HOST": "hA,hA,hB,hB,hA", "HETPIPE_EMULATE": "emu_fast:speed=1:memory=64GiB,"
           "emu_fast:speed=1:memory=64GiB,emu_slow:speed=0.5:memory=64GiB,emu_slow:speed=0.5:memory=64GiB,ps"}
    proc = subprocess.run([mpiexec(), "-n", "5", sys.executable, "-m", "hetpipe.cli", "plan", "--cluster", "auto",
                           "--profile", str(tmp_path / "fast.json"), "--nm", "2", "-o", str(tmp_path / "plan.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("cluster 'discovered' (discovered)") == 1       # rank 0 reports, once
    assert "emu_slow derived by speed ratio from emu_fast" in proc.stdout
    cluster = load_cluster(str(tmp_path / "cluster.json"))
    assert cluster.nodes == ("hA", "hB") and cluster.device_types["emu_slow"].speed == 0.5
    plan = Plan.load(tmp_path / "plan.json")
    assert [sh.node for sh in plan.ps_shards] == ["hA"]
    assert plan.num_ranks == 5


def test_plan_cli_on_emulated_ranks_with_an_analytic_preset_says_what_to_give(tmp_path):
    import os
    import subprocess
    import sys

    from mpirun import mpiexec

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")},
           "HETPIPE_EMULATE": "emu_fast,emu_slow,ps"}
    proc = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-m", "hetpipe.cli", "plan", "--cluster", "auto",
                           "--profile", "vgg19"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.count("hetpipe plan: profile 'vgg19' is analytic") == 1, proc.stderr
    assert "give a profile measured on this host instead" in proc.stderr
