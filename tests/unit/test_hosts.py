"""Host lists of `hetpipe launch` (hostfile, -H, Slurm), the host of each rank, mpiexec's host file, and
which ranks watch the launcher's pid (hetpipe.launch.hosts, hetpipe.job.guard, hetpipe.job.placement)."""

import pytest

from hetpipe.job import guard
from hetpipe.job.placement import placement_problems, plan_problems
from hetpipe.launch.hosts import (HostsError, Placement, by_plan, choose, expand_nodelist, expand_tasks, fill,
                                  from_slurm, machinefile, parse_hostfile, parse_hosts)
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan


def test_hostfile_forms_and_errors(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the lab\na100-box:2\nrtx-box slots=4  # four 3090s\n\nps-box\na100-box:1\n")
    slots = parse_hostfile(str(f))
    assert slots.hosts == (("a100-box", 3), ("rtx-box", 4), ("ps-box", 1)) and slots.total == 8
    f.write_text("good:2\nbad host here\n")
    with pytest.raises(HostsError, match=f"hostfile {f}, line 2: 'bad host here' is not host"):
        parse_hostfile(str(f))
    f.write_text("")
    with pytest.raises(HostsError, match="names no host"):
        parse_hostfile(str(f))
    f.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(HostsError, match="is not a text file"):
        parse_hostfile(str(f))
    assert parse_hosts("a:2,b").hosts == (("a", 2), ("b", 1))
    with pytest.raises(HostsError, match="the slots of a must be an integer >= 1, got '0'"):
        parse_hosts("a:0")
    with pytest.raises(HostsError, match="not both"):
        choose(str(f), "a:1", {})


def test_localhost_is_this_machine(tmp_path):
    import socket

    here = socket.gethostname()
    f = tmp_path / "hosts"
    f.write_text("localhost slots=2\n127.0.0.1:1\nLOCALHOST\nother-box:2\n")
    slots = parse_hostfile(str(f))
    # the name each rank reports, so placement and a plan's nodes match it
    assert slots.hosts == ((here, 4), ("other-box", 2))
    assert parse_hosts("localhost").hosts == ((here, 1),)
    assert placement_problems([here, here], fill(parse_hosts("localhost:2"), 2)) == []


def test_slurm_allocation():
    assert expand_nodelist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert expand_nodelist("node[8-10]") == ["node8", "node9", "node10"]
    assert expand_tasks("2(x3),1", 4) == [2, 2, 2, 1]
    with pytest.raises(HostsError, match="gives 2 counts for 3 nodes"):
        expand_tasks("2,1", 3)
    env = {"SLURM_JOB_NODELIST": "a[1-2],b", "SLURM_TASKS_PER_NODE": "3(x2),5"}
    slots = from_slurm(env)
    assert slots.hosts == (("a1", 3), ("a2", 3), ("b", 5)) and "Slurm" in slots.source
    assert choose(None, None, env) == slots
    assert choose(None, None, {}) is None


def test_fill_and_plan_placement_and_machinefiles():
    slots = parse_hosts("a:2,b:3")
    assert fill(slots, 4) == ["a", "a", "b", "b"]
    with pytest.raises(HostsError, match=r"-H a:2,b:3 has 5 slot\(s\) \(a:2, b:3\) but the run needs 6 ranks"):
        fill(slots, 6)
    assert by_plan(slots, ["b", "a", "b"]) == ["b", "a", "b"]
    with pytest.raises(HostsError, match="the plan puts 3 rank.* on node a but -H a:2,b:3 gives it 2 slot"):
        by_plan(slots, ["a", "a", "a"])
    with pytest.raises(HostsError, match="node c, which -H a:2,b:3 does not list"):
        by_plan(slots, ["c"])
    assert machinefile(["b", "a", "a", "b"], "mpich") == "b:1\na:2\nb:1\n"
    assert machinefile(["b", "a", "a"], "openmpi") == "b\na\na\n"
    with pytest.raises(HostsError, match="the plan has 2 ranks but -n is 3"):
        Placement(slots, plan_nodes=("a", "b")).rank_hosts(3)


def test_emulated_placement_sets_the_ranks_hosts(tmp_path):
    env = {}
    assert Placement(parse_hosts("a:1,b:2"), emulate=True).apply(3, str(tmp_path), "mpiexec", env) == []
    assert env["HETPIPE_HOST"] == "a,b,b" and env["HETPIPE_LAUNCHER_HOST"] == "a"
    assert (tmp_path / "placement.json").exists()


def test_only_ranks_on_the_launchers_host_watch_its_pid(monkeypatch):
    monkeypatch.delenv(guard.LAUNCHER_PID_ENV, raising=False)
    assert not guard.watches("a")
    monkeypatch.setenv(guard.LAUNCHER_PID_ENV, "123")
    monkeypatch.setenv(guard.LAUNCHER_HOST_ENV, "a")
    assert guard.watches("a") and guard.watches("")
    assert not guard.watches("b")


def test_rank_placement_checks():
    assert placement_problems(["a", "b"], None) == []
    assert placement_problems(["a", "c"], ["a", "b"]) == ["rank 1 runs on host c but the launcher placed it on b"]
    stages = (StagePlan("n0.g0", "t", 0, 2, 0.0, 0.0), StagePlan("n1.g0", "t", 2, 4, 0.0, 0.0))
    plan = Plan(4, 1, 0, "manual", (VirtualWorkerPlan(0, stages),), (ShardPlan(0, "n1", (0, 1, 2, 3)),))
    assert plan_problems(plan, ["x", "x", "x"], str) == []          # one host: nodes emulated on it
    assert plan_problems(plan, ["n0", "n1", "n1"], str) == []
    assert plan_problems(plan, ["n1", "n0", "n1"], lambda r: f"rank {r}") == [
        "rank 0 runs on host n1 but the plan puts it on node n0", "rank 1 runs on host n0 but the plan puts it on node n1"]
