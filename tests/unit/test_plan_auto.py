"""`hetpipe plan --cluster auto` run as one process (not under mpiexec): it describes the world
`hetpipe launch` would start on this host (hetpipe.job.inventory.host_ranks)."""

import os
import subprocess
import sys

import pytest

from hetpipe.job.inventory import host_ranks, local_gpus
from hetpipe.plan.cluster import load_cluster
from hetpipe.plan.profile import LayerProfile, ModelProfile
from hetpipe.plan.types import Plan


def _plan(tmp_path, *args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HETPIPE_", "PMI_", "OMPI_", "MPI_"))}
    return subprocess.run([sys.executable, "-m", "hetpipe.cli", "plan", "--cluster", "auto", *args],
                          cwd=tmp_path, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=120)


def test_host_ranks_counts_the_lists_or_the_gpus(monkeypatch):
    for k in ("HETPIPE_EMULATE", "HETPIPE_HOST"):
        monkeypatch.delenv(k, raising=False)
    assert host_ranks() == max(1, len(local_gpus()))
    monkeypatch.setenv("HETPIPE_EMULATE", "emu_fast")
    assert host_ranks() == 1
    monkeypatch.setenv("HETPIPE_HOST", "hA,hA,hB")
    assert host_ranks() == 3
    monkeypatch.setenv("HETPIPE_EMULATE", "emu_fast,ps")
    assert host_ranks() == 2


def test_one_process_plans_on_the_emulated_world_it_describes(tmp_path):
    # a profile measured on both emulated types (numbers standing in for a saved measurement)
    types = ("emu_fast", "emu_slow")
    ModelProfile("toy", 16, [LayerProfile(f"l{i}", {t: 0.001 * (1 + k) for k, t in enumerate(types)},
                                          {t: 0.002 * (1 + k) for k, t in enumerate(types)},
                                          activation_bytes=1000, param_bytes=1000, optimizer_bytes=1000)
                             for i in range(6)]).save(tmp_path / "toy.json")
    env = {"HETPIPE_EMULATE": "emu_fast,emu_fast,ps,emu_slow,emu_slow,ps", "HETPIPE_HOST": "hA,hA,hA,hB,hB,hB"}
    proc = _plan(tmp_path, "--profile", "toy.json", "--nm", "2", "-o", "plan.json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "cluster 'discovered' (discovered): 4 device(s) on 2 node(s), 2 PS slot(s)" in proc.stdout
    cluster = load_cluster(str(tmp_path / "cluster.json"))
    assert cluster.emulated and [(d.id, d.type) for d in cluster.devices] == [
        ("hA.g0", "emu_fast"), ("hA.g1", "emu_fast"), ("hB.g0", "emu_slow"), ("hB.g1", "emu_slow")]
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.num_ranks == 6 and sorted(sh.node for sh in plan.ps_shards) == ["hA", "hB"]
    # an analytic preset needs peak FLOP/s, which emulated types lack: one line saying what to give instead
    proc = _plan(tmp_path, "--profile", "gpt", env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "give a profile measured on this host instead" in proc.stderr, proc.stderr


@pytest.mark.skipif(bool(local_gpus()), reason="this host shows GPUs")
def test_a_cpu_only_host_without_emulation_says_what_to_do(tmp_path):
    proc = _plan(tmp_path, "--profile", "vgg19")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("hetpipe plan: --cluster auto: this host shows no GPU (nvidia-smi) and "
                                   "HETPIPE_EMULATE is not set: set it (e.g. HETPIPE_EMULATE=emu_fast,emu_slow), "
                                   "run under mpiexec on GPU hosts, or give --cluster a preset or a cluster JSON file")
    assert not (tmp_path / "cluster.json").exists()
