"""bf16 mixed precision: one VW of two stages against plain PyTorch autocast in one process, the
bytes on the wire, the plan field, and the planner's halved transfer bytes against hand-computed ones."""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
import real_models as rm  # noqa: E402
from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic  # noqa: E402

from hetpipe.plan.types import Plan  # noqa: E402
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Numerics

EPOCHS = 2


def _no_ps(plan: Plan) -> Plan:
    """``plan`` without PS shards: the stages' live weights are the result (no PS round trip)."""
    return dataclasses.replace(plan, ps_shards=())


class _RoundedOutput(nn.Module):
    """``layer`` with its output rounded to bfloat16 once, then back in its own dtype: what a bf16 stage
    boundary after it does (the receiver widens what its sender rounded)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        out = self.layer(x)
        return out.to(torch.bfloat16).to(out.dtype)


def _autocast_reference(model: nn.Sequential, rounded_after=None):
    """Plain PyTorch autocast in one process (``real_models.plain_training``) on ``model``, whose layer
    ``rounded_after`` rounds its output: (losses, per-layer flat weights)."""
    if rounded_after is not None:
        model[rounded_after] = _RoundedOutput(model[rounded_after])
    losses = rm.plain_training(model, cross_entropy, sgd(), synthetic(), EPOCHS, autocast=True)
    weights = {l: torch.cat([p.detach().reshape(-1) for p in layer.parameters()]).numpy()
               for l, layer in enumerate(model) if list(layer.parameters())}
    return losses, weights


def _run(model, plan, precision):
    r = Trainer(model, cross_entropy, sgd(), synthetic(), plan=plan, epochs=EPOCHS,
                numerics=Numerics(precision=precision)).replay()
    return [v for _, v in sorted(r.losses[0].items())], r.weights


def _max_diff(a, b) -> float:
    (la, wa), (lb, wb) = a, b
    d = max(abs(x - y) for x, y in zip(la, lb))
    return max(d, *(float(np.abs(wa[l] - wb[l]).max(initial=0)) for l in wb))


def test_bf16_two_stages_equal_plain_autocast_bitwise():
    """Cut after a Linear: autocast's own boundary value is bfloat16, so the wire cast changes nothing
    and one VW of two stages (Nm = 1, D = 0, no PS round trip) equals plain autocast bitwise; the same
    run in fp32 does not."""
    plan = _no_ps(one_vw_plan([3], nm=1, d=0))
    ref = _autocast_reference(mlp())
    got = _run(mlp(), plan, "bf16")
    assert got[0] == ref[0]
    assert all(np.array_equal(got[1][l], w) for l, w in ref[1].items())
    assert _max_diff(_run(mlp(), plan, "fp32"), ref) > 1e-4


def test_bf16_with_a_ps_shard_equals_plain_autocast_up_to_the_ps_rounding():
    """The same through a PS shard: the stage then takes the shard's ``W + (W' - W)`` for the step
    ``W'`` it took, which float32 rounds to ``W'`` except where the subtraction is inexact (a weight
    crossing zero): an ulp of a weight, below 1e-6 for these weights (3.7e-9 measured), against
    1.9e-3 between the fp32 run and the autocast reference. A bfloat16 rounding moved by such an
    ulp would show as a jump of about 1e-3 and fail the bound."""
    plan = one_vw_plan([3], nm=1, d=0)
    ref = _autocast_reference(mlp())
    got = _run(mlp(), plan, "bf16")
    fp32_gap = _max_diff(_run(mlp(), plan, "fp32"), ref)
    assert _max_diff(got, ref) <= 1e-6 < fp32_gap


class _Residual(nn.Module):
    """``x + W x``: from a float32 input autocast returns float32 (bfloat16 matmul, float32 add)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + self.lin(x)


def _residual_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Residual(64), nn.Tanh(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_a_float32_boundary_value_is_rounded_to_bfloat16_on_the_wire_once():
    """Cut after a residual add, whose value autocast keeps in float32, before a Tanh, which runs in its
    input's dtype: the wire rounds the value to bfloat16 where autocast would not (it would at the next
    Linear), and the receiver widens it back, so the Tanh runs in float32 as in autocast: the run
    equals autocast with that one rounding inserted (to bfloat16 and back), bitwise, and not plain
    autocast; nor autocast with the value left in bfloat16 after the cut (the Tanh in bfloat16)."""
    plan = _no_ps(one_vw_plan([1], nm=1, d=0, num_layers=5))
    got = _run(_residual_mlp(), plan, "bf16")
    with_cast = _autocast_reference(_residual_mlp(), rounded_after=0)
    assert got[0] == with_cast[0]
    assert all(np.array_equal(got[1][l], w) for l, w in with_cast[1].items())
    assert _max_diff(got, _autocast_reference(_residual_mlp())) > 0
    left_in_bf16 = _residual_mlp()
    left_in_bf16[0] = nn.Sequential(left_in_bf16[0], _ToBFloat16())
    assert _max_diff(got, _autocast_reference(left_in_bf16)) > 0


class _ToBFloat16(nn.Module):
    def forward(self, x):
        return x.to(torch.bfloat16)


class _Three(nn.Module):
    """A pytree boundary: a residual sum (float32 under autocast), a Linear's output (autocast's own
    bfloat16) and an integer leaf."""

    def __init__(self, rounded_once: bool = False):
        super().__init__()
        self.res, self.lin, self.rounded_once = _Residual(64), nn.Linear(64, 64), rounded_once

    def forward(self, x):
        s = self.res(x)
        if self.rounded_once:
            s = s.to(torch.bfloat16).to(torch.float32)
        return {"sum": s, "lin": self.lin(x), "n": torch.zeros(x.shape[0], dtype=torch.int64)}


class _TanhBoth(nn.Module):
    """Each leaf through a Tanh, which runs in its input's dtype: the sum's in float32, the Linear's in
    bfloat16 (as autocast leaves them), then one Linear of both."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(128, 10)

    def forward(self, v):
        return self.out(torch.cat([torch.tanh(v["sum"]), torch.tanh(v["lin"]).float() + v["n"][:, None]], dim=1))


def _three(rounded_once: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Three(rounded_once), _TanhBoth())


def test_only_the_leaves_the_wire_rounded_are_widened_back():
    """A boundary of three leaves under bf16: the float32 sum is rounded for the wire and widened back
    on receipt (its header flags it), the Linear's bfloat16 output crosses as it is and stays bfloat16,
    the integer leaf is untouched: the run equals autocast with the sum rounded once, bitwise."""
    plan = _no_ps(one_vw_plan([1], nm=1, d=0, num_layers=2))
    got = _run(_three(), plan, "bf16")
    ref = _autocast_reference(_three(rounded_once=True))
    assert got[0] == ref[0]
    assert all(np.array_equal(got[1][l], w) for l, w in ref[1].items())
    assert _max_diff(got, _autocast_reference(_three())) > 0


# --- tied weights under bf16: the gradients cross in bfloat16 ---------------------------------------

VOCAB, WIDTH = 50, 32


class _TokenEmbedding(nn.Module):
    """Token ids -> float32 embeddings (autocast casts no embedding). ``rounded_grad``: the gradient
    this use gives the weight is rounded to bfloat16, as a bf16 exchange of tied gradients rounds it."""

    def __init__(self, weight: nn.Parameter, rounded_grad: bool = False):
        super().__init__()
        self.weight, self.rounded_grad = weight, rounded_grad

    def forward(self, ids):
        w = self.weight
        if self.rounded_grad:
            w = w.view_as(w)
            w.register_hook(lambda g: g.to(torch.bfloat16).to(torch.float32))
        return F.embedding(ids, w)


class _TiedHead(nn.Module):
    """Logits ``h @ W^T`` with the embedding's matrix (autocast casts it: its gradient is bfloat16's)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return h @ self.weight.t()


def _tied_lm(reference: bool = False) -> nn.Sequential:
    """Embedding, a residual block (float32 out), the tied head; cut after the block. ``reference``:
    with the two roundings the bf16 pipeline makes, the boundary (once) and the embedding's tied
    gradient, in one process."""
    torch.manual_seed(0)
    emb = nn.Embedding(VOCAB, WIDTH)
    nn.init.normal_(emb.weight, std=0.2)            # logits of a trainable size (GPT-2 starts at 0.02)
    block = _Residual(WIDTH)
    return nn.Sequential(_TokenEmbedding(emb.weight, reference), _RoundedOutput(block) if reference else block,
                         _TiedHead(emb.weight))


def _tokens():
    from hetpipe.run.data import Batches
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (128, 8), generator=g)
    return Batches(ids, torch.roll(ids, -1, dims=1), 16, seed=1)


def _lm_loss(out, y):
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _owned_weights(model: nn.Sequential):
    """Per layer, its parameters not held by an earlier layer (a tied weight counts for its owner)."""
    seen, out = set(), {}
    for l, layer in enumerate(model):
        own = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        out[l] = torch.cat([p.detach().reshape(-1) for p in own]).numpy() if own else np.zeros(0, np.float32)
    return out


def test_bf16_tied_gradients_cross_in_bfloat16_and_equal_a_reference_rounding_them_once():
    """A tied embedding and head on two stages under bf16: each holder's gradient crosses in bfloat16,
    half the bytes of float32, and every holder sums the stages' gradients as they crossed, in
    float32. The head's gradient comes through autocast's cast, so it is bfloat16's already; the
    embedding's is float32 and rounds. The run equals, bitwise, plain autocast in one process that
    rounds the same two values (the boundary, once; the embedding's gradient). The trade: it differs
    from one that rounds the boundary only by less than half of what float32 training differs from it
    by (4.1e-5 against 1.5e-4 measured, losses and weights)."""
    plan = _no_ps(one_vw_plan([2], nm=1, d=0, num_layers=3))

    def run(precision):
        r = Trainer(_tied_lm(), _lm_loss, sgd(), _tokens(), plan=plan, epochs=EPOCHS,
                    numerics=Numerics(precision=precision)).replay()
        return [v for _, v in sorted(r.losses[0].items())], r.weights

    def plain(model):
        losses = rm.plain_training(model, _lm_loss, sgd(), _tokens(), EPOCHS, autocast=True)
        return losses, _owned_weights(model)

    got = run("bf16")
    ref = plain(_tied_lm(reference=True))
    assert got[0] == ref[0] and all(np.array_equal(got[1][l], w) for l, w in ref[1].items())
    boundary_only = _tied_lm()
    boundary_only[1] = _RoundedOutput(boundary_only[1])
    trade = _max_diff(got, plain(boundary_only))
    assert 0 < trade < 0.5 * _max_diff(run("fp32"), ref)


def test_tied_gradients_cross_in_the_runs_precision_after_the_activation_gradient(monkeypatch):
    """What the tied LM's stages send: the tied gradients as float32 under "fp32" and as bfloat16
    (half the bytes) under "bf16"; the last stage sends each minibatch's activation gradient before
    its tied gradient."""
    from hetpipe.transport.loopback import LoopbackTransport
    from hetpipe.transport.protocol import GRAD, TIED
    send = LoopbackTransport.send
    for precision, dtype, size in (("fp32", "float32", 4), ("bf16", "bfloat16", 2)):
        seen = []

        def recording_send(self, dest, h, slot=None):
            seen.append(h)
            send(self, dest, h, slot)

        monkeypatch.setattr(LoopbackTransport, "send", recording_send)
        Trainer(_tied_lm(), _lm_loss, sgd(), _tokens(), plan=one_vw_plan([2], nm=2, d=0, num_layers=3), epochs=1,
                numerics=Numerics(precision=precision)).replay()
        monkeypatch.undo()
        tied = [h for h in seen if h.kind == TIED]
        assert len(tied) == 2 * 8 and {(h.dtype, h.nbytes) for h in tied} == {(dtype, VOCAB * WIDTH * size)}
        last = [(h.kind, h.mb) for h in seen if h.stage == 1 and h.kind in (GRAD, TIED)]
        assert last == [(kind, mb) for mb in range(8) for kind in (GRAD, TIED)]


def _wire_headers(monkeypatch, precision):
    from hetpipe.transport.loopback import LoopbackTransport
    seen = []
    send = LoopbackTransport.send

    def recording_send(self, dest, h, slot=None):
        seen.append(h)
        send(self, dest, h, slot)

    monkeypatch.setattr(LoopbackTransport, "send", recording_send)
    Trainer(_residual_mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([1], nm=2, d=0, num_layers=5),
            epochs=1, numerics=Numerics(precision=precision)).replay()
    monkeypatch.undo()
    return seen


def test_the_wire_carries_bfloat16_activations_and_gradients_and_float32_weights(monkeypatch):
    from hetpipe.transport.protocol import ACT, GRAD, PULL, PUSH, WEIGHTS
    fp32, bf16 = _wire_headers(monkeypatch, "fp32"), _wire_headers(monkeypatch, "bf16")

    def by_kind(headers, kind):
        return [h for h in headers if h.kind == kind]

    for kind in (ACT, GRAD):
        a, b = by_kind(fp32, kind), by_kind(bf16, kind)
        assert len(a) == len(b) == 8
        assert all(h.dtype == "float32" and h.nbytes == 16 * 64 * 4 for h in a)
        assert all(h.dtype == "bfloat16" and h.nbytes == 16 * 64 * 2 for h in b)
    for kind in (PUSH, PULL, WEIGHTS):
        assert [(h.dtype, h.nbytes) for h in by_kind(fp32, kind)] == [(h.dtype, h.nbytes) for h in by_kind(bf16, kind)]
    assert {h.dtype for h in by_kind(bf16, PUSH) + by_kind(bf16, WEIGHTS)} == {"float32"}


def test_the_plan_records_its_precision():
    plan = one_vw_plan([3], nm=1, d=0)
    bf16 = dataclasses.replace(plan, precision="bf16")
    assert Plan.from_json(bf16.to_json()) == bf16
    old = json.loads(plan.to_json())
    del old["precision"]
    assert Plan.from_dict(old).precision == "fp32"
    with pytest.raises(ValueError, match="precision must be one of"):
        dataclasses.replace(plan, precision="fp8")
    with pytest.raises(ValueError, match="precision must be one of"):
        Trainer(mlp(), cross_entropy, sgd(), synthetic(), numerics=Numerics(precision="half"))


def _toy_profile():
    from hetpipe.plan.profile import LayerProfile, ModelProfile
    acts = [4000, 8000, 2000, 100]
    return ModelProfile("toy", 1, tuple(LayerProfile(f"l{i}", {"g": 1.0}, {"g": 2.0}, activation_bytes=a,
                                                     param_bytes=40) for i, a in enumerate(acts)))


# One node of two devices joined by a 1 MB/s link with 1 ms latency: one VW of two stages.
_SLOW_LINK = {"name": "pair", "device_types": {"g": {"memory_bytes": 10**9, "speed": 1.0}},
              "nodes": [{"name": "n0", "type": "g", "count": 2}],
              "intra_node": {"bandwidth": 1e6, "latency": 1e-3}, "inter_node": {"bandwidth": 1e6, "latency": 1e-3}}


@pytest.mark.parametrize("precision, wire_bytes", [("fp32", 8000), ("bf16", 4000)])
def test_the_planner_and_simulator_send_half_the_bytes_under_bf16(precision, wire_bytes):
    """Layers of 1 s forward and 2 s backward cut in the middle, after layer 1 (8000 float32 bytes):
    the send takes 1 ms + bytes / 1 MB/s, and 3 waves of Nm = 1 simulate to 3 x (12 s + 2 sends)."""
    from hetpipe.plan import make_plan
    from hetpipe.schedule import simulate_plan
    plan = make_plan(_SLOW_LINK, _toy_profile(), policy="NP", nm=1, d=0, precision=precision)
    first, second = plan.virtual_workers[0].stages
    send = 1e-3 + wire_bytes / 1e6
    assert (first.stop, plan.precision, plan.meta["wire_factor"]) == (2, precision, wire_bytes / 8000)
    assert first.send_time == pytest.approx(send, rel=1e-12) and second.send_time == 0.0
    assert simulate_plan(plan, waves=3).makespan_s == pytest.approx(3 * (12.0 + 2 * send), rel=1e-12)
    assert Plan.from_json(plan.to_json()) == plan


def test_a_profile_already_in_two_byte_activations_is_not_halved_again():
    from hetpipe.plan.precision import wire_factor
    from hetpipe.plan.profile import load_profile
    gpt = load_profile("gpt")
    assert gpt.activation_dtype == "bfloat16"
    assert wire_factor("bf16", gpt.activation_dtype) == 1.0
    assert wire_factor("bf16") == 0.5 and wire_factor("fp32") == 1.0
    with pytest.raises(ValueError, match="activation_dtype must be one of"):
        dataclasses.replace(_toy_profile(), activation_dtype="int8")


def test_recomputed_segments_rerun_under_autocast():
    """Recomputation reruns a segment under the same autocast as its forward: equal bitwise to no
    recomputation (a float32 rerun would give other gradients)."""
    from common import with_recompute
    plan = one_vw_plan([3], nm=2, d=0)
    plain = _run(mlp(), plan, "bf16")
    again = _run(mlp(), with_recompute(plan, [[0, 1, 2], [4, 5]]), "bf16")
    assert plain[0] == again[0] and all(np.array_equal(plain[1][l], again[1][l]) for l in plain[1])


def test_overriding_a_plans_precision_drops_its_prediction():
    from hetpipe.run.workload import with_precision
    plan = dataclasses.replace(one_vw_plan([3], nm=1, d=0), throughput=2.0)
    assert with_precision(plan, "fp32") is plan
    bf16 = with_precision(plan, "bf16")
    assert (bf16.precision, bf16.throughput) == ("bf16", 0.0) and "precision fp32" in bf16.meta["prediction"]
    kept = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=bf16).resolve_plan()
    assert kept.precision == "bf16"


# --- fp16 with dynamic loss scaling ---------------------------------------------------------------

def _fp16_reference(model, init_scale, growth_interval, clip=None):
    """Plain PyTorch's fp16 recipe in one process: autocast, GradScaler, unscale before clipping."""
    opt = sgd()(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    data, losses, scales = synthetic(), [], []
    for e in range(EPOCHS):
        data.set_epoch(e)
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = cross_entropy(model(x), y)
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    weights = {l: torch.cat([p.detach().reshape(-1) for p in layer.parameters()]).numpy()
               for l, layer in enumerate(model) if list(layer.parameters())}
    return losses, weights, scales + [scaler.get_scale()]


@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp16_loss_scaling_skips_the_steps_plain_gradscaler_skips(clip):
    """A 2**40 initial scale overflows float16 gradients: the first steps are skipped and the scale
    halves until they fit, then grows every 3 good steps; one VW of three stages (Nm = 1, D = 0, no PS
    round trip) skips the same steps and trains like GradScaler in one process."""
    plan = _no_ps(one_vw_plan([2, 4], nm=1, d=0))
    ref_losses, ref_weights, scales = _fp16_reference(mlp(), 2.0 ** 40, 3, clip)
    ref_skipped = [p for p in range(len(scales) - 1) if scales[p + 1] < scales[p]]     # the scale halved after p
    r = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=EPOCHS,
                numerics=Numerics(precision="fp16", clip_grad_norm=clip, loss_scale={"init_scale": 2.0 ** 40, "growth_interval": 3})).replay()
    got = [v for _, v in sorted(r.losses[0].items())]
    assert len(ref_skipped) >= 5
    assert r.loss_scale[0]["skipped_minibatches"] == ref_skipped
    assert r.loss_scale[0]["scale"] == scales[-1]
    assert max(abs(a - b) for a, b in zip(got, ref_losses)) <= 1e-5
    assert max(float(np.abs(r.weights[l] - w).max()) for l, w in ref_weights.items()) <= 1e-5
    moved = _run(mlp(), plan, "fp32")
    assert max(float(np.abs(moved[1][l] - w).max()) for l, w in ref_weights.items()) > 1e-4


def test_fp16_sends_float16_on_the_wire(monkeypatch):
    headers = _wire_headers(monkeypatch, "fp16")
    acts = {h.dtype for h in headers if h.kind in (1, 2)}
    assert acts == {"float16"}, acts


def test_a_diverging_fp16_run_stops_naming_the_vw():
    from hetpipe.transport.protocol import StageError

    def nan_loss(out, y):
        return cross_entropy(out, y) * float("nan")

    with pytest.raises(StageError, match=r"VW 0's gradients overflowed at every loss scale"):
        Trainer(mlp(), nan_loss, sgd(), synthetic(), plan=one_vw_plan([3], nm=1, d=0),
                numerics=Numerics(precision="fp16", loss_scale={"init_scale": 2.0 ** -20})).replay()
