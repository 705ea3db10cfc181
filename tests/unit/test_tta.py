"""bench/convergence/tta.py's pieces: the capacity-bound regime's cluster and memory verdicts (in bytes),
the baselines that regime leaves to the fitting devices, FSDP's step and memory, the targets, mean and
sd, and the speed-up bound, against hand-computed values."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH / "convergence"), str(BENCH / "e2e")]

import steptimes as st  # noqa: E402
import tta  # noqa: E402
import vclock  # noqa: E402
from devices import DeviceModel  # noqa: E402
from hetpipe.plan.cluster import Link, load_cluster  # noqa: E402
from hetpipe.plan.planner import make_plan  # noqa: E402
from hetpipe.plan.profile import LayerProfile, ModelProfile  # noqa: E402
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan  # noqa: E402
from task import TaskSpec, corpus, validation_set  # noqa: E402

torch.set_num_threads(1)
MIB = 2 ** 20


def profile(types, layers=4, param=2 * MIB, stash=1 * MIB) -> ModelProfile:
    """A model of ``layers`` equal layers: ``param`` bytes of weights each, Adam (2x), ``stash`` per minibatch."""
    f = {t: 0.01 / s for t, s in types.items()}
    return ModelProfile("m", 4, tuple(LayerProfile(f"l{i}", f, {t: 2 * v for t, v in f.items()}, 1000, param, 2 * param,
                                                   stash_bytes=stash) for i in range(layers)), input_bytes=1)


def test_r1_cluster_is_the_testbed_with_scaled_memory():
    tb = load_cluster("hetpipe-testbed")
    spec, scale = tta.testbed_emulated(40 * MIB)
    cl = load_cluster(spec)
    assert scale == pytest.approx(40 * MIB / (10 * 2 ** 30))
    assert [(d.id, d.type) for d in cl.devices] == [(d.id, d.type) for d in tb.devices]
    assert cl.emulated and cl.inter_node == load_cluster("cpu-emulated-6").inter_node
    for t, dt in cl.device_types.items():
        assert dt.memory_bytes == int(tb.device_types[t].memory_bytes * scale)
        assert dt.speed == pytest.approx(0.125 * tb.device_types[t].peak_flops / 16.3e12)
    # 40 MiB at 10 GiB: Titan V (12 GiB -> 48 MiB) and Titan RTX (96 MiB) hold it; RTX 2060 (24 MiB) and
    # Quadro P4000 (32 MiB) do not.
    fits = {t: ok for t, (_, _, ok) in tta.memory_verdicts(cl, 40 * MIB).items()}
    assert fits == {"titan_v": True, "titan_rtx": True, "rtx2060": False, "quadro_p4000": False}


def test_model_bytes_is_weights_gradients_adam_and_stash():
    prof = profile({"a": 1.0}, layers=3, param=2 * MIB, stash=MIB)
    # per layer: 2 MiB weights + 2 MiB gradients + 4 MiB Adam + 1 MiB stash (one minibatch) = 9 MiB
    assert tta.model_bytes(prof, 4) == 27 * MIB
    assert tta.model_bytes(prof, 8) == 30 * MIB


def r1_setting() -> vclock.Setting:
    """The capacity-bound regime on a made-up profile: each device type's memory from the testbed's."""
    tb = load_cluster("hetpipe-testbed")
    speeds = {t: dt.peak_flops / 1e12 for t, dt in tb.device_types.items()}
    prof = profile(speeds)
    need = tta.model_bytes(prof, 4)
    spec, _ = tta.testbed_emulated(need)
    cl = load_cluster(spec)
    dm = DeviceModel([(d.id, d.type) for d in cl.devices], {t: prof.fwd(t) for t in speeds},
                     {t: prof.bwd(t) for t in speeds}, 4, "test")
    task = TaskSpec(width=16, blocks=1, val_windows=8)
    text, val, _ = corpus(task)
    stage = StagePlan("n0.g0", "titan_v", 0, 4, 0.1, 0.2)
    plan = Plan(4, 1, 0, "manual", (VirtualWorkerPlan(0, (stage,)),), (ShardPlan(0, "n0", (0, 1, 2, 3)),))
    return vclock.Setting(task, text, validation_set(val, task), dm, prof, cl, plan)


def test_r1_data_parallel_baselines_leave_out_the_devices_that_cannot_hold_the_model():
    s = r1_setting()
    need = tta.model_bytes(s.prof, 4)
    small = {t for t, dt in s.cluster.device_types.items() if dt.memory_bytes < need}
    assert small == {"rtx2060", "quadro_p4000"}
    for system in ("ddp-fast", "hetero-dp"):
        b = vclock.baseline(s, system)
        used = {d.type for d in s.cluster.devices if f"'{d.id}'" in b.note}
        assert used and not used & small, (system, b.note)
        # every member holds the model with its share of the step
        assert b.fits
    hetero = vclock.baseline(s, "hetero-dp")
    assert hetero.windows == 8 * 4                  # the 8 fitting devices' minibatches
    fast = vclock.baseline(s, "ddp-fast")
    assert fast.windows in (16, 32)                 # the k fastest fitting: 4 Titan RTX, or all 8


def test_fsdp_step_and_memory_by_hand():
    link = Link(2.5e8, 1e-4)
    # 16 members, 16e6 bytes: 3 passes x 15 steps of 1e6 bytes at 2.5e8 B/s, plus 45 latencies.
    assert st.fsdp_comm_s(16e6, 16, link) == pytest.approx(45 * 1e6 / 2.5e8 + 45 * 1e-4)
    assert st.fsdp_comm_s(16e6, 1, link) == 0.0
    # weights 4 x 2 MiB, gradients alike, Adam 4 x 4 MiB over 4 members, plus one gathered layer's weights and
    # gradient (4 MiB) and the stash (3 MiB)
    held = st.fsdp_bytes_per_device([2 * MIB] * 4, [4 * MIB] * 4, 4, 3 * MIB)
    assert held == pytest.approx(8 * MIB + 4 * MIB + 3 * MIB)
    s = r1_setting()
    b = vclock.baseline(s, "fsdp")
    assert b.windows == 16 * 4 and b.fits
    slowest = max(s.dm.minibatch_time(t) for _, t in s.dm.devices)
    assert b.parts["compute"] == pytest.approx(slowest)
    comm = st.fsdp_comm_s(vclock.grad_bytes(s.prof), 16, s.cluster.inter_node)
    assert b.parts["gather+scatter"] == pytest.approx(comm)


def test_targets_are_spread_along_the_reference_curve():
    ref = [(0.0, 5.5), (10.0, 4.0), (20.0, 3.0), (40.0, 2.5)]
    other = [(0.0, 5.5), (40.0, 2.8)]
    # hardest: 2.8 (what every curve reaches); the reference reaches it at 20 + 20 x 0.2 / 0.5 = 28 s;
    # at 7 s it is at 4.45, at 14 s at 3.6
    assert tta.choose_targets([ref, other], 40.0, ref) == pytest.approx([4.45, 3.6, 2.8])
    # coinciding levels are spaced evenly between the first and the hardest instead
    flat = [(0.0, 5.5), (1.0, 3.0), (40.0, 2.9)]
    got = tta.choose_targets([flat], 40.0, flat)
    assert len(got) == 3 and got[-1] == pytest.approx(2.9) and got[0] > got[1] > got[2]
    with pytest.raises(ValueError):
        tta.choose_targets([other], 40.0, [(0.0, 5.5), (40.0, 5.0)])


def test_mean_sd_samples_and_speedup_bound_by_hand():
    m, sd = tta.mean_sd([10.0, 12.0, 14.0])
    assert m == 12.0 and sd == pytest.approx(2.0)
    assert tta.mean_sd([3.0]) == (3.0, None)
    assert tta.mean_sd([3.0, None]) == (None, None)
    assert tta.samples_at([(0.0, 0, 5.0), (2.0, 100, 4.0), (4.0, 300, 3.0)], 3.0) == pytest.approx(200.0)
    # throughput 30 vs 20 samples/s; batches 16 and 32 at B_noise 16: efficiency ratio (16 + 32) / (16 + 16) = 1.5
    assert tta.speedup_bound(30.0, 20.0, 16, 32, 16.0) == pytest.approx(1.5 * 1.5)
    assert tta.speedup_bound(30.0, 20.0, 16, 32, math.inf) == pytest.approx(1.5)


def test_hetpipe_rows_name_their_outer_optimizer_and_refuse_bad_fields():
    assert tta.parse_variant("mean:1") == ("mean", 1, {})
    agg, d, outer = tta.parse_variant("sum:2:outer=delayed-nesterov+lr=0.15+momentum=0.9+gain=sqrt+delay=3")
    assert (agg, d) == ("sum", 2)
    assert outer == {"outer": "delayed-nesterov", "outer_lr": 0.15, "outer_momentum": 0.9, "outer_gain": "sqrt",
                     "outer_delay": 3}
    assert tta.variant_name("mean", 1, {}) == ("hetpipe-d1-mean", "hetpipe D=1 (mean)")
    key, label = tta.variant_name("mean", 1, {"outer_staleness": "inverse"})
    assert key == "hetpipe-d1-mean-stalenessinverse"
    assert label == "hetpipe D=1 (mean; sgd (lr 1, inverse staleness))"
    # the wave rule rides with the outer fields but is the plan's: named in the label, not the outer optimizer
    assert tta.parse_variant("mean:1:waves=speed") == ("mean", 1, {"waves": "speed"})
    assert tta.parse_variant("mean:1:waves=equal") == ("mean", 1, {})
    assert tta.variant_name("mean", 1, {"waves": "speed"}) == ("hetpipe-d1-mean-wavesspeed",
                                                               "hetpipe D=1 (mean; waves by speed)")
    assert tta.variant_name("mean", 1, {"waves": "speed", "outer_gain": "sqrt"})[1] == \
        "hetpipe D=1 (mean; sgd (lr 1, sqrt gain); waves by speed)"
    for bad, culprit in [("avg:1", "AGG:D"), ("mean:x", "AGG:D"), ("mean:1:speed=2", "'speed=2'"),
                         ("mean:1:lr=fast", "lr must be a float"), ("mean:1:staleness=linear", "outer_staleness"),
                         ("mean:1:momentum=1.5", "outer_momentum"), ("mean:1:waves=fast", "waves must be")]:
        with pytest.raises(SystemExit, match=culprit):
            tta.parse_variant(bad)


def test_a_row_planned_for_time_to_accuracy_runs_the_planners_plan():
    """``plan=tta`` rows: the planner's time-to-accuracy plan at the given noise scale, at the row's D and at
    the Nm the planner chooses (as a job that sets none gets it, not the regime plan's) unless the row sets one,
    is the row's (its VWs set the batch per update and the wave time), and the run follows it, not the regime's
    one-device plan. A tiny noise scale prices every extra VW's samples (fewer VWs), a huge one only
    throughput (more VWs)."""
    agg, d, outer = tta.parse_variant("mean:1:plan=tta+noise=1")
    assert outer == {"plan": "tta", "noise": 1.0}
    assert tta.outer_fields({**outer, "waves": "speed", "outer_lr": 0.5}) == {"outer_lr": 0.5}
    assert tta.variant_name(agg, d, outer)[1] == "hetpipe D=1 (mean; plan for time to accuracy, noise 1)"
    agg1, d1, at_nm = tta.parse_variant("mean:0:plan=tta+noise=1+nm=1")
    assert at_nm == {"plan": "tta", "noise": 1.0, "nm": 1}
    assert tta.variant_name(agg1, d1, at_nm)[1] == "hetpipe D=0 (mean; plan for time to accuracy, noise 1, Nm 1)"
    assert tta.parse_variant("mean:1:plan=tta+policy=ed")[2] == {"plan": "tta", "policy": "ED"}
    priced = tta.parse_variant("mean:1:plan=tta+costs=fitted")[2]
    assert priced == {"plan": "tta", "costs": "fitted"} and tta.outer_fields(priced) == {}
    assert tta.variant_name("mean", 1, priced)[1] == ("hetpipe D=1 (mean; plan for time to accuracy, "
                                                      "staleness costs fitted)")
    for bad, culprit in [("mean:1:plan=fast", "plan must be tta"), ("mean:1:plan=tta+noise=x", "noise must be a number"),
                         ("mean:1:plan=tta+noise=-2", "noise must be > 0"), ("mean:1:noise=8", "add plan=tta"),
                         ("mean:1:plan=tta+nm=0", "nm must be an integer >= 1"), ("mean:1:nm=2", "add plan=tta"),
                         ("mean:1:plan=tta+policy=DP", "policy must be NP, ED or HD"),
                         ("mean:1:policy=ED", "add plan=tta"), ("mean:1:costs=fitted", "add plan=tta"),
                         ("mean:1:plan=tta+costs=0.1", "costs must be none or fitted")]:
        with pytest.raises(SystemExit, match=culprit):
            tta.parse_variant(bad)
    s = r1_setting()
    s = vclock.Setting(s.task, s.text, s.val, s.dm, s.prof, s.cluster, dataclasses.replace(s.plan, nm=2))
    rows, budget = tta.make_rows(s, ["ddp-fast"], [("mean", 1, {"plan": "tta", "noise": 1.0}),
                                                   ("mean", 1, {"plan": "tta", "noise": 1e6}),
                                                   ("mean", 1, {"plan": "tta", "noise": 1.0, "nm": 1}),
                                                   ("mean", 1, {"plan": "tta", "noise": 1.0, "policy": "ED"}),
                                                   ("mean", 1, {"plan": "tta", "noise": 1.0, "costs": "fitted"})], 4)
    small, large = rows[1].plan, rows[2].plan
    assert rows[3].plan.nm == 1 and "Nm 1," in rows[3].note
    only = rows[4].plan.meta["time_to_accuracy"]["candidates"]     # ED's VWs alone: no DP, no single pipeline
    assert rows[4].plan.policy == "ED" and {c["layout"] for c in only} <= {"ED", "any"}
    costed = make_plan(s.cluster, s.prof, d=1, minibatch_size=s.task.minibatch, objective="time-to-accuracy",
                       noise_scale=1.0, staleness_costs="fitted")
    assert rows[5].plan.meta["time_to_accuracy"]["staleness_costs"] == {"pipeline": 0.127, "averaging": 0.194,
                                                                         "wsp": 0.111}
    assert rows[5].plan.virtual_workers == costed.virtual_workers and rows[5].plan.nm == costed.nm
    for row, plan, noise in ((rows[1], small, 1.0), (rows[2], large, 1e6)):
        meta = plan.meta["time_to_accuracy"]
        own = make_plan(s.cluster, s.prof, nm=None, d=1, minibatch_size=s.task.minibatch,
                        objective="time-to-accuracy", noise_scale=noise)
        assert own.nm != s.plan.nm          # (the regime's Nm is not the planner's here: the check can fail)
        assert plan.nm == own.nm and plan.d == 1 and meta["noise_scale"] == noise and meta["noise_source"] == "given"
        assert row.batch == len(plan.virtual_workers) * s.task.minibatch
        assert f"policy {plan.policy}" in row.note and row.steps % plan.nm == 0
    assert len(small.virtual_workers) < len(large.virtual_workers)
    row = dataclasses.replace(rows[1], steps=2 * small.nm)
    result = tta.run_one(s, row, 1e-2, 0, evals=1)
    per_wave = sum(vw.nm or small.nm for vw in small.virtual_workers) * s.task.minibatch
    assert result["points"][-1][1] == 2 * per_wave          # 2 waves of the row's plan, not the regime's


def test_a_saved_profile_gives_the_same_device_model_without_profiling_again(tmp_path, monkeypatch):
    """``--profile-dir``'s mechanism (``cluster_setup.profile_device_model(profile_file=)``): the first run
    measures and saves the profile before its slowdown; a later run loads it, profiles nothing, and gets the
    same device model and profile times (the slowdown applied once, not twice); a profile of another model
    or minibatch is refused, naming the file and what differs."""
    import cluster_setup
    from torch import nn

    layers = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 3)]
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    loss = lambda out: nn.functional.cross_entropy(out, y)  # noqa: E731
    path = tmp_path / "r2-profile.json"
    dm1, prof1, _ = cluster_setup.profile_device_model(layers, x, loss, "mlp2x8", trials=2, slowdown=1.5,
                                                       profile_file=path)
    assert path.exists()
    saved = ModelProfile.load(path)
    assert all(math.isclose(1.5 * s.fwd_time[t], p.fwd_time[t], rel_tol=1e-12)
               for s, p in zip(saved.layers, prof1.layers) for t in p.fwd_time)

    def no_profiling(*a, **k):
        raise AssertionError("profiled although a saved profile was given")

    monkeypatch.setattr(cluster_setup, "profile_model", no_profiling)
    dm2, prof2, _ = cluster_setup.profile_device_model(layers, x, loss, "mlp2x8", trials=2, slowdown=1.5,
                                                       profile_file=path)
    assert (dm2.fwd, dm2.bwd, dm2.host_fwd, dm2.host_bwd) == (dm1.fwd, dm1.bwd, dm1.host_fwd, dm1.host_bwd)
    assert [(l.fwd_time, l.bwd_time) for l in prof2.layers] == [(l.fwd_time, l.bwd_time) for l in prof1.layers]
    assert "loaded from r2-profile.json" in dm2.source
    with pytest.raises(ValueError, match=r"r2-profile\.json.*model is 'mlp2x8', this run's is 'other'"):
        cluster_setup.profile_device_model(layers, x, loss, "other", profile_file=path)
    with pytest.raises(ValueError, match=r"r2-profile\.json.*minibatch size is 4, this run's is 2"):
        cluster_setup.profile_device_model(layers, x[:2], loss, "mlp2x8", profile_file=path)
    assert tta.profile_file(tta.parse_args(["--profile-dir", str(tmp_path / "p")]), "r1") == tmp_path / "p" / "r1-profile.json"
    assert tta.profile_file(tta.parse_args([]), "r1") is None


def test_baselines_option_keeps_the_named_rows_and_refuses_bad_names():
    assert tta.parse_args([]).baselines is None
    assert tta.regime_systems(tta.R1_SYSTEMS, None) == (tta.R1_SYSTEMS, [])
    chosen = tta.parse_args(["--baselines", "fsdp,ddp-fast"]).baselines
    # The regime's own order is kept; a baseline another regime lacks (FSDP in R2) is simply absent there.
    assert tta.regime_systems(tta.R1_SYSTEMS, chosen) == (("ddp-fast", "fsdp"), ["hetero-dp", "pipelining"])
    assert tta.regime_systems(tta.R2_SYSTEMS, chosen) == (("ddp-fast",), ["hetero-dp", "pipelining"])
    with pytest.raises(SystemExit, match="unknown baseline.*ddp-slow"):
        tta.parse_args(["--baselines", "ddp-fast,ddp-slow"])
    with pytest.raises(SystemExit, match="ddp-fast is required"):
        tta.parse_args(["--baselines", "fsdp"])
