"""A device type's speed for the run's precision: FP32 peak for fp32, tensor-core peak for bf16/fp16
(hetpipe.plan.peaks), and the planner's choices that follow from it."""

import pytest

from hetpipe.plan import make_plan
from hetpipe.plan.cluster import cluster_from_dict, load_cluster, presets
from hetpipe.plan.peaks import PEAKS, lookup
from hetpipe.plan.profile import LayerProfile, ModelProfile, analytic_profile, profile_for_cluster

LAB = {"name": "lab", "device_types": {"a100_40g": {"memory_bytes": 40 << 30, "peak_flops": 19.5e12},
                                       "rtx3090": {"memory_bytes": 24 << 30, "peak_flops": 35.6e12}},
       "nodes": [{"name": "a", "type": "a100_40g", "count": 2}, {"name": "b", "type": "rtx3090", "count": 4}],
       "intra_node": {"bandwidth": 1e11}, "inter_node": {"bandwidth": 1.25e10}}


def test_half_precision_ranks_an_a100_above_a_3090_by_the_datasheet_ratio():
    types = cluster_from_dict(LAB).device_types
    a100, rtx = types["a100_40g"], types["rtx3090"]
    # fp32 keeps the FP32 peaks: the 3090 is 35.6 / 19.5 = 1.8x the A100
    assert (a100.speed_for("fp32"), rtx.speed_for("fp32")) == (19.5, 35.6)
    for precision in ("bf16", "fp16"):
        # dense tensor FLOP/s with FP32 accumulation: A100 312 T, RTX 3090 71 T
        assert a100.peak_for(precision) == pytest.approx(312e12)
        assert rtx.peak_for(precision) == pytest.approx(71e12)
        assert a100.speed_for(precision) / rtx.speed_for(precision) == pytest.approx(312 / 71)


def test_types_without_tensor_cores_for_the_half_type_run_it_at_fp32_peak():
    tb = load_cluster("hetpipe-testbed").device_types
    assert tb["titan_v"].peak_for("bf16") == 14.9e12            # Volta: no bf16
    assert tb["titan_v"].peak_for("fp16") == pytest.approx(110e12)
    assert tb["titan_rtx"].peak_for("fp16") == pytest.approx(130.5e12)
    assert tb["quadro_p4000"].peak_for("fp16") == 5.3e12         # Pascal: no tensor cores
    assert lookup("Tesla V100-SXM2-16GB").bf16 == lookup("Tesla V100-SXM2-16GB").fp32
    assert lookup("Tesla T4").bf16 == 8.1e12 and lookup("Tesla T4").fp16 == 65e12


def test_every_shipped_gpu_type_has_a_peak_for_every_precision():
    for name in presets():
        c = load_cluster(name)
        for t, dt in c.device_types.items():
            if c.emulated:          # emulated types: a fraction of the host, the same for every precision
                assert not dt.peak_flops and dt.speed_for("bf16") == dt.speed_for("fp16") == dt.speed
                continue
            assert lookup(dt.hardware or t) is not None, t
            assert dt.peak_for("fp16") >= dt.peak_for("fp32") and dt.peak_for("bf16") >= dt.peak_for("fp32"), t
    for key, peak in PEAKS.items():
        assert lookup(key) == peak and min(peak.fp16, peak.bf16) >= peak.fp32, key


def test_half_flops_in_the_cluster_json_win_and_need_peak_flops():
    spec = dict(LAB, device_types={"a100_40g": {"memory_bytes": 1 << 30, "peak_flops": 19.5e12,
                                                "half_flops": {"bf16": 156e12}},
                                   "rtx3090": LAB["device_types"]["rtx3090"]})
    c = cluster_from_dict(spec)
    a100 = c.device_types["a100_40g"]
    assert a100.peak_for("bf16") == 156e12 and a100.speed_for("bf16") == pytest.approx(156)
    assert a100.peak_for("fp16") == pytest.approx(312e12)        # not given: the published figure
    assert cluster_from_dict(c.to_dict()).device_types["a100_40g"].half_flops == {"bf16": 156e12}
    unknown = dict(spec, device_types={"x": {"memory_bytes": 1, "peak_flops": 1e12}})
    assert cluster_from_dict(dict(unknown, nodes=[{"name": "n", "type": "x"}])).device_types["x"].peak_for("bf16") == 1e12
    with pytest.raises(ValueError, match="'x': half_flops needs peak_flops"):
        cluster_from_dict(dict(unknown, device_types={"x": {"memory_bytes": 1, "speed": 2, "half_flops": {"bf16": 1}}},
                               nodes=[{"name": "n", "type": "x"}]))
    with pytest.raises(ValueError, match="half_flops must be an object keyed by bf16, fp16 or tf32"):
        cluster_from_dict(dict(unknown, device_types={"x": {"memory_bytes": 1, "peak_flops": 1,
                                                            "half_flops": {"int8": 1}}},
                               nodes=[{"name": "n", "type": "x"}]))


def test_at_precision_is_stable_and_fp32_is_the_cluster_itself():
    c = cluster_from_dict(LAB)
    assert c.at_precision("fp32") is c
    b = c.at_precision("bf16")
    assert b.device_types["a100_40g"].speed == pytest.approx(312) and b.at_precision("bf16").device_types == b.device_types
    with pytest.raises(ValueError, match="precision must be one of"):
        c.at_precision("int8")


def test_analytic_and_derived_profiles_use_the_precision_peak():
    lab = cluster_from_dict(LAB)
    fp32, note32 = profile_for_cluster("gpt", lab)
    bf16, note16 = profile_for_cluster("gpt", lab, precision="bf16")
    block = bf16.layers[1]
    assert block.fwd_time["a100_40g"] == pytest.approx(block.flops / (312e12 * 0.5))
    assert block.fwd_time["rtx3090"] == pytest.approx(block.flops / (71e12 * 0.5))
    assert fp32.layers[1].fwd_time["a100_40g"] == pytest.approx(block.flops / (19.5e12 * 0.5))
    assert "peak bf16 FLOP/s" in note16 and "peak FLOP/s" in note32
    # the shipped testbed file is FP32; under bf16 its types keep their FP32 peak, so it stays as shipped
    assert profile_for_cluster("vgg19", "hetpipe-testbed", precision="bf16") == profile_for_cluster("vgg19",
                                                                                                     "hetpipe-testbed")
    fp16, _ = profile_for_cluster("vgg19", "hetpipe-testbed", precision="fp16")
    assert fp16.layers[0].fwd_time["titan_v"] == pytest.approx(fp16.layers[0].flops / (110e12 * 0.5))
    # a profile measured on the A100 derives the 3090 by their ratio for the precision
    measured = analytic_profile("vgg19", {"a100_40g": lab.device_types["a100_40g"]}, precision="bf16")
    out, _ = profile_for_cluster(measured, lab, precision="bf16")
    assert out.layers[0].fwd_time["rtx3090"] == pytest.approx(out.layers[0].fwd_time["a100_40g"] * 312 / 71)


PAIR = {"name": "pair", "device_types": LAB["device_types"], "nodes": [{"name": "n", "devices": ["a100_40g", "rtx3090"]}],
        "intra_node": {"bandwidth": 1e11}, "inter_node": {"bandwidth": 1e10}}


def _best_split(layers, t_a100, t_rtx):
    """By brute force: the A100's layer count minimising the slower stage of a two-stage pipeline."""
    return min(range(1, layers), key=lambda k: max(k * t_a100, (layers - k) * t_rtx))


@pytest.mark.parametrize("precision, tf32, ratio", [("fp32", False, 19.5 / 35.6), ("fp32", True, 156 / 35.6),
                                                     ("bf16", False, 312 / 71)])
def test_the_planner_gives_the_faster_type_for_the_precision_more_layers(precision, tf32, ratio):
    # Ten equal layers measured on the A100 (no bytes: compute alone decides); the 3090 is derived.
    prof = ModelProfile("even", 8, [LayerProfile(f"l{i}", {"a100_40g": 0.01}, {"a100_40g": 0.02}) for i in range(10)])
    plan = make_plan(cluster_from_dict(PAIR), prof, derive_missing=True, nm=2, precision=precision, tf32=tf32)
    (vw,) = plan.virtual_workers
    held = {st.device_type: st.stop - st.start for st in vw.stages}
    k = _best_split(10, 0.03, 0.03 * ratio)
    assert held == {"a100_40g": k, "rtx3090": 10 - k}
    assert k == {(False, "fp32"): 3, (True, "fp32"): 8, (False, "bf16"): 8}[(tf32, precision)]
    assert plan.precision == precision          # TF32 changes the speeds, not what the run computes


def test_tf32_runs_at_the_tensor_core_peak_where_the_type_has_it():
    """An fp32 run with TF32 matmuls (torch.set_float32_matmul_precision("high")): Ampere and newer at
    their dense TF32 figure, older types at FP32; the run reads torch's setting when it plans."""
    from hetpipe.plan.precision import speed_precision
    from hetpipe.run.world_plan import tf32_matmuls

    types = cluster_from_dict(LAB).device_types
    assert types["a100_40g"].peak_for("tf32") == pytest.approx(156e12)
    assert types["rtx3090"].peak_for("tf32") == pytest.approx(35.6e12)
    assert types["a100_40g"].speed_for("tf32") / types["rtx3090"].speed_for("tf32") == pytest.approx(156 / 35.6)
    assert lookup("NVIDIA H100 80GB HBM3").tf32 == 494.7e12 and lookup("Tesla V100-SXM2-16GB").tf32 == 15.7e12
    for peak in PEAKS.values():
        assert peak.fp32 <= peak.tf32 <= min(peak.bf16, peak.fp16) or peak.tf32 == peak.fp32
    assert speed_precision("fp32", True) == "tf32" and speed_precision("bf16", True) == "bf16"
    assert speed_precision("fp32") == "fp32"
    import torch

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert tf32_matmuls() is False
        torch.set_float32_matmul_precision("high")
        assert tf32_matmuls() is True
    finally:
        torch.set_float32_matmul_precision(before)
