"""The schedule registry: every registered schedule validates, today's streams are unchanged, and a
schedule registered here runs through the simulator, the command line and the single-process replay."""

import dataclasses
import hashlib
import itertools
import json
import sys
from pathlib import Path

import pytest

from hetpipe.schedule import (
    Apply, Bwd, Fwd, Pull, Push, Recompute, Schedule, buffer_counts, lower, simulate_plan, validate,
)
from hetpipe.schedule.registry import (
    ScheduleOptions, ScheduleSpec, generate, get_schedule, register, schedule_names, unregister,
)
from hetpipe.run.config import Planning, Reporting
from hetpipe.run.config import Numerics

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))


def _grid(spec: ScheduleSpec):
    """Small shapes, over the options ``spec`` takes (the others stay at their defaults)."""
    takes = spec.takes
    for k, m, nm, d, rc, split in itertools.product(
            range(1, 5), (1, 2, 3, 5), range(1, 5) if "nm" in takes else (1,), range(3) if "d" in takes else (0,),
            (False, True) if "recompute" in takes else (False,), range(3) if "split_startup" in takes else (0,)):
        if split <= m:
            yield ScheduleOptions(k, m, nm, d, rc, split)


@pytest.mark.parametrize("name", ["hetpipe", "gpipe", "1f1b"])
def test_every_registered_schedule_validates_over_small_shapes(name):
    spec = get_schedule(name)
    count = 0
    for o in _grid(spec):
        s = generate(name, o)
        assert (s.name, s.num_stages, s.num_minibatches) == (name, o.stages, o.minibatches)
        validate(s)
        validate(s, buffers=buffer_counts(s))
        count += 1
    assert count >= 16
    assert set(schedule_names()) >= {"hetpipe", "gpipe", "1f1b"}


def _stream_digests(s: Schedule):
    return [hashlib.sha256(" ".join(map(str, st)).encode()).hexdigest()[:12] for st in s.streams]


def test_todays_schedules_are_unchanged_but_for_the_nm_below_stages_wave_gate():
    rows = {}
    for line in (GOLDEN / "schedule_streams.txt").read_text().splitlines():
        if not line.startswith("#"):
            name, *nums, digests = line.split()
            rows[(name, *map(int, nums))] = digests.split(",")
    assert len(rows) == 632
    changed = 0
    for (name, k, m, nm, d, rc, split), want in rows.items():
        o = ScheduleOptions(k, m, nm, d, bool(rc), split) if name == "hetpipe" else ScheduleOptions(k, m)
        got = _stream_digests(generate(name, o))
        if name == "hetpipe" and d >= 1 and nm < k:
            # the one deliberate change: stage 0 as before, stages >= 1 as at d = 0 (they drain each wave)
            assert got == want[:1] + rows[(name, k, m, nm, 0, rc, split)][1:], (name, k, m, nm, d, rc, split)
            changed += got != want
        else:
            assert got == want, (name, k, m, nm, d, rc, split)
    assert changed == 40


def test_simulate_plan_gives_todays_makespans():
    from hetpipe.plan import make_plan
    from hetpipe.plan.cluster import load_cluster
    from hetpipe.plan.profile import load_profile

    cluster, profile = load_cluster("hetpipe-testbed"), load_profile("resnet152")
    pb = [float(layer.param_bytes) for layer in profile.layers]
    for row in json.loads((GOLDEN / "simulate_plan_testbed.json").read_text()):
        plan = make_plan(cluster, profile, policy=row["policy"], nm=row["nm"], d=row["d"])
        r = simulate_plan(plan, waves=4, cluster=cluster, param_bytes=pb, schedule="hetpipe")
        assert (r.makespan_s, r.finish_s) == (row["makespan_s"], row["finish_s"]), row


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream' \(registered: 1f1b, gpipe, hetpipe"):
        get_schedule("pipedream")
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        generate("zb", ScheduleOptions(2, 4))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("option,value", [("nm", 2), ("d", 1), ("split_startup", 1)])
def test_flush_schedules_refuse_options_they_ignore(name, option, value):
    o = ScheduleOptions(3, 4, **{option: value})
    with pytest.raises(ValueError, match=rf"schedule '{name}' does not take option {option} \(got {value}"):
        generate(name, o)


def test_options_and_registration_errors_name_the_culprit():
    with pytest.raises(ValueError, match="nm must be >= 1, got 0"):
        ScheduleOptions(2, 4, nm=0)
    with pytest.raises(ValueError, match="recompute must be a bool"):
        ScheduleOptions(2, 4, recompute=1)
    with pytest.raises(ValueError, match="split_startup 5 exceeds the 4 minibatches"):
        ScheduleOptions(2, 4, split_startup=5)
    hetpipe = get_schedule("hetpipe")
    with pytest.raises(ValueError, match="'hetpipe' is already registered"):
        register(hetpipe)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['microbatches'\]"):
        register(ScheduleSpec("other", hetpipe.generate, frozenset({"microbatches"}), True, hetpipe.wave_time, ""))


def test_recompute_in_the_flush_schedules_rebuilds_before_every_backward():
    for name in ("gpipe", "1f1b"):
        plain, rec = (generate(name, ScheduleOptions(3, 4, recompute=r)) for r in (False, True))
        for a, b in zip(plain.streams, rec.streams):
            assert [i for i in b if not isinstance(i, Recompute)] == list(a)
            compute = [i for i in b if isinstance(i, (Fwd, Bwd, Recompute))]
            assert all(compute[j - 1] == Recompute(i.mb) for j, i in enumerate(compute) if isinstance(i, Bwd))


# --- a schedule registered here ---------------------------------------------------------------------

def _sequential(o: ScheduleOptions) -> Schedule:
    """One minibatch in the pipeline at a time: its forwards, its backwards, its Apply; waves of nm."""
    streams = []
    for _ in range(o.stages):
        out = []
        for p in range(o.minibatches):
            wave = p // o.nm
            if wave and p % o.nm == 0:
                out.append(Pull(wave))
            out += [Fwd(p), Bwd(p), Apply(p)]
            if p == min((wave + 1) * o.nm, o.minibatches) - 1:
                out.append(Push(wave))
        streams.append(tuple(out))
    return lower(Schedule("sequential", o.stages, o.minibatches, o.nm, o.d, tuple(streams)))


@pytest.fixture
def sequential():
    register(ScheduleSpec("sequential", _sequential, frozenset({"nm", "d"}), syncs=True,
                          wave_time=lambda b, r, sync, o: o.nm * r + sync,
                          summary="one minibatch in the pipeline at a time"))
    yield get_schedule("sequential")
    unregister("sequential")


def test_a_registered_schedule_validates_and_simulates(sequential):
    from common import one_vw_plan

    for o in _grid(sequential):
        validate(generate("sequential", o))
    plan = one_vw_plan([2, 4], nm=2, d=0)
    vw = plan.virtual_workers[0]
    stages = tuple(dataclasses.replace(st, fwd_time=1.0, bwd_time=2.0) for st in vw.stages)
    plan = dataclasses.replace(plan, virtual_workers=(dataclasses.replace(vw, stages=stages),))
    r = simulate_plan(plan, waves=3, schedule="sequential", transfer_s=0.0)
    assert r.makespan_s == pytest.approx(3 * 2 * 3 * (1.0 + 2.0))        # waves x nm x stages x (F + B)
    with pytest.raises(ValueError, match="does not take option split_startup"):
        simulate_plan(plan, waves=3, schedule="sequential", split_startup=1)


def test_the_command_line_offers_the_registered_schedules(sequential, capsys, tmp_path):
    from common import one_vw_plan
    from hetpipe.cli import main

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    assert "{1f1b,gpipe,hetpipe,sequential}" in "".join(capsys.readouterr().out.split())
    path = tmp_path / "plan.json"
    one_vw_plan([3], nm=2, d=0).save(path)
    assert main(["simulate", "--plan", str(path), "--waves", "2", "--schedule", "sequential"]) == 0
    assert "makespan 0.0000 s" in capsys.readouterr().out
    assert main(["simulate", "--plan", str(path), "--schedule", "gpipe"]) == 2
    assert "schedule 'gpipe' does not take option nm (got 2" in capsys.readouterr().err


def test_a_registered_schedule_trains_end_to_end_in_the_replay(sequential):
    # One VW, D = 0: one minibatch at a time with the PS round trip is plain SGD, minibatch after
    # minibatch, whatever nm; HetPipe's own schedule with nm = 2 keeps two in flight and differs.
    import real_models as rm
    from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic
    from hetpipe.run.trainer import Trainer

    plan = one_vw_plan([2, 4], nm=2, d=0)
    plain = rm.plain_training(mlp(), cross_entropy, sgd(), synthetic(), epochs=2)
    losses = {}
    for name in ("sequential", "hetpipe"):
        r = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=2, planning=Planning(schedule=name),
                    reporting=Reporting(progress=False)).replay()
        losses[name] = [v for _, v in sorted(r.losses[0].items())]
    assert len(losses["sequential"]) == len(plain) == 16
    assert max(abs(a - b) for a, b in zip(losses["sequential"], plain)) <= 1e-6
    assert max(abs(a - b) for a, b in zip(losses["hetpipe"], plain)) > 1e-4


def test_a_registered_schedule_carries_the_runs_messages_and_trains_with_them(sequential):
    """Its generator knows nothing of tied gradients, norm shares, evaluation points or DONE; the shared
    pass adds them. A tied weight on stages 0 and 2, clipping by the VW's norm, an evaluation point
    every wave: one minibatch at a time at D = 0 is plain SGD with clip_grad_norm_."""
    import torch

    import real_models as rm
    from common import one_vw_plan, sgd
    from hetpipe.run.data import Batches
    from hetpipe.run.trainer import Trainer
    from hetpipe.schedule import Eval, RecvTied, SendNorm

    g = torch.Generator().manual_seed(4)
    data = Batches(torch.randn(96, 64, generator=g), torch.randint(0, 64, (96,), generator=g), 16, seed=2)
    plan = one_vw_plan([2, 4], nm=2, d=0, num_layers=5)
    trainer = Trainer(rm.tied_mlp(), rm.tied_loss, sgd(), data, plan=plan, epochs=2,
                      planning=Planning(schedule="sequential"), numerics=Numerics(clip_grad_norm=0.2),
                      reporting=Reporting(progress=False, eval_every=1))
    streams = trainer.spec(plan).schedules[0].streams
    assert {type(i) for i in streams[0]} >= {RecvTied, SendNorm, Eval} and not any(
        isinstance(i, RecvTied) for i in streams[1])
    result = trainer.replay()
    ref = rm.tied_mlp()
    opt, want, norms = sgd()(ref.parameters()), [], []
    for e in range(2):
        data.set_epoch(e)
        for x, y in data:
            opt.zero_grad()
            loss = rm.tied_loss(rm.run_layers(ref, x), y)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.2)))
            opt.step()
            want.append(float(loss.detach()))
    got = [v for _, v in sorted(result.losses[0].items())]
    assert min(norms) > 0.2 and len(got) == len(want) == 12 and len(result.evals) == 5
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5


def test_the_trainer_refuses_unknown_schedules_and_options_they_ignore():
    from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic
    from hetpipe.run.trainer import Trainer

    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        Trainer(mlp(), cross_entropy, sgd(), synthetic(), planning=Planning(schedule="pipedream"))
    plan = one_vw_plan([3], nm=2, d=0)
    with pytest.raises(ValueError, match="'gpipe' does not take option nm"):
        Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, planning=Planning(schedule="gpipe")).spec(plan)
