"""Multi-node launch tested on one machine: `hetpipe launch --emulate-hosts` runs every rank here, each
counting as the host the host list gives it (HETPIPE_HOST), so placement, the start-up checks and the
supervision of ranks "on other hosts" run for real under mpiexec. What needs a real second node (ssh
or Slurm start-up, a host that vanishes from the network) is listed in docs/clusters.md."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from mpirun import SCRIPTS
from test_faults import Run
from hetpipe.run.config import Planning

pytestmark = [pytest.mark.mpi, pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux >= 5.3)")]


def _launch(*args, timeout=600, extra=None):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}, **(extra or {})}
    return subprocess.run([sys.executable, "-m", "hetpipe.cli", "launch", *args], cwd=SCRIPTS, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def emulated_plan(tmp_path_factory):
    """The cpu-emulated plan of the test model: its ranks on nodes n0 and n1."""
    sys.path.insert(0, str(SCRIPTS))
    from common import cross_entropy, mlp, sgd, synthetic

    from hetpipe.run.trainer import Trainer

    plan = Trainer(mlp(), cross_entropy, sgd(), synthetic(n=256),
                   planning=Planning(cluster="cpu-emulated", nm=2, d=0)).resolve_plan()
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return path, plan


def test_plan_placement_on_two_hosts_runs_and_records_where_each_rank_ran(tmp_path, emulated_plan):
    path, plan = emulated_plan
    per_node = {n: sum(1 for r in range(plan.num_ranks) if _node(plan, r) == n) for n in ("n0", "n1")}
    proc = _launch("--emulate-hosts", "-H", f"n0:{per_node['n0']},n1:{per_node['n1']}", "--plan", str(path),
                   "--run-dir", str(tmp_path / "run"), "plan_cache_run.py", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    placed = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert placed["hosts"] == [_node(plan, r) for r in range(plan.num_ranks)]
    ran = json.loads((tmp_path / "out" / "result.json").read_text())
    assert ran["plan"]["virtual_workers"] == json.loads(path.read_text())["virtual_workers"]


def _node(plan, r):
    from hetpipe.job.placement import node_of

    return node_of(plan, r)


def test_a_rank_on_the_wrong_node_is_named_before_anything_starts(tmp_path, emulated_plan):
    path, plan = emulated_plan
    # Fill order instead of the plan's: whatever the plan, some rank lands on the other node.
    wrong = ["n1" if _node(plan, r) == "n0" else "n0" for r in range(plan.num_ranks)]
    hosts = ",".join(f"{h}:1" for h in wrong)
    proc = _launch("--emulate-hosts", "-H", hosts, "-n", str(plan.num_ranks), "--run-dir", str(tmp_path / "run"),
                   "plan_cache_run.py", str(tmp_path / "out"), str(path))
    assert proc.returncode != 0
    assert f"rank 0 (vw 0 stage 0 on {wrong[0]}) runs on host {wrong[0]} but the plan puts it on node " \
           f"{_node(plan, 0)}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("line", ["localhost slots={n}", "127.0.0.1"])
def test_a_hostfile_naming_localhost_runs_here(tmp_path, emulated_plan, line):
    path, plan = emulated_plan
    hosts = tmp_path / "hosts"
    n = plan.num_ranks
    hosts.write_text(line.format(n=n) + "\n" if "slots" in line else f"{line}\n" * n)
    proc = _launch("--hostfile", str(hosts), "-n", str(n), "--run-dir", str(tmp_path / "run"),
                   "plan_cache_run.py", str(tmp_path / "out"), str(path))
    assert proc.returncode == 0, proc.stderr
    placed = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert set(placed["hosts"]) == {socket.gethostname()}
    assert json.loads((tmp_path / "out" / "result.json").read_text())["losses"]


@pytest.mark.parametrize("args, message", [
    (["-H", "n0:2,n1:1", "-n", "6"], "-H n0:2,n1:1 has 3 slot(s) (n0:2, n1:1) but the run needs 6 ranks"),
    (["--hostfile", "missing-hosts.txt", "-n", "2"], "hostfile missing-hosts.txt: cannot read it"),
    (["-H", "n0:zero", "-n", "1"], "the slots of n0 must be an integer >= 1, got 'zero'"),
    (["--emulate-hosts", "-n", "2"], "--emulate-hosts needs the hosts"),
])
def test_bad_host_lists_are_one_line_and_start_nothing(tmp_path, args, message):
    proc = _launch(*args, "--run-dir", str(tmp_path / "run"), "plan_cache_run.py", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_host_whose_ranks_vanish_is_named_and_nothing_survives(tmp_path):
    # endless.py: stages on bare CPUs (ranks 0, 1, no node), the PS shard on node n0 (rank 2), alone on
    # its "host"; the launcher counts as hA and cannot watch rank 2 by pid.
    run = Run(tmp_path, "--emulate-hosts", "-H", "hA:2,n0:1", "endless.py", str(tmp_path / "metrics.jsonl"))
    try:
        run.wait_training()
        hosts = {r: (run.run_dir / f"rank-{r}.txt").read_text().splitlines()[2] for r in range(3)}
        assert hosts == {0: "hA", 1: "hA", 2: "n0"}
        since = time.monotonic()
        os.kill(run.pid_of("rank2"), signal.SIGKILL)
        run.wait_gone(since)
        outcome = run.outcome()
        assert outcome["status"] == "failed"
        assert "rank(s) [2] on host n0 ended without a word" in outcome["message"], outcome
    finally:
        run.clean_up()


def test_a_discovered_world_names_the_failed_device_and_does_not_restart_without_it(tmp_path):
    # hA (the launcher's host): world rank 0 a PS slot, ranks 1, 2 emu_fast; hB: ranks 3, 4 emu_slow. The
    # PS slot comes first, so plan ranks and world ranks differ: the launcher must map the killed world
    # rank to its own device, and say that a restart cannot leave it out yet.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")},
           "HETPIPE_EMULATE": "ps,emu_fast,emu_fast,emu_slow,emu_slow"}
    run_dir, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "hetpipe.cli", "launch", "-n", "5", "--max-restarts", "1",
                             "--emulate-hosts", "-H", "hA:3,hB:2", "--timeout", "4", "--run-dir", str(run_dir),
                             "discovered_endless.py", str(metrics)],
                            cwd=SCRIPTS, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        attempt = run_dir / "attempt-0"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1 and (attempt / "world_ranks.json").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        order = json.loads((attempt / "world_ranks.json").read_text())
        plan = json.loads((attempt / "plan.json").read_text())
        assert order != sorted(order)
        stages = [(v, s) for v, vw in enumerate(plan["virtual_workers"]) for s in range(len(vw["stages"]))]
        p = next(p for p, _ in enumerate(stages) if order[p] in (1, 2))     # a stage on the launcher's host
        v, s = stages[p]
        device = plan["virtual_workers"][v]["stages"][s]["device"]
        os.kill(int((attempt / f"rank-{order[p]}.txt").read_text().split()[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert f"failed on device {device} of a world planned on its discovered devices" in err, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
