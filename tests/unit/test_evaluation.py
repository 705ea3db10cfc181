"""Evaluation points, callbacks, early stopping and TensorBoard, in the replay: evaluation losses
against plain PyTorch evaluating the same model after the same steps (BatchNorm in eval mode), and a
stopped run against the run that trains exactly the waves the stop keeps."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

import real_models as rm  # noqa: E402
from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic, two_vw_plan  # noqa: E402

from hetpipe.run.callbacks import Callback  # noqa: E402
from hetpipe.run.data import Batches  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe.run.config import Numerics, Reporting


def accuracy(out, y):
    return float((out.argmax(1) == y).float().mean())


def _plain_with_evals(model, data, eval_data, every, epochs=1):
    """Plain training; after every ``every`` steps, the loss and accuracy on eval_data in eval mode."""
    opt = sgd()(model.parameters())
    evals, step = [], 0
    for e in range(epochs):
        data.set_epoch(e)
        for x, y in data:
            opt.zero_grad()
            cross_entropy(rm.run_layers(model, x), y).backward()
            opt.step()
            step += 1
            if step % every == 0:
                model.eval()
                with torch.no_grad():
                    n = sum(len(y) for _, y in eval_data)
                    outs = [(rm.run_layers(model, x), y) for x, y in eval_data]
                    loss = sum(float(cross_entropy(o, y)) * len(y) for o, y in outs) / n
                    acc = sum(accuracy(o, y) * len(y) for o, y in outs) / n
                model.train()
                evals.append((step // every * every - 1, loss, acc))
    return evals


@pytest.mark.parametrize("make, data, cuts, layers", [
    (mlp, synthetic, [2, 4], 6),
    (rm.resnet, rm.images, [1, 2], None),
], ids=["mlp-3-stages", "batchnorm-resnet"])
def test_evaluation_points_equal_plain_pytorch_eval_mode(make, data, cuts, layers):
    train, held = data(), data(seed=9)
    held.shuffle = False
    n = layers or len(list(make()))
    result = Trainer(make(), cross_entropy, sgd(), train, plan=one_vw_plan(cuts, nm=1, d=0, num_layers=n),
                     reporting=Reporting(progress=False, eval_data=held, eval_every=2, eval_metric=accuracy)).replay()
    want = _plain_with_evals(make(), data(), held, every=2)
    got = [(e["wave"], e["loss"], e["metric"]) for e in result.evals]
    last = max(result.losses[0])
    assert [w for w, _, _ in got] == [w for w, _, _ in want if w < last]
    for (w, loss, acc), (_, ref_loss, ref_acc) in zip(got, want):
        assert abs(loss - ref_loss) <= 1e-5 and abs(acc - ref_acc) <= 1e-6, (w, loss, ref_loss)
    assert got[0][1] != got[-1][1]
    assert all(e["samples"] == sum(len(y) for _, y in held) for e in result.evals)


class Recorder(Callback):
    def __init__(self, stop_at_eval=None):
        self.waves, self.evals, self.stop_at_eval = [], [], stop_at_eval

    def on_wave_end(self, info):
        self.waves.append(info)

    def on_eval(self, info):
        self.evals.append(info)
        return self.stop_at_eval is not None and info.wave >= self.stop_at_eval


def _seq_data(minibatches):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16 * minibatches, 64, generator=g), torch.randint(0, 10, (16 * minibatches,), generator=g)
    return Batches(x, y, 16, shuffle=False)


def test_an_early_stop_trains_exactly_the_waves_up_to_the_stop_plus_d_plus_one():
    """D = 0, Nm = 2: a stop asked at the evaluation point after wave 2 ends the run after wave 3; the
    weights are bitwise those of the run given only waves 0..3's minibatches."""
    cb = Recorder(stop_at_eval=2)
    plan = one_vw_plan([3], nm=2, d=0)
    stopped = Trainer(mlp(), cross_entropy, sgd(), _seq_data(16), plan=plan,
                      reporting=Reporting(progress=False, eval_every=1, callbacks=[cb])).replay()
    assert stopped.stopped_after == 3 and sorted(stopped.losses[0]) == list(range(8))
    full = _seq_data(16)
    short = Trainer(mlp(), cross_entropy, sgd(), Batches(full.x[:128], full.y[:128], 16, shuffle=False), plan=plan,
                    reporting=Reporting(progress=False)).replay()
    assert stopped.losses == short.losses
    assert all(torch.equal(torch.from_numpy(stopped.weights[l]), torch.from_numpy(short.weights[l]))
               for l in short.weights)
    assert [i.wave for i in cb.waves] == [0, 1, 2, 3]
    assert cb.waves[1].loss == pytest.approx((short.losses[0][2] + short.losses[0][3]) / 2)
    assert [i.wave for i in cb.evals] == [0, 1, 2] and cb.evals[0].loss is None      # no eval data: decides only
    assert cb.waves[0].lr == pytest.approx(0.05)


def test_an_early_stop_with_two_vws_and_staleness_keeps_every_vw_on_the_same_waves():
    cb = Recorder(stop_at_eval=1)
    plan = two_vw_plan(([3], [2]), (0.0, 0.0), nm=2, d=1)
    result = Trainer(mlp(), cross_entropy, sgd(), _seq_data(40), plan=plan,
                     reporting=Reporting(progress=False, eval_every=2, callbacks=[cb])).replay()
    # Asked after wave 1: waves up to 1 + D + 1 = 3 are trained by both VWs, 4 x 2 minibatches each.
    assert result.stopped_after == 3
    assert {vw: sorted(l) for vw, l in result.losses.items()} == {0: list(range(8)), 1: list(range(8))}
    assert all(log.clocks[-1][1] == 4 for log in result.shard_logs.values())


def test_a_stop_asked_by_on_wave_end_takes_effect_at_the_next_evaluation_point():
    class StopAtWave1(Callback):
        def on_wave_end(self, info):
            return info.wave == 1

    result = Trainer(mlp(), cross_entropy, sgd(), _seq_data(20), plan=one_vw_plan([3], nm=2, d=0),
                     reporting=Reporting(progress=False, eval_every=3, callbacks=[StopAtWave1()])).replay()
    assert result.stopped_after == 3          # evaluation point after wave 2, + D + 1


def test_a_stop_asked_too_late_to_matter_trains_everything():
    """3 waves; a stop asked after wave 1 would end the run after wave 1 + D + 1 = 2, its last anyway."""
    result = Trainer(mlp(), cross_entropy, sgd(), _seq_data(6), plan=one_vw_plan([3], nm=2, d=0),
                     reporting=Reporting(progress=False, eval_every=2, callbacks=[Recorder(stop_at_eval=0)])).replay()
    assert result.stopped_after is None and sorted(result.losses[0]) == list(range(6))


def test_metrics_and_tensorboard_carry_waves_and_evaluations(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    held = synthetic(seed=9)
    Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([3], nm=2, d=0),
            numerics=Numerics(clip_grad_norm=1.0, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5)),
            reporting=Reporting(progress=False, eval_data=held, eval_every=2, metrics=tmp_path / "m.jsonl", tensorboard=tmp_path / "tb")).replay()
    events = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    waves = [e for e in events if e["event"] == "wave"]
    evals = [e for e in events if e["event"] == "eval"]
    assert len(waves) == 4 and [e["wave"] for e in evals] == [1]
    assert [w["lr"] for w in waves] == pytest.approx([0.05, 0.025, 0.0125, 0.00625])   # each wave's last step
    assert all(w["grad_norm"] > 0 for w in waves)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/staleness",
            "eval/loss"} <= set(acc.Tags()["scalars"])
    assert [s.value for s in acc.Scalars("train/loss")] == pytest.approx([w["loss"] for w in waves])


@pytest.mark.parametrize("bad, match", [
    ({"reporting": {"eval_every": 0}}, r"eval_every \(waves\) must be a whole number >= 1"),
    ({"reporting": {"eval_data": [1]}}, r"reporting.eval_data needs reporting.eval_every"),
    ({"reporting": {"eval_every": 1, "eval_metric": 3}}, "eval_metric must be a function"),
    ({"reporting": {"callbacks": [object()]}}, "has neither on_wave_end nor on_eval"),
])
def test_bad_evaluation_options_are_named(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([3], 1, 0), **bad)


def test_the_evaluation_pass_leaves_modules_in_their_mode():
    model = nn.Sequential(*rm.resnet())
    Trainer(model, cross_entropy, sgd(), rm.images(), plan=one_vw_plan([1, 2], nm=1, d=0, num_layers=len(model)),
            reporting=Reporting(progress=False, eval_data=rm.images(seed=9), eval_every=1)).replay()
    assert all(m.training for m in model.modules())
