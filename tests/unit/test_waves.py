"""Waves of unequal length (hetpipe.plan.waves, hetpipe.loader.deal; docs/design.md "Waves of unequal length"):
a run against plain PyTorch training each VW's share by hand, the deal against the round-robin one,
the planner's rule against hand-computed lengths, the simulator's pacing, and the refusals."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
from common import cross_entropy, mlp  # noqa: E402

from hetpipe.loader.deal import deal_stream  # noqa: E402
from hetpipe.loader.source import VWStream, epoch_range  # noqa: E402
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan  # noqa: E402
from hetpipe.plan.waves import deal_for, speed_lengths, with_waves  # noqa: E402
from hetpipe.run.config import Numerics, Planning, PSRule, Reporting  # noqa: E402
from hetpipe.run.data import Batches  # noqa: E402
from hetpipe.run.replay import replay_run  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe.schedule.simulate import simulate_plan  # noqa: E402
from hetpipe.util.errors import ArgumentError  # noqa: E402

torch.set_num_threads(1)
LAYERS = 6
BATCH = 4
LR = 0.05


def plan_of(waves, nm: int = 2, d: int = 0, times=None) -> Plan:
    """One one-stage VW per entry of ``waves`` (its minibatches per wave; 0: the plan's ``nm``)."""
    times = times or [0.01] * len(waves)
    vws = tuple(VirtualWorkerPlan(v, (StagePlan(f"n0.g{v}", "cpu", 0, LAYERS, t, 2 * t),), nm=n)
                for v, (n, t) in enumerate(zip(waves, times)))
    return Plan(LAYERS, nm, d, "manual", vws, (ShardPlan(0, "n0", tuple(range(LAYERS))),))


def data(n_minibatches: int) -> Batches:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n_minibatches * BATCH, 64, generator=g)
    y = torch.randint(0, 10, (n_minibatches * BATCH,), generator=g)
    return Batches(x, y, BATCH, shuffle=False)


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def reference(waves, minibatches: int, weighted: bool = True):
    """Plain PyTorch, one process: each wave every VW trains its share of the round (its slots' minibatches
    in order) by SGD from the global weights, and the global weights move by the deltas weighed by the
    samples behind them (``n_v / S``), or with ``weighted=False`` by their plain mean (``1 / N``)."""
    model = mlp()
    params = [p for p in model.parameters()]
    x, y = data(minibatches).x, data(minibatches).y
    deal = deal_for(waves)
    rounds = minibatches // deal.num_slots
    per_wave = deal.per_slot                          # rounds per wave: the gcd of the waves
    total = sum(waves)
    W = [p.detach().clone() for p in params]
    for wave in range(rounds // per_wave):
        deltas = []
        for v, n in enumerate(waves):
            with torch.no_grad():
                for p, w in zip(params, W):
                    p.copy_(w)
            opt = torch.optim.SGD(params, lr=LR)
            for j in range(n):
                r = wave * per_wave + j // deal.shares[v]
                i = r * deal.num_slots + deal.offsets[v] + j % deal.shares[v]
                opt.zero_grad()
                cross_entropy(model(x[i * BATCH:(i + 1) * BATCH]), y[i * BATCH:(i + 1) * BATCH]).backward()
                opt.step()
            deltas.append([p.detach() - w for p, w in zip(params, W)])
        scale = [n / total if weighted else 1 / len(waves) for n in waves]
        W = [w + sum(s * dv[k] for s, dv in zip(scale, deltas)) for k, w in enumerate(W)]
    return torch.cat([w.reshape(-1) for w in W]).numpy()


def replayed(waves, minibatches: int) -> np.ndarray:
    plan = plan_of(waves)
    trainer = Trainer(mlp(), cross_entropy, sgd, data(minibatches), plan=plan, ps=PSRule(aggregate="mean"),
                      reporting=Reporting(progress=False))
    result = replay_run(trainer.spec(trainer.resolve_plan()))
    return np.concatenate([result.weights[l] for l in sorted(result.weights)])


def test_unequal_waves_train_as_plain_pytorch_weighing_each_vw_by_its_samples():
    waves, minibatches = [3, 2], 20           # rounds of 5: VW 0 takes 3 of each, VW 1 2; 4 waves
    got = replayed(waves, minibatches)
    want = reference(waves, minibatches)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    # The weighting acted: the plain mean of the same deltas is far from the run.
    plain = reference(waves, minibatches, weighted=False)
    assert np.abs(got - plain).max() > 100 * 2e-6


def test_equal_waves_given_per_vw_are_bitwise_the_plans_nm():
    a = replayed([2, 2], 16)
    b = replayed([0, 0], 16)
    assert np.array_equal(a, b)


def test_the_deal_of_equal_waves_is_round_robin_and_unequal_deals_every_minibatch_once():
    class Indices:
        """A source whose minibatches are their global indices (through the per-VW round-robin deal)."""

        def vw_stream(self, vw, num_vws, epochs, start_epoch=0, start_index=0, part="both"):
            return VWStream(lambda _: iter([i for e in range(start_epoch, epochs)
                                            for i in epoch_range(17, num_vws, vw, start_index if e == start_epoch else 0)]))

    equal = deal_for([4, 4, 4])
    assert equal.equal and equal.num_slots == 3
    for v in range(3):
        assert list(deal_stream(Indices(), equal, v, 1)) == list(epoch_range(17, 3, v, 0))
    deal = deal_for([6, 4, 2])                  # shares 3, 2, 1: rounds of 6
    assert deal.shares == (3, 2, 1) and deal.offsets == (0, 3, 5)
    got = [list(deal_stream(Indices(), deal, v, 1)) for v in range(3)]
    assert got[0] == [0, 1, 2, 6, 7, 8] and got[1] == [3, 4, 9, 10] and got[2] == [5, 11]
    assert sorted(i for g in got for i in g) == list(range(12))      # 17 // 6 rounds; 5 left over
    assert [deal.per_epoch(v, 17) for v in range(3)] == [6, 4, 2]


def test_speed_lengths_by_hand_and_a_vw_deeper_than_nm_keeps_its_wave():
    # wave times 1.0, 0.5, 0.8 s for Nm = 4: 4, 8 and round(5) minibatches
    assert speed_lengths(4, [1.0, 0.5, 0.8], [2, 2, 2]) == [4, 8, 5]
    # a VW of 6 stages with Nm = 4 would hold more in flight for a longer wave: it keeps 4
    assert speed_lengths(4, [1.0, 0.5], [2, 6]) == [4, 4]
    plan = dataclasses.replace(plan_of([0, 0, 0], nm=4), meta={"wave_time_s": [1.0, 0.5, 0.8]})
    fast = with_waves(plan, "speed")
    assert fast.wave_minibatches == (4, 8, 5) and fast.meta["waves"]["minibatches"] == [4, 8, 5]
    assert Plan.from_json(fast.to_json()) == fast
    assert with_waves(plan, "equal") is plan
    assert '"nm"' not in Plan.from_json(plan.to_json()).to_json().split('"virtual_workers"')[1]
    with pytest.raises(ValueError, match="wave_time_s"):
        with_waves(plan_of([0, 0]), "speed")
    with pytest.raises(ValueError, match="waves must be one of"):
        with_waves(plan, "fastest")


def test_speed_waves_stop_the_fast_vw_waiting_at_the_bound():
    # VW 1 is twice as fast: with equal waves it waits for VW 0 at D = 0; with its wave twice as long
    # both finish each wave together, and the cluster trains more minibatches per second.
    times = [0.02, 0.01]
    equal = plan_of([0, 0], nm=4, times=times)
    speed = plan_of([4, 8], nm=4, times=times)
    a, b = simulate_plan(equal, waves=6), simulate_plan(speed, waves=6)
    ta = [a.wave_done_s[v][-1] for v in range(2)]
    tb = [b.wave_done_s[v][-1] for v in range(2)]
    assert abs(tb[0] - tb[1]) < 0.05 * tb[0]
    assert (sum(b.minibatches) / max(tb)) > 1.3 * (sum(a.minibatches) / max(ta))


def test_a_bad_vw_nm_is_named():
    with pytest.raises(ValueError, match="VW 1 nm"):
        plan_of([2, -1])


def test_what_unequal_waves_do_not_support_is_refused_by_name():
    plan = plan_of([3, 2])
    step = Numerics(lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 4))
    with pytest.raises(ArgumentError, match="lr_scheduler_steps='run' counts an equal share"):
        Trainer(mlp(), cross_entropy, sgd, data(20), plan=plan, numerics=step,
                reporting=Reporting(progress=False)).spec(plan)
    vw_steps = Numerics(lr_scheduler=step.lr_scheduler, lr_scheduler_steps="vw")
    assert Trainer(mlp(), cross_entropy, sgd, data(20), plan=plan, numerics=vw_steps,
                   reporting=Reporting(progress=False)).spec(plan).schedules[0].num_minibatches == 12
    with pytest.raises(ArgumentError, match="planning.waves"):
        Planning(waves="fast")


def test_cli_plan_waves_by_speed_on_the_papers_testbed(tmp_path, capsys):
    from hetpipe.cli import main

    out = tmp_path / "plan.json"
    # NP: one VW per GPU type; the Titan VWs are about 3x the Quadro P4000's and RTX 2060's speed
    assert main(["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19", "--policy", "NP", "--waves", "speed",
                 "-o", str(out)]) == 0
    plan = Plan.load(out)
    times = plan.meta["wave_time_s"]
    assert plan.wave_minibatches == tuple(round(plan.nm * max(times) / t) for t in times)
    assert len(set(plan.wave_minibatches)) > 1 and min(plan.wave_minibatches) == plan.nm
    assert f"Nm per VW {list(plan.wave_minibatches)}" in capsys.readouterr().out


def test_the_numpy_and_jax_workers_refuse_unequal_waves_by_name():
    from hetpipe.ps.worker import WorkerRank

    class Rank0:
        def Get_rank(self):
            return 0

    with pytest.raises(ValueError, match="VW 0 trains 3 minibatches per wave"):
        WorkerRank(Rank0(), plan_of([3, 2]), 64)


def test_the_start_up_line_names_the_waves_and_their_weighting():
    from hetpipe.run.explain import update_rule

    assert "waves" not in update_rule(plan_of([0, 0]), 4)
    line = update_rule(plan_of([3, 2]), 4)
    assert "waves are 3/2 minibatches long and the PS weighs each VW's update by its samples" in line
    assert "weighs" not in update_rule(dataclasses.replace(plan_of([3, 2]), aggregate="sum"), 4)
