"""Layer profiles: presets, JSON round trip, validation errors, derivation and the host profiler."""

import json

import pytest

from hetpipe.plan.cluster import load_cluster
from hetpipe.plan.profile import (LayerProfile, ModelProfile, analytic_profile, load_profile, presets, write_presets)


def test_presets_have_testbed_types_and_realistic_sizes():
    assert {"resnet152", "vgg19", "gpt"} <= set(presets())
    tb = load_cluster("hetpipe-testbed")
    for name, params, layers in (("resnet152", 60e6, 50), ("vgg19", 143e6, 19), ("gpt", 1.3e9, 26)):
        p = load_profile(name)
        assert p.num_layers >= layers
        p.validate(tb.device_types)
        bytes_per_param = 2 if name == "gpt" else 4
        n = sum(x.param_bytes for x in p.layers) / bytes_per_param
        assert params * 0.9 < n < params * 1.15, (name, n)
        # faster type, shorter time; the ratio is the ratio of peak FLOP/s
        f = p.layers[1].fwd_time
        assert f["titan_v"] / f["rtx2060"] == pytest.approx(6.45 / 14.9)


def test_shipped_presets_match_their_generator(tmp_path):
    write_presets("hetpipe-testbed", tmp_path)
    for name in ("resnet152", "vgg19", "gpt"):
        assert ModelProfile.load(tmp_path / f"{name}.json") == load_profile(name)


def test_round_trip(tmp_path):
    p = load_profile("vgg19")
    path = tmp_path / "p.json"
    p.save(path)
    assert load_profile(str(path)) == p
    assert ModelProfile.from_dict(json.loads(p.to_json())) == p


def layer(**kw):
    d = dict(name="conv", fwd_time={"a": 1.0}, bwd_time={"a": 2.0}, activation_bytes=4, param_bytes=8)
    d.update(kw)
    return LayerProfile(**d)


def test_negative_time_names_layer_and_type():
    with pytest.raises(ValueError, match=r"layer 1 \('bad'\): bwd_time on device type 'a' must be a finite number >= 0"):
        ModelProfile("m", 1, [layer(), layer(name="bad", bwd_time={"a": -1.0})])


def test_missing_device_type_names_layer_and_type():
    p = ModelProfile("m", 1, [layer()])
    with pytest.raises(ValueError, match=r"layer 0 \('conv'\): no fwd_time for device type 'b'"):
        p.validate(["a", "b"])


def test_negative_bytes_and_empty():
    with pytest.raises(ValueError, match=r"layer 0 \('conv'\): param_bytes must be an integer >= 0"):
        ModelProfile("m", 1, [layer(param_bytes=-5)])
    with pytest.raises(ValueError, match="no layers"):
        ModelProfile("m", 1, [])


def test_malformed_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(str(bad))
    with pytest.raises(ValueError, match="missing the list of layers"):
        load_profile({"name": "x"})
    with pytest.raises(ValueError, match=r"layer 0 \('l'\): fwd_time must be an object"):
        load_profile({"name": "x", "layers": [{"name": "l", "fwd_time": 3, "bwd_time": {}}]})
    with pytest.raises(ValueError, match=r"layer 0 \('l'\): unknown field\(s\) \['speedy'\]"):
        load_profile({"name": "x", "layers": [{"name": "l", "fwd_time": {}, "bwd_time": {}, "speedy": 1}]})
    with pytest.raises(ValueError, match="neither a preset"):
        load_profile("alexnet-9000")


def test_derive_types_by_speed():
    p = ModelProfile("m", 1, [layer()])
    q = p.derive_types({"a": 2.0, "b": 1.0})
    assert q.layers[0].fwd_time["b"] == 2.0 and q.layers[0].bwd_time["b"] == 4.0
    assert q.layers[0].derived["b"] and not q.layers[0].derived.get("a", False)


def test_analytic_needs_peak_flops():
    with pytest.raises(ValueError, match="device type 'emu_fast' has no peak_flops"):
        analytic_profile("vgg19", load_cluster("cpu-emulated").device_types)


def test_profile_model_on_emulated_cluster():
    torch = pytest.importorskip("torch")
    from hetpipe.model.measure import profile_model
    nn = torch.nn
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    cluster = load_cluster("cpu-emulated")
    p = profile_model(model, torch.randn(8, 16), cluster, repeats=2)
    assert p.num_layers == 3 and p.minibatch_size == 8 and p.input_bytes == 8 * 16 * 4
    p.validate(cluster.device_types)
    l0 = p.layers[0]
    assert l0.param_bytes == (16 * 32 + 32) * 4 and l0.activation_bytes == 8 * 32 * 4
    assert l0.stash >= 8 * 16 * 4                       # Linear saves its input for backward
    fast, slow = cluster.device_types["emu_fast"].speed, cluster.device_types["emu_slow"].speed
    assert l0.fwd_time["emu_slow"] == pytest.approx(l0.fwd_time["emu_fast"] * fast / slow)
    assert all(l0.derived.values())
    with pytest.raises(ValueError, match="give reference_type"):
        profile_model(model, torch.randn(8, 16), "hetpipe-testbed")
    q = profile_model(model, torch.randn(8, 16), "hetpipe-testbed", reference_type="titan_v", repeats=1)
    assert not q.layers[0].derived["titan_v"] and q.layers[0].derived["rtx2060"]


def test_profile_counts_every_leaf_of_a_pytree_output_and_a_tied_parameter_once():
    import sys
    from pathlib import Path

    import torch
    from torch import nn
    sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
    import real_models as rm

    from hetpipe.model.measure import profile_model

    model = rm.pytree_model()
    x, _ = next(iter(rm.DictBatches()))
    prof = profile_model(model, x, "cpu-emulated", repeats=1)
    tuple_bytes = 8 * 24 * 4 + 8 * 8                       # (float32[8, 24], int64[8])
    dict_bytes = 2 * 8 * 24 * 4 + 8 * 8                    # {"h", "skip": float32[8, 24], "count": int64[8]}
    assert [l.activation_bytes for l in prof.layers[:2]] == [tuple_bytes, dict_bytes]
    assert all(t > 0 for l in prof.layers for t in l.bwd_time.values())
    tied = rm.tied_mlp()
    tp = profile_model(tied, torch.randn(4, 64), "cpu-emulated", repeats=1)
    assert tp.layers[0].param_bytes == 4 * (32 * 64 + 32) and tp.layers[4].param_bytes == 0
    assert tp.layers[4].tied == ((0, "weight", 4 * 32 * 64),) and not any(l.tied for l in tp.layers[:4])
    assert ModelProfile.from_dict(json.loads(tp.to_json())) == tp         # the tie survives the file
    resnet = rm.resnet()
    before = resnet[0][1].running_mean.clone()
    profile_model(resnet, torch.randn(4, 1, 8, 8), "cpu-emulated", repeats=1)
    assert torch.equal(resnet[0][1].running_mean, before)     # profiling leaves BatchNorm statistics alone
    with pytest.raises(ValueError, match=r"profile_model: layer 1 \(Linear\) failed: RuntimeError"):
        profile_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2)), torch.randn(2, 4), "cpu-emulated")


def test_layer_names_reach_the_profile_and_the_plan_table():
    """An adapter's layer names (and an nn.Sequential's own child names) name the profile's layers and
    the stages of the plan table; plain positional Sequentials keep index:class names."""
    from collections import OrderedDict

    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    from hetpipe.adapters import adapt
    from hetpipe.plan import make_plan
    from hetpipe.plan.format import format_plan
    from hetpipe.model.measure import profile_model

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                        eos_token_id=0)
    adapted = adapt(GPT2LMHeadModel(config))
    ids = torch.randint(0, 64, (2, 16))
    prof = profile_model(adapted.layers, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                         "cpu-emulated", repeats=1,
                         loss_fn=lambda out: adapted.loss_fn(out, ids))
    assert list(prof.layer_names) == adapted.names == ["embed", "h.0", "h.1", "head"]
    plan = make_plan(load_cluster("cpu-emulated"), prof, minibatch_size=2)
    assert plan.layer_names == tuple(adapted.names) and "embed.." in format_plan(plan)

    named = nn.Sequential(OrderedDict(stem=nn.Linear(4, 4), head=nn.Linear(4, 2)))
    assert profile_model(named, torch.randn(2, 4), "cpu-emulated", repeats=1).layer_names == ("stem", "head")
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert profile_model(plain, torch.randn(2, 4), "cpu-emulated", repeats=1).layer_names == ("0:Linear", "1:Linear")
