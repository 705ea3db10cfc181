"""LR schedules, clipping by the VW's global gradient norm, and non-finite losses and gradients,
against plain PyTorch on one process (1 VW, Nm = 1, D = 0: the pipeline is plain training)."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

import real_models as rm  # noqa: E402
from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic  # noqa: E402

from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe.stage.grad_norm import bits_float, float_bits  # noqa: E402
from hetpipe.transport.protocol import StageError  # noqa: E402
from hetpipe.run.config import Numerics, Reporting


def _plain(model, data, epochs, opt_factory, loss_fn=cross_entropy, scheduler=None, clip=None):
    opt = opt_factory(model.parameters())
    sched = scheduler(opt) if scheduler else None
    losses, norms = [], []
    for e in range(epochs):
        data.set_epoch(e)
        for x, y in data:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            if sched is not None:
                sched.step()
            losses.append(float(loss.detach()))
    return losses, norms


def _run(make, cuts, epochs=2, opt_factory=sgd(), loss_fn=cross_entropy, num_layers=6, **kw):
    model = make()
    result = Trainer(model, loss_fn, opt_factory, synthetic(),
                     plan=one_vw_plan(cuts, nm=1, d=0, num_layers=num_layers), epochs=epochs,
                     reporting=Reporting(progress=False), **kw).replay()
    return model, [v for _, v in sorted(result.losses[0].items())]


def _diff(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _warmup_cosine(opt):
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[4])


@pytest.mark.parametrize("scheduler", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5),
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5)),
    _warmup_cosine,
], ids=["step", "lambda-warmup", "warmup-cosine"])
def test_lr_schedule_equals_plain_pytorch(scheduler):
    model, got = _run(mlp, [2, 4], numerics=Numerics(lr_scheduler=scheduler))
    ref = mlp()
    want, _ = _plain(ref, synthetic(), 2, sgd(), scheduler=scheduler)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6 and _diff(model, ref) <= 1e-6
    # Without the schedule the run is another one: the test sees the schedule.
    unscheduled, got0 = _run(mlp, [2, 4])
    assert _diff(unscheduled, ref) > 1e-3


@pytest.mark.parametrize("cuts", [[], [2, 4], [1, 3, 5]])
def test_clipping_by_the_vws_global_norm_equals_clip_grad_norm(cuts):
    model, got = _run(mlp, cuts, numerics=Numerics(clip_grad_norm=0.3))
    ref = mlp()
    want, norms = _plain(ref, synthetic(), 2, sgd(), clip=0.3)
    assert min(norms) > 0.3, "every step must clip for this test to see the norm"
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5 and _diff(model, ref) <= 1e-5
    unclipped, _ = _run(mlp, cuts)
    assert _diff(unclipped, ref) > 1e-3


def test_clipping_counts_a_tied_weight_once():
    """The tied matrix is held by stages 0 and 2; its summed gradient enters the norm once."""
    def loss(out, y):
        return rm.tied_loss(out, y)

    model = rm.tied_mlp()
    g = torch.Generator().manual_seed(4)
    from hetpipe.run.data import Batches
    data = Batches(torch.randn(96, 64, generator=g), torch.randint(0, 64, (96,), generator=g), 16, seed=2)
    result = Trainer(model, loss, sgd(), data, plan=one_vw_plan([2, 4], nm=1, d=0, num_layers=5), epochs=2,
                     numerics=Numerics(clip_grad_norm=0.2), reporting=Reporting(progress=False)).replay()
    ref = rm.tied_mlp()
    want, norms = _plain(ref, data, 2, sgd(), loss_fn=loss, clip=0.2)
    got = [v for _, v in sorted(result.losses[0].items())]
    assert min(norms) > 0.2
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5 and _diff(model, ref) <= 1e-5


def test_the_norm_share_travels_exactly_in_a_header_word():
    for x in (0.0, 1e-300, 3.141592653589793, 1e300, float("inf")):
        assert bits_float(float_bits(x)) == x


def test_a_nan_loss_stops_the_run_naming_vw_stage_minibatch_and_wave():
    def nan_at_5(out, y, seen=[0]):  # noqa: B006 - counts the calls
        seen[0] += 1
        loss = cross_entropy(out, y)
        return loss * float("nan") if seen[0] == 6 else loss

    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    plan = one_vw_plan([3], nm=2, d=0)
    with pytest.raises(StageError, match=r"VW 0 stage 1 \(rank 1\): the loss of VW 0's minibatch 5 \(wave 2\) is nan"):
        Trainer(model, nan_at_5, sgd(), synthetic(), plan=plan, reporting=Reporting(progress=False)).replay()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "NaN weights reached the model"


class Sqrt(nn.Module):
    """sqrt of a parameter that starts at 0: a finite output whose gradient is inf."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x + torch.sqrt(self.s)


def test_an_infinite_gradient_stops_the_run_naming_its_stage():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 32), Sqrt(), nn.ReLU(), nn.Linear(32, 10))

    with pytest.raises(StageError, match=r"VW 0 stage 0 \(rank 0\): the gradient of VW 0's minibatch 0 \(wave 0\) "
                                         r"is not finite"):
        _run(make, [2], num_layers=4)


@pytest.mark.parametrize("bad, match", [
    ({"numerics": {"clip_grad_norm": 0}}, "clip_grad_norm must be a finite number > 0"),
    ({"numerics": {"clip_grad_norm": float("nan")}}, "clip_grad_norm must be a finite number > 0"),
    ({"numerics": {"clip_grad_norm": True}}, "clip_grad_norm must be a finite number > 0"),
    ({"numerics": {"lr_scheduler": 0.1}}, "lr_scheduler must be a factory"),
])
def test_bad_options_are_named(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([3], 1, 0), **bad)


def test_named_parameter_groups_reach_the_optimizer_factory():
    """AdamW with weight decay on matrices only, groups built by name on every stage, equals the same
    groups over the whole model in plain PyTorch."""
    from hetpipe import named_params

    seen = []

    @named_params
    def grouped(named):
        named = list(named)
        seen.append([n for n, _ in named])
        return torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.5},
                                  {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
                                 lr=0.01)

    model, got = _run(mlp, [2, 4], opt_factory=grouped)
    assert seen == [["0.weight", "0.bias"], ["2.weight", "2.bias"], ["4.weight", "4.bias", "5.weight", "5.bias"]]
    ref = mlp()
    want, _ = _plain(ref, synthetic(), 2, lambda params: grouped(ref.named_parameters()))
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6 and _diff(model, ref) <= 1e-6
    decayed_everywhere, _ = _run(mlp, [2, 4], opt_factory=lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.5))
    assert _diff(decayed_everywhere, ref) > 1e-4


@pytest.mark.parametrize("k, clip", [(2, None), (4, 0.3)])
def test_gradient_accumulation_equals_plain_pytorch(k, clip):
    """A step every k minibatches with their mean gradient (clipped as a whole), against a plain loop
    that divides each loss by k; 16 minibatches, so every group is full."""
    model, got = _run(mlp, [2, 4],
                      numerics=Numerics(accumulate=k, clip_grad_norm=clip, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5)))
    ref = mlp()
    opt = sgd()(ref.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    data, want = synthetic(), []
    for e in range(2):
        data.set_epoch(e)
        for i, (x, y) in enumerate(data):
            loss = cross_entropy(ref(x), y)
            (loss / k).backward()
            want.append(float(loss.detach()))
            if (len(want)) % k == 0:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                opt.step()
                sched.step()
                opt.zero_grad()
    assert len(want) % k == 0
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5 and _diff(model, ref) <= 1e-5
    every_step, _ = _run(mlp, [2, 4],
                         numerics=Numerics(clip_grad_norm=clip, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5)))
    assert _diff(every_step, ref) > 1e-4


def test_bad_accumulate_is_named():
    with pytest.raises(ValueError, match=r"accumulate \(minibatches\) must be a whole number >= 1"):
        Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([3], 1, 0),
                numerics=Numerics(accumulate=0))


def test_a_scheduler_that_steps_on_a_metric_is_refused_in_one_line():
    """ReduceLROnPlateau's step needs a metric no stage has: refused when the stage builds it, naming
    the class, instead of a TypeError at the first step."""
    from hetpipe.stage.optim import SchedulerError
    with pytest.raises(SchedulerError, match=r"^lr_scheduler: ReduceLROnPlateau steps on a metric[^\n]*$"):
        _run(mlp, [2, 4], numerics=Numerics(lr_scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o)))
