"""Models as users write them — pytree boundaries, side inputs, tied weights, BatchNorm, dropout —
trained by the replay against plain PyTorch in one process (or against the replay itself for
random state)."""

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

import real_models as rm  # noqa: E402
from common import cross_entropy, one_vw_plan, sgd, synthetic, two_vw_plan, with_recompute  # noqa: E402

from hetpipe.plan.types import Plan  # noqa: E402
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Numerics, PSRule, Planning, Reporting


def _max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _replay_vs_plain(make, data, cuts, loss=cross_entropy, epochs=1, **kw):
    model, ref = make(), make()
    plain = rm.plain_training(ref, loss, sgd(), data, epochs)
    n = len(list(model))
    result = Trainer(model, loss, sgd(), data, plan=one_vw_plan(cuts, nm=1, d=0, num_layers=n), epochs=epochs,
                     reporting=Reporting(progress=False), **kw).replay()
    got = [v for _, v in sorted(result.losses[0].items())]
    return model, ref, max(abs(a - b) for a, b in zip(got, plain)), plain


# --- 1. pytree boundaries and side inputs ---------------------------------------------------------

@pytest.mark.parametrize("cuts", [[], [1, 2, 3], [2]])
def test_pytree_boundaries_and_side_inputs_equal_plain_pytorch(cuts):
    model, ref, loss_diff, plain = _replay_vs_plain(rm.pytree_model, rm.DictBatches(), cuts, epochs=2)
    assert loss_diff <= 1e-6 and _max_param_diff(model, ref) <= 1e-6
    assert plain[0] != plain[-1]


def test_split_startup_halves_every_input_leaf_and_side_input():
    data = rm.DictBatches()
    ref = Trainer(rm.pytree_model(), cross_entropy, sgd(), data, plan=one_vw_plan([1, 3], 2, 0, num_layers=4),
                  reporting=Reporting(progress=False)).replay()
    got = Trainer(rm.pytree_model(), cross_entropy, sgd(), data, plan=one_vw_plan([1, 3], 2, 0, num_layers=4),
                  planning=Planning(split_startup=3), reporting=Reporting(progress=False)).replay()
    assert max(abs(got.losses[0][p] - ref.losses[0][p]) for p in ref.losses[0]) <= 1e-6
    assert max(float(np.abs(got.weights[l] - ref.weights[l]).max(initial=0)) for l in ref.weights) <= 1e-6


def test_boundary_specs_hold_the_pytree_and_integer_leaves_carry_no_gradient():
    spec = Trainer(rm.pytree_model(), cross_entropy, sgd(), rm.DictBatches(),
                   plan=one_vw_plan([1, 2, 3], 1, 0, num_layers=4)).spec(one_vw_plan([1, 2, 3], 1, 0, num_layers=4))
    tup, dct = spec.boundaries[1], spec.boundaries[2]
    assert [l.dtype for l in tup.leaves] == [torch.float32, torch.int64] and tup.grad_leaves == (0,)
    assert len(dct.leaves) == 3 and dct.grad_leaves == (0, 1)       # dict leaves in insertion order: h, skip, count
    assert tup.nbytes(8) == 8 * 24 * 4 + 8 * 8


class _MeanEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids).mean(dim=1)


def test_a_boundary_of_integer_tensors_only_sends_an_empty_gradient():
    ids = torch.randint(0, 50, (64, 6), generator=torch.Generator().manual_seed(2))
    from hetpipe.run.data import Batches
    data = Batches(ids, ids[:, 0] % 10, 8, shuffle=False)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Identity(), _MeanEmbedding(50, 16), nn.Linear(16, 10))

    model, ref, loss_diff, _ = _replay_vs_plain(make, data, [1])
    assert loss_diff <= 1e-6 and _max_param_diff(model, ref) <= 1e-6


class _ReturnsString(nn.Module):
    def forward(self, x):
        return x, "not a tensor"


class _Broken(nn.Module):
    def forward(self, x):
        raise KeyError("the broken layer's own problem")


def test_a_non_tensor_leaf_is_one_error_naming_the_layer_and_the_type():
    model = nn.Sequential(nn.Linear(64, 10), _ReturnsString(), nn.Identity())
    plan = one_vw_plan([1], 1, 0, num_layers=3)
    with pytest.raises(TypeError, match=r"layer 1 \(_ReturnsString\) returned a str leaf at \[1\]"):
        Trainer(model, cross_entropy, sgd(), synthetic(), plan=plan).replay()


def test_a_layer_failing_at_shape_inference_names_itself_and_its_error():
    model = nn.Sequential(nn.Linear(64, 10), _Broken(), nn.Identity())
    plan = one_vw_plan([2], 1, 0, num_layers=3)
    with pytest.raises(ValueError, match=r"layer 1 failed on the first minibatch during shape inference: "
                                         r"KeyError: .*the broken layer's own problem"):
        Trainer(model, cross_entropy, sgd(), synthetic(), plan=plan).replay()


def test_a_missing_side_input_names_the_layer_and_the_key():
    class NeedsTokens(nn.Identity):
        hetpipe_side_inputs = ("tokens",)

        def forward(self, x, tokens):
            return x

    model = nn.Sequential(nn.Linear(64, 10), NeedsTokens())
    with pytest.raises(ValueError, match=r"layer 1 \(NeedsTokens\) declares side inputs \['tokens'\], but the "
                                         "minibatch inputs are a Tensor"):
        Trainer(model, cross_entropy, sgd(), synthetic(), plan=one_vw_plan([1], 1, 0, num_layers=2)).replay()


# --- 2. tied weights ------------------------------------------------------------------------------

@pytest.mark.parametrize("cuts", [[], [2], [1, 3]])
def test_tied_weights_equal_plain_pytorch_and_stay_one_tensor(cuts):
    model, ref, loss_diff, _ = _replay_vs_plain(rm.tied_mlp, synthetic(), cuts, loss=rm.tied_loss, epochs=2)
    assert model[0].weight is model[4].weight
    assert loss_diff <= 1e-6 and _max_param_diff(model, ref) <= 1e-6
    assert float((ref[0].weight - rm.tied_mlp()[0].weight).detach().abs().max()) > 1e-3      # it trained


def test_tied_weights_need_the_exchange():
    """With the owner's gradient alone (the head's contribution dropped), the result is far off."""
    model, ref, _, _ = _replay_vs_plain(rm.tied_mlp, synthetic(), [2], loss=rm.tied_loss)
    untied = rm.tied_mlp()
    untied[4].weight = nn.Parameter(untied[0].weight.detach().clone())
    rm.plain_training(untied, rm.tied_loss, sgd(), synthetic())
    assert _max_param_diff(model, ref) <= 1e-6 < float((untied[0].weight - ref[0].weight).detach().abs().max()) / 100


@pytest.mark.parametrize("nm,d,split", [(2, 0, 0), (2, 1, 0), (3, 1, 2)])
def test_tied_weights_across_stages_run_any_schedule_and_replicas_agree(nm, d, split):
    model = rm.tied_mlp()
    plan = two_vw_plan(([2], [1, 3]), (0.0, 0.0), nm=nm, d=d, num_layers=5)
    result = Trainer(model, rm.tied_loss, sgd(), synthetic(), plan=plan, epochs=2,
                     planning=Planning(split_startup=split)).replay()
    assert sorted(result.weights) == [0, 1, 2, 3, 4] and result.weights[4].size == 0    # one copy, on layer 0
    assert all(np.isfinite(v) for per in result.losses.values() for v in per.values())


# --- 3. BatchNorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cuts,recompute", [([], None), ([2], None), ([1, 3], [(0,), (1, 2), ()])])
def test_batchnorm_equals_plain_pytorch_in_train_and_eval(cuts, recompute):
    data = rm.images()
    model, ref = rm.resnet(), rm.resnet()
    rm.plain_training(ref, cross_entropy, sgd(), data, epochs=2)
    plan = one_vw_plan(cuts, nm=1, d=0, num_layers=4)
    if recompute:
        plan = with_recompute(plan, recompute)
    Trainer(model, cross_entropy, sgd(), data, plan=plan, epochs=2).replay()
    x = rm.images(n=16, seed=9).x
    for mode in ("eval", "train"):
        getattr(model, mode)()
        getattr(ref, mode)()
        with torch.no_grad():
            assert float((model(x) - ref(x)).detach().abs().max()) <= 1e-5, mode
    assert float((ref[0][1].running_mean - rm.resnet()[0][1].running_mean).detach().abs().max()) > 1e-3
    counters = {n: b for n, b in ref.named_buffers() if not b.is_floating_point()}
    assert counters and all(int(b) > 0 for b in counters.values())
    assert {n: int(b) for n, b in model.named_buffers() if n in counters} == {n: int(b) for n, b in counters.items()}


def test_recomputing_batchnorm_layers_is_exact():
    data = rm.images()
    plan = one_vw_plan([2], nm=2, d=0, num_layers=4)
    ref = Trainer(rm.resnet(), cross_entropy, sgd(), data, plan=plan, epochs=2).replay()
    got = Trainer(rm.resnet(), cross_entropy, sgd(), data, plan=with_recompute(plan, [(0, 1), (3,)]),
                  epochs=2).replay()
    assert got.losses == ref.losses
    assert all(np.array_equal(got.weights[l], ref.weights[l]) and np.array_equal(got.buffers[l], ref.buffers[l])
               for l in ref.weights)


@pytest.mark.parametrize("aggregate", ["mean", "sum"])
def test_two_vws_average_batchnorm_statistics_and_aggregate_weights(aggregate):
    """2 one-stage VWs, nm = 1, D = 0 against :func:`real_models.vw_waves` (plain PyTorch)."""
    data = rm.images()
    batches = list(data)
    ref = rm.vw_waves(rm.resnet(), cross_entropy, sgd(), batches, 2, aggregate)
    model = rm.resnet()
    plan = two_vw_plan(([], []), (0.0, 0.0), nm=1, d=0, num_layers=4)
    Trainer(model, cross_entropy, sgd(), data, plan=plan, ps=PSRule(aggregate=aggregate)).replay()
    assert _max_param_diff(model, ref) <= 1e-5
    for (n, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        if a.is_floating_point():
            assert float((a - b).detach().abs().max()) <= 1e-5, n
        else:
            assert int(b) > 0 and torch.equal(a, b), n      # num_batches_tracked: VW 0's count


# --- 4. random state ------------------------------------------------------------------------------

def test_dropout_recompute_replays_the_random_state_bitwise():
    plan = one_vw_plan([3], nm=2, d=0)
    ref = Trainer(rm.dropout_mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=2).replay()
    got = Trainer(rm.dropout_mlp(), cross_entropy, sgd(), synthetic(), plan=with_recompute(plan, [(1, 2), (4,)]),
                  epochs=2).replay()
    assert got.losses == ref.losses and all(np.array_equal(got.weights[l], ref.weights[l]) for l in ref.weights)
    other = Trainer(rm.dropout_mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=2,
                    numerics=Numerics(seed=1)).replay()
    assert other.losses != ref.losses                                # dropout is live and follows the seed


def test_the_stage_seeding_leaves_the_callers_random_state_alone():
    model, data = rm.dropout_mlp(), synthetic()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    Trainer(model, cross_entropy, sgd(), data, plan=one_vw_plan([3], 1, 0)).replay()
    assert torch.equal(torch.rand(3), expected)


# --- 5. aggregate in the plan ---------------------------------------------------------------------

def test_aggregate_round_trips_and_old_plans_read_as_mean():
    import dataclasses
    plan = dataclasses.replace(one_vw_plan([3], 1, 0), aggregate="sum")
    assert Plan.from_json(plan.to_json()).aggregate == "sum"
    old = plan.to_dict()
    del old["aggregate"]
    assert Plan.from_dict(old).aggregate == "mean"
    with pytest.raises(ValueError, match="plan: aggregate must be one of \\['mean', 'sum'\\], got 'max'"):
        dataclasses.replace(plan, aggregate="max")
    got = Trainer(copy.deepcopy(rm.dropout_mlp()), cross_entropy, sgd(), synthetic(), plan=plan,
                  ps=PSRule(aggregate="mean")).resolve_plan()
    assert got.aggregate == "mean"


# --- a tiny Hugging Face GPT-2 (built from its config, no download) ---------------------------------

def _gpt2(dropout: float):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=50, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


class _GPT2Embed(nn.Module):
    def __init__(self, t) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop

    def forward(self, inputs):
        ids = inputs["input_ids"]
        return self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)))


class _GPT2Head(nn.Module):
    def __init__(self, t, head) -> None:
        super().__init__()
        self.ln_f, self.lm_head = t.ln_f, head

    def forward(self, h):
        return self.lm_head(self.ln_f(h))


def _gpt2_layers(m):
    return [_GPT2Embed(m.transformer), *m.transformer.h, _GPT2Head(m.transformer, m.lm_head)]


def _lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class _Tokens:
    def __init__(self, n: int = 32, batch: int = 4, seq: int = 12) -> None:
        self.ids = torch.randint(0, 50, (n, seq), generator=torch.Generator().manual_seed(7))
        self.batch = batch

    def __len__(self) -> int:
        return len(self.ids) // self.batch

    def __iter__(self):
        for i in range(0, len(self) * self.batch, self.batch):
            yield {"input_ids": self.ids[i:i + self.batch]}, self.ids[i:i + self.batch]


@pytest.mark.slow
def test_tiny_gpt2_with_its_tied_head_split_across_stages_equals_plain_pytorch():
    pytest.importorskip("transformers")
    data = _Tokens()
    ref = _gpt2(0.0)
    opt = sgd(lr=0.1)(ref.parameters())
    plain = []
    for x, y in data:
        opt.zero_grad()
        loss = ref(x["input_ids"], labels=y).loss               # Hugging Face's own causal-LM loss
        loss.backward()
        opt.step()
        plain.append(float(loss.detach()))
    m = _gpt2(0.0)
    layers = _gpt2_layers(m)
    result = Trainer(layers, _lm_loss, sgd(lr=0.1), data, plan=one_vw_plan([1, 3], 1, 0, num_layers=4),
                     reporting=Reporting(progress=False)).replay()
    got = [v for _, v in sorted(result.losses[0].items())]
    assert max(abs(a - b) for a, b in zip(got, plain)) <= 1e-5
    assert m.lm_head.weight is m.transformer.wte.weight
    assert max(float((p - q).detach().abs().max()) for p, q in zip(m.parameters(), ref.parameters())) <= 1e-5
    # GPT-2's default dropout trains too, with the head still tied
    drop = _gpt2(0.1)
    Trainer(_gpt2_layers(drop), _lm_loss, sgd(lr=0.1), data, plan=one_vw_plan([1, 3], 2, 0, num_layers=4),
            reporting=Reporting(progress=False)).replay()
    assert drop.lm_head.weight is drop.transformer.wte.weight
