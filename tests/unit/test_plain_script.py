"""A plain PyTorch script's pieces handed to the Trainer as they are, against plain PyTorch on one
process: a Hugging Face GPT-2 with its own loss, minibatches as mappings with ``labels``, an AdamW
object with decay / no-decay groups, a transformers warm-up + cosine schedule and clipping (1 VW,
Nm = 1, D = 0: the pipeline is plain training); schedules counted in the run's steps at 2 VWs;
evaluation every so many steps and EarlyStopping; and what the aggregation rule does per sample."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic, two_vw_plan  # noqa: E402

from hetpipe.run.callbacks import EarlyStopping, EvalInfo  # noqa: E402
from hetpipe.run.config import Numerics, PSRule, Reporting  # noqa: E402
from hetpipe.run.data import Batches  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402

transformers = pytest.importorskip("transformers")


def gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def hf_batches(n=12, batch=4, seq=16):
    ids = torch.randint(0, 64, (n * batch, seq), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids.split(batch)]


def adamw(model):
    """AdamW with no weight decay on biases and LayerNorm weights, the groups interleaved by layer."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-3)


def cosine(opt):
    return transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=24)


def test_a_hugging_face_recipe_equals_plain_pytorch():
    """The plain loop: ``model(**batch).loss``, clip, step, schedule; hetpipe: the same model, optimizer
    object, schedule factory and minibatches, two stages of one VW."""
    ref = gpt2()
    opt = adamw(ref)
    sched = cosine(opt)
    want = []
    for _ in range(2):
        for batch in hf_batches():
            loss = ref(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
            want.append(loss.item())

    model = gpt2()
    result = Trainer(model, None, adamw(model), hf_batches(), epochs=2,
                     plan=one_vw_plan([2], nm=1, d=0, num_layers=4),
                     numerics=Numerics(clip_grad_norm=0.5, lr_scheduler=cosine),
                     reporting=Reporting(progress=False)).replay()
    got = [v for _, v in sorted(result.losses[0].items())]
    assert len(got) == len(want) == 24
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
    ref_state = ref.state_dict()
    assert max(float((v - ref_state[k]).abs().max()) for k, v in model.state_dict().items()) <= 1e-5
    # The decay group's rate is the test's to see: without it the weights differ.
    model0 = gpt2()
    Trainer(model0, None, torch.optim.AdamW(model0.parameters(), lr=3e-3, weight_decay=0.0), hf_batches(), epochs=2,
            plan=one_vw_plan([2], nm=1, d=0, num_layers=4), reporting=Reporting(progress=False),
            numerics=Numerics(clip_grad_norm=0.5, lr_scheduler=cosine)).replay()
    assert max(float((v - ref_state[k]).abs().max()) for k, v in model0.state_dict().items()) > 1e-4


def test_an_optimizer_object_is_refused_when_it_cannot_be_rebuilt():
    model = mlp()
    with pytest.raises(ValueError, match=r"the SGD given has taken \d+ parameter step"):
        Trainer(model, cross_entropy, _with_state(model), synthetic())
    with pytest.raises(ValueError, match=r"group 0 of the SGD holds a tensor of shape \(3,\)"):
        Trainer(model, cross_entropy, torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), synthetic())
    with pytest.raises(ValueError, match=r"holds no group with the parameter\(s\) \['0.bias', '0.weight'\]"):
        Trainer(model, cross_entropy, torch.optim.SGD(list(model.parameters())[2:], lr=0.1), synthetic())
    with pytest.raises(TypeError, match="a torch.optim.Optimizer over the model or a factory"):
        Trainer(model, cross_entropy, "sgd", synthetic())


def _with_state(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return opt


class Rates:
    def __init__(self):
        self.lrs = []

    def on_wave_end(self, info):
        self.lrs.append(info.lr)


@pytest.mark.parametrize("counts", ["run", "vw"])
def test_a_schedule_counts_the_runs_steps_or_the_vws(counts):
    """2 VWs, Nm = 2: with "run", VW 0's step i takes the rate a plain loop takes at step 2i (each VW's
    scheduler steps once per step of either VW); with "vw", the rate of step i."""
    rates = Rates()
    Trainer(mlp(), cross_entropy, sgd(lr=1.0), synthetic(n=256), plan=two_vw_plan(([3], [2]), (0.0, 0.0), nm=2, d=0),
            numerics=Numerics(lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
                              lr_scheduler_steps=counts),
            reporting=Reporting(progress=False, callbacks=[rates])).replay()
    stride = 2 if counts == "run" else 1
    last_step = [(w + 1) * 2 - 1 for w in range(len(rates.lrs))]          # VW 0's last step of each wave
    assert len(rates.lrs) == 4
    assert rates.lrs == [pytest.approx(1.0 / (1 + stride * i)) for i in last_step]


def _evals(losses):
    return [EvalInfo(w, loss, None, 8, 0.0, (w + 1) * 4) for w, loss in enumerate(losses)]


def test_early_stopping_counts_evaluations_without_improvement_and_resumes_from_its_state():
    losses = [3.0, 2.0, 2.05, 1.99, 2.1, 2.2, 2.3]
    stop = EarlyStopping(patience=2, min_delta=0.02)
    asked = [stop.on_eval(i) for i in _evals(losses)]
    # 1.99 improves on 2.0 by less than min_delta: the second point in a row without an improvement.
    assert asked == [False, False, False, True, True, True, True]
    again = EarlyStopping(patience=2, min_delta=0.02)
    for i in _evals(losses)[:2]:
        again.on_eval(i)
    resumed = EarlyStopping(patience=2, min_delta=0.02)
    resumed.load_state_dict(again.state_dict())
    assert [resumed.on_eval(i) for i in _evals(losses)[2:]] == asked[2:]
    up = EarlyStopping(patience=1, monitor="metric", mode="max")
    assert [up.on_eval(EvalInfo(w, None, m, 8, 0.0)) for w, m in enumerate([0.5, 0.6, 0.6])] == [False, False, True]
    with pytest.raises(ValueError, match="monitors the evaluation metric"):
        EarlyStopping(monitor="metric").on_eval(EvalInfo(0, 1.0, None, 8, 0.0))
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=0)


def test_evaluation_every_so_many_steps_and_an_early_stop_by_the_evaluation_loss():
    """2 VWs x Nm = 2 make 4 of the run's steps a wave: every 8 steps is every 2 waves. The held-out
    loss rises (a learning rate that diverges), so EarlyStopping(patience=1) stops at the second point."""
    seen = []

    class Steps:
        def on_eval(self, info):
            seen.append((info.wave, info.step, info.loss))

    g = torch.Generator().manual_seed(1)
    held = Batches(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g), 16, shuffle=False)
    result = Trainer(mlp(), cross_entropy, sgd(lr=2.0, momentum=0.9), synthetic(n=512),
                     plan=two_vw_plan(([3], [2]), (0.0, 0.0), nm=2, d=0),
                     reporting=Reporting(progress=False, eval_data=held, eval_every_steps=8,
                                         callbacks=[Steps(), EarlyStopping(patience=1)])).replay()
    assert [(w, s) for w, s, _ in seen] == [(1, 8), (3, 16)][:len(seen)]
    assert seen[1][2] >= seen[0][2], "the test needs a held-out loss that does not improve"
    assert result.stopped_after == 4


def _per_sample_gap(aggregate):
    """Mean |loss - plain PyTorch's loss| over the run's minibatches in the order one process takes them."""
    ref = mlp()
    opt = sgd(lr=0.05, momentum=0.0)(ref.parameters())
    data = synthetic(n=512)
    want = []
    for x, y in data:
        loss = cross_entropy(ref(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    result = Trainer(mlp(), cross_entropy, sgd(lr=0.05, momentum=0.0), synthetic(n=512),
                     plan=two_vw_plan(([3], [2]), (0.0, 0.0), nm=1, d=0), ps=PSRule(aggregate=aggregate),
                     reporting=Reporting(progress=False)).replay()
    got = {j * 2 + vw: v for vw, losses in result.losses.items() for j, v in losses.items()}
    return sum(abs(got[i] - w) for i, w in enumerate(want)) / len(want)


def test_summed_updates_follow_plain_pytorchs_curve_per_sample_closer_than_averaged_ones():
    """The switch docs/training.md offers ("Why the loss differs"): with "sum" every minibatch's update
    reaches the global weights, as in a plain loop; "mean" averages two VWs' and advances at half the
    rate per sample."""
    mean, summed = _per_sample_gap("mean"), _per_sample_gap("sum")
    assert summed < 0.5 * mean, (summed, mean)


def test_the_start_up_line_says_what_the_rule_does_per_sample():
    from hetpipe.run.explain import update_rule

    plan = two_vw_plan(([3], [2]), (0.0, 0.0), nm=4, d=1)
    mean = update_rule(plan, 32)
    assert "1/2 as far as a one-process loop" in mean and "effective batch of 64" in mean
    assert "aggregate='sum'" in mean and "up to 3 minibatch(es) still in flight" in mean
    summed = update_rule(dataclasses.replace(plan, aggregate="sum"), 32)
    assert "advances as a one-process loop does" in summed and "up to 1 wave(s)" in summed
    one = update_rule(one_vw_plan([3], nm=1, d=0), 32, accumulate=2)
    assert "1 VW stepping once per 2 minibatches of 32" in one and "in flight" not in one


def test_callbacks_without_state_may_come_and_go_on_resume():
    """The saved states go to the callbacks that have a state_dict, in order; a logger added on resume
    changes nothing, and a stateful callback missing is refused naming the ones the run has."""
    from hetpipe.run.callbacks import Callbacks

    class Log:
        def on_wave_end(self, info):
            pass

    first = EarlyStopping(patience=2)
    first.on_eval(EvalInfo(0, 1.0, None, 8, 0.0))
    first.on_eval(EvalInfo(1, 1.5, None, 8, 0.0))
    saved = Callbacks([first], evaluates=True).state()
    again = EarlyStopping(patience=2)
    Callbacks([Log(), again], evaluates=True).load(saved)
    assert again.state_dict() == first.state_dict() == {"best": 1.0, "bad": 1}
    with pytest.raises(ValueError, match="holds the state of 1 callback.*the run has 0 with a state_dict: none"):
        Callbacks([Log()], evaluates=True).load(saved)


@pytest.mark.parametrize("counts", ["run", "vw"])
def test_a_schedule_factory_of_two_parameters_is_told_the_run_s_shape(counts):
    """2 VWs x Nm = 2 over 63 minibatches an epoch (62 dealt: one dropped), 2 epochs, a step every 2
    minibatches: the factory learns the VWs and the steps its scheduler will take, and a schedule sized
    by them ends at its last step exactly when the run does."""
    seen = []

    def linear(opt, run):
        seen.append(run)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / run.total_steps))

    rates = Rates()
    Trainer(mlp(), cross_entropy, sgd(lr=1.0), synthetic(n=252, batch=4),
            plan=two_vw_plan(([3], [2]), (0.0, 0.0), nm=2, d=0), epochs=2,
            numerics=Numerics(lr_scheduler=linear, lr_scheduler_steps=counts, accumulate=2),
            reporting=Reporting(progress=False, callbacks=[rates])).replay()
    run = seen[0]
    assert all(r == run for r in seen) and len(seen) == 4                 # every stage of both VWs
    assert (run.num_vws, run.minibatches_per_epoch, run.trained_per_epoch, run.epochs) == (2, 63, 62, 2)
    vw_steps = 31 * 2 // 2                   # a VW's steps: 31 minibatches an epoch, 2 epochs, a step every 2
    assert run.total_steps == (2 * vw_steps if counts == "run" else vw_steps)
    assert run.steps_per_epoch == run.total_steps // 2
    # The last wave's rate: the schedule's last step, one step short of its end.
    assert rates.lrs[-1] == pytest.approx(1.0 / run.total_steps * (2 if counts == "run" else 1))


def test_only_a_factory_requiring_a_second_argument_is_given_the_shape():
    """A factory's own defaulted parameters (a closure's ``k=3``, a partial's keywords) stay its own."""
    import functools

    from hetpipe.run.shape import takes_shape

    def sized(opt, run):
        return None

    step = torch.optim.lr_scheduler.StepLR
    assert takes_shape(sized) and takes_shape(lambda opt, run, k=3: None)
    assert not takes_shape(lambda opt, k=3: None) and not takes_shape(lambda opt: None)
    assert not takes_shape(functools.partial(step, step_size=3)) and not takes_shape(lambda *a: None)
