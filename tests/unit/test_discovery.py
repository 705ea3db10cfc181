"""Discovery: the cluster built from what ranks report, a given cluster matched onto them, the ranks
given the parts of a plan, and the per-rank environment (hetpipe.job.inventory, hetpipe.job.discovery)."""

import os
from pathlib import Path

import pytest

from hetpipe.job.discovery import DiscoveryError, assign_ranks, discover, gpu_type_name, match, peak_fp32
from hetpipe.job.inventory import (EMULATE_ENV, HOST_ENV, emulated_type, gpu_identity, host_name, normal_uuid,
                                   parse_gpu_query, parse_topology, rank_facts, visible_gpus)
from hetpipe.plan import make_plan
from hetpipe.plan.cluster import cluster_from_dict, load_cluster
from hetpipe.plan.profile import analytic_profile

TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tPIX\tSYS\t0-15\t0
GPU1\tNV12\t X \tPXB\tSYS\t0-15\t0
GPU2\tPIX\tPXB\t X \tNODE\t16-31\t1
GPU3\tSYS\tSYS\tNODE\t X \t16-31\t1

Legend:
  X    = Self
"""


def gpu(index, name="NVIDIA A100-SXM4-40GB", mib=40960):
    return {"index": index, "name": name, "memory_bytes": mib << 20, "compute_capability": "8.0",
            "bus_id": f"0000:{index:02x}:00.0"}


def fact(rank, host, gpus=(), emulate=None, links=()):
    return {"rank": rank, "pid": 100 + rank, "host": host, "error": "", "emulate": emulate, "gpus": list(gpus),
            "links": [list(x) for x in links]}


def lab_world():
    """A lab of mixed GPUs: 2 A100-40GB on node a (NVLink), 4 RTX 3090 on node b (PCIe), one rank
    beyond the GPUs on each node (PS slots)."""
    a = [gpu(0), gpu(1)]
    b = [gpu(i, "NVIDIA GeForce RTX 3090", 24576) for i in range(4)]
    links_b = [(i, j, "pcie") for i in range(4) for j in range(i + 1, 4)]
    return ([fact(r, "a", a, links=[(0, 1, "nvlink")]) for r in range(3)]
            + [fact(3 + r, "b", b, links=links_b) for r in range(5)])


def test_topology_kinds_by_position():
    kinds = parse_topology(TOPO, [0, 1, 2, 3])
    assert kinds == {(0, 1): "nvlink", (0, 2): "pcie", (0, 3): "pcie", (1, 2): "pcie", (1, 3): "pcie",
                     (2, 3): "pcie"}
    # CUDA_VISIBLE_DEVICES=3,1: positions follow the visible order
    assert parse_topology(TOPO, [3, 1]) == {(0, 1): "pcie"}


def test_gpu_names_and_peaks():
    assert gpu_type_name("NVIDIA A100-SXM4-40GB") == "a100_sxm4_40gb"
    assert gpu_type_name("NVIDIA GeForce RTX 3090") == "rtx_3090"
    assert peak_fp32("NVIDIA GeForce RTX 3090") == 35.6e12
    assert peak_fp32("NVIDIA H100 80GB HBM3") == 67e12
    assert peak_fp32("Some New Accelerator") == 0.0


def test_discover_real_cluster():
    d = discover(lab_world())
    c = d.cluster
    assert c.nodes == ("a", "b")
    assert [x.id for x in c.devices] == ["a.g0", "a.g1", "b.g0", "b.g1", "b.g2", "b.g3"]
    assert c.device_types["a100_sxm4_40gb"].memory_bytes == 40960 << 20
    assert c.device_types["rtx_3090"].peak_flops == 35.6e12
    assert "compute capability 8.0" in c.device_types["a100_sxm4_40gb"].hardware
    assert [h.rank for h in d.ps_slots()] == [2, 7]
    assert d.holder_of("b.g2").rank == 5 and d.holder_of("b.g2").gpu == 2
    assert d.links["a.g0|a.g1"] == "nvlink" and d.links["b.g0|b.g3"] == "pcie"
    assert c.intra_node.bandwidth == 12e9          # node b has PCIe only: the slowest intra-node link
    assert d.type_holders() == {"a100_sxm4_40gb": [0, 1], "rtx_3090": [3, 4, 5, 6]}
    again = cluster_from_dict(c.to_dict())           # the saved JSON loads back as it was
    assert again.to_dict() == c.to_dict() and again.links == c.links


def test_discover_emulated_and_errors():
    world = [fact(0, "h0", emulate={"name": "emu_fast", "speed": 0.125, "memory_bytes": 1 << 26}),
             fact(1, "h1", emulate={"name": "emu_slow", "speed": 0.0625, "memory_bytes": 1 << 24}),
             fact(2, "h1", emulate={})]
    d = discover(world)
    assert d.cluster.emulated and [x.id for x in d.cluster.devices] == ["h0.g0", "h1.g0"]
    assert [h.rank for h in d.ps_slots()] == [2]
    with pytest.raises(DiscoveryError, match="none of the 2 rank"):
        discover([fact(0, "h0"), fact(1, "h0", emulate={})])
    with pytest.raises(DiscoveryError, match="rank 1 holds A100"):
        discover([world[0], fact(1, "h1", [gpu(0, "A100")])])
    bad = dict(world[1], error="HETPIPE_EMULATE of rank 1: unknown emulated type 'emu_x'")
    with pytest.raises(DiscoveryError, match=r"rank 1 \(h1\): HETPIPE_EMULATE of rank 1: unknown"):
        discover([world[0], bad])


def test_emulate_and_host_environment(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "emu_fast,big:speed=2:memory=1GiB,ps")
    monkeypatch.setenv(HOST_ENV, "x,y,y")
    assert emulated_type(0, 3) == {"name": "emu_fast", "speed": 0.125, "memory_bytes": 268435456}
    assert emulated_type(1, 3) == {"name": "big", "speed": 2.0, "memory_bytes": 1 << 30}
    assert emulated_type(2, 3) == {}
    assert host_name(2, 3) == "y"
    with pytest.raises(ValueError, match="lists 3 values but the world has 4 ranks"):
        emulated_type(0, 4)
    for spec, why in (("emu_nope", "unknown emulated type 'emu_nope'"), ("q:speed=0:memory=1", "speed must be"),
                      ("q:speed=1", "needs both"), ("q:speed=1:memory=lots", "memory must be"),
                      ("q:fast=1:memory=1", "is not speed=S")):
        monkeypatch.setenv(EMULATE_ENV, spec)
        with pytest.raises(ValueError, match=why):
            emulated_type(0, 1)
    monkeypatch.setenv(EMULATE_ENV, "emu_nope")
    monkeypatch.setenv(HOST_ENV, "x")
    facts = rank_facts(0, 1)
    assert "unknown emulated type 'emu_nope'" in facts["error"] and facts["host"] == "x"


def test_match_given_cluster():
    lab = {"name": "lab", "device_types": {"a100_40g": {"memory_bytes": 40 << 30, "peak_flops": 19.5e12},
                                           "rtx3090": {"memory_bytes": 24 << 30, "peak_flops": 35.6e12}},
           "nodes": [{"name": "a", "type": "a100_40g", "count": 2}, {"name": "b", "type": "rtx3090", "count": 4}],
           "intra_node": {"bandwidth": 1e11}, "inter_node": {"bandwidth": 1.25e10}}
    d = match(lab_world(), cluster_from_dict(lab))
    assert d.holder_of("b.g3").rank == 6 and d.holder_of("a.g1").type == "a100_40g"
    assert [h.rank for h in d.ps_slots()] == [2, 7]
    short = dict(lab, nodes=[{"name": "a", "type": "a100_40g", "count": 4}])
    with pytest.raises(DiscoveryError, match="node a has 4 device.*but 2 rank"):
        match(lab_world(), cluster_from_dict(short))
    elsewhere = dict(lab, nodes=[{"name": "n7", "type": "a100_40g", "count": 1}])
    with pytest.raises(DiscoveryError, match=r"node n7 .*\(hosts of the world: a, b\)"):
        match(lab_world(), cluster_from_dict(elsewhere))
    big = dict(lab, device_types={**lab["device_types"], "rtx3090": {"memory_bytes": 48 << 30, "speed": 1}})
    with pytest.raises(DiscoveryError, match=r"rank 3 on host b: GPU 0 .* 25769803776 bytes .* b.g0"):
        match(lab_world(), cluster_from_dict(big))


def test_assign_ranks_follows_devices_and_slots():
    d = discover(lab_world())
    profile = analytic_profile("vgg19", d.cluster.device_types)
    ps_nodes = [h.host for h in d.ps_slots()]
    plan = make_plan(d.cluster, profile, policy="ED", nm=2, ps_nodes=ps_nodes)
    assert [sh.node for sh in plan.ps_shards] == ps_nodes
    order = assign_ranks(plan, d)
    assert sorted(order) == list(range(len(d.holders)))
    for r, w in enumerate(order):
        kind, a, b = plan.role_of(r)
        held = d.holders[w]
        if kind == "stage":
            assert held.device == plan.virtual_workers[a].stages[b].device
        else:
            assert held.device is None and held.host == plan.ps_shards[a].node
    # one more rank than the plan needs: named, with what it holds
    extra = discover(lab_world() + [fact(8, "b", [gpu(i, "NVIDIA GeForce RTX 3090", 24576) for i in range(4)])])
    with pytest.raises(DiscoveryError, match="without a part: rank 8 on host b, no device"):
        assign_ranks(plan, extra)
    no_slot = discover([f for f in lab_world() if f["rank"] != 7])
    with pytest.raises(DiscoveryError, match="PS shard 1 belongs on node b but no rank there is free"):
        assign_ranks(plan, no_slot)


def test_ps_nodes_may_be_hosts_without_devices():
    c = load_cluster("hetpipe-testbed")
    plan = make_plan(c, "vgg19", policy="ED", nm=2, ps_nodes=["storage-host"])
    assert [sh.node for sh in plan.ps_shards] == ["storage-host"]
    assert sorted(plan.ps_shards[0].layers) == list(range(plan.num_layers))
    with pytest.raises(ValueError, match="num_ps_shards=2 but ps_nodes names 1"):
        make_plan(c, "vgg19", ps_nodes=["x"], num_ps_shards=2)


LAB = {"name": "lab", "device_types": {"a100_40g": {"memory_bytes": 40 << 30, "peak_flops": 19.5e12},
                                       "rtx3090": {"memory_bytes": 24 << 30, "peak_flops": 35.6e12}},
       "nodes": [{"name": "a", "type": "a100_40g", "count": 2}, {"name": "b", "type": "rtx3090", "count": 4}],
       "intra_node": {"bandwidth": 1e11}, "inter_node": {"bandwidth": 1.25e10}}


def test_profiles_for_gpu_types_outside_the_presets():
    from hetpipe.plan.profile import analytic_profile, profile_for_cluster

    lab = cluster_from_dict(LAB)
    profile, note = profile_for_cluster("gpt", lab)
    assert "analytic for this cluster's types (a100_40g, rtx3090)" in note
    # against the analytic model computed directly: minibatch x FLOPs / (peak x efficiency)
    direct = analytic_profile("gpt", lab.device_types)
    assert profile.fwd("rtx3090") == direct.fwd("rtx3090")
    block = profile.layers[1]
    assert block.fwd_time["a100_40g"] == pytest.approx(block.flops / (19.5e12 * 0.5))
    plan = make_plan(lab, profile, nm=2)
    assert {st.device_type for vw in plan.virtual_workers for st in vw.stages} <= {"a100_40g", "rtx3090"}
    emulated = load_cluster("cpu-emulated")
    with pytest.raises(ValueError, match="emu_fast, emu_slow of cluster 'cpu-emulated' need peak_flops"):
        profile_for_cluster("gpt", emulated)
    # a measured profile keeps its own times and derives the rest, marked
    measured = analytic_profile("vgg19", {"a100_40g": lab.device_types["a100_40g"]})
    out, note = profile_for_cluster(measured, lab)
    assert "rtx3090 derived by speed ratio from a100_40g" in note
    assert out.layers[0].derived["rtx3090"] and out.fwd("a100_40g") == measured.fwd("a100_40g")
    assert out.layers[0].fwd_time["rtx3090"] == pytest.approx(out.layers[0].fwd_time["a100_40g"] * 19.5 / 35.6)
    assert profile_for_cluster(measured, cluster_from_dict(dict(LAB, nodes=LAB["nodes"][:1])))[1] == ""


# nvidia-smi --query-gpu=index,name,memory.total,compute_cap,pci.bus_id,uuid --format=csv,noheader,nounits
# of a node of four A100s, in nvidia-smi's exact format (PCI bus ids with the 8-digit domain, GPU- UUIDs).
SMI_QUERY = Path(__file__).parent / "data" / "nvidia-smi-query-gpu.csv"
UUIDS = ["GPU-1d2e6c4a-83f0-5b7e-9c21-a04f6b3d8e15", "GPU-6b9f0e27-4c1a-d385-27e6-5f8a3c90b4d2",
         "GPU-c04a7f81-2d9e-6b3c-e815-93d7a2f64c08", "GPU-8e35d1b9-f6a0-47c2-b9d4-1c6e80a57f33"]


def test_gpu_query_in_cuda_visible_order():
    gpus = parse_gpu_query(SMI_QUERY.read_text())
    assert [g["uuid"] for g in gpus] == UUIDS and gpus[3]["bus_id"] == "00000000:4E:00.0"
    assert gpus[0]["memory_bytes"] == 40960 << 20 and gpus[0]["compute_capability"] == "8.0"
    assert visible_gpus(gpus, None) == gpus
    assert [g["index"] for g in visible_gpus(gpus, "2,0")] == [2, 0]
    assert [g["index"] for g in visible_gpus(gpus, "GPU-8e35d1b9,1")] == [3, 1]   # a UUID prefix, as CUDA takes
    assert [g["index"] for g in visible_gpus(gpus, "1,7,2")] == [1]                # CUDA stops at an unusable item
    assert visible_gpus(gpus, "") == []
    assert normal_uuid("8E35D1B9F6A047C2B9D41C6E80A57F33") == UUIDS[3]             # CUDA's form, as torch prints it


@pytest.fixture
def recorded_smi(tmp_path, monkeypatch):
    """An ``nvidia-smi`` first on PATH that answers the inventory's query with the recorded output."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   '[ "$1" = "--query-gpu=index,name,memory.total,compute_cap,pci.bus_id,uuid" ] || exit 2\n'
                   f'exec cat "{SMI_QUERY}"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return monkeypatch


def test_same_gpu_is_decided_by_uuid_under_per_rank_visible_devices(recorded_smi):
    """Slurm's --gpu-bind gives each rank one GPU as its cuda:0: ranks 0 and 1 on physical GPUs 2 and 3,
    rank 2 on GPU 2 again (named by its UUID). Their device strings are all cuda:0 on one host; NCCL
    may join 0 and 1, not 0 and 2. Each rank's view is its CUDA_VISIBLE_DEVICES, set in turn."""
    import torch

    from hetpipe.transport.registry import RankChoice, device_identity, unjoinable

    gpus = []
    for visible in ("2", "3", UUIDS[2]):
        recorded_smi.setenv("CUDA_VISIBLE_DEVICES", visible)
        gpus.append(gpu_identity(0))
        if not torch.cuda.is_available():   # torch sees no device: the runtime's identity is nvidia-smi's too
            assert device_identity(torch.device("cuda", 0)) == gpus[-1]
    assert gpus == [UUIDS[2], UUIDS[3], UUIDS[2]]
    assert device_identity(torch.device("cpu")) == "" and device_identity(None) == ""
    ranks = [RankChoice(None, "torch-p2p", "nccl", "cuda:0", "n0", g) for g in gpus]
    assert unjoinable(ranks[0], ranks[1]) == ""
    assert unjoinable(ranks[0], ranks[2]) == f"NCCL cannot join two ranks on one GPU (cuda:0 of n0, {UUIDS[2]})"
    # Without identities (no driver tool) the device string decides, as it always did.
    blind = [RankChoice(None, "torch-p2p", "nccl", "cuda:0", "n0") for _ in range(2)]
    assert "one GPU" in unjoinable(*blind)
    recorded_smi.setenv("CUDA_VISIBLE_DEVICES", "5")             # no such GPU: nothing to tell it by
    assert gpu_identity(0) == ""
