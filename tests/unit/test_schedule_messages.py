"""The run's messages as schedule instructions (tied gradients, norm shares, evaluation points and
verdicts, DONE): their text forms, where the shared pass puts them, what validate() and the lock-step
run check of them, and the runtime executing them from its streams."""

import dataclasses
import itertools
import sys
from pathlib import Path

import pytest

from hetpipe.schedule import (
    Apply, Done, Eval, MessageOptions, RecvNorm, RecvTied, RecvVerdict, Schedule, ScheduleError, SendNorm, SendTied,
    SendVerdict, buffer_counts, lockstep, parse, validate, with_messages, without_messages,
)
from hetpipe.schedule.registry import ScheduleOptions, generate, get_schedule
from hetpipe.run.config import Numerics, Reporting

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

MESSAGE_KINDS = [SendTied(3, 2), RecvTied(3, 0), SendNorm(3, 1), RecvNorm(3, 1), Eval(1), SendVerdict(1, 0),
                 RecvVerdict(1, 2), Done()]
EVERYTHING = MessageOptions(tied=((0, 1),), norm=True, eval_every=1)


def _two_stages() -> Schedule:
    return generate("hetpipe", ScheduleOptions(2, 4, 2, 0, messages=EVERYTHING))


def _flush() -> Schedule:
    """GPipe: every Apply, with its norm exchange, after every backward."""
    return generate("gpipe", ScheduleOptions(2, 4, messages=EVERYTHING))


def _tied_only() -> Schedule:
    return generate("hetpipe", ScheduleOptions(2, 4, 2, 0, messages=MessageOptions(tied=((0, 1),))))


def _replace(s: Schedule, stage: int, stream) -> Schedule:
    streams = list(s.streams)
    streams[stage] = tuple(stream)
    return dataclasses.replace(s, streams=tuple(streams))


# --- IR --------------------------------------------------------------------------------------

def test_message_instructions_have_documented_text_forms_that_round_trip():
    assert " ".join(map(str, MESSAGE_KINDS)) == "ST3:2 RT3:0 SN3:1 RN3:1 EVAL1 SV1:0 RV1:2 DONE"
    assert all(parse(str(i)) == i for i in MESSAGE_KINDS)
    assert all("Pairs with" in type(i).__doc__ for i in MESSAGE_KINDS)
    for bad in ("ST3", "EVAL1:0", "DONE1", "SN"):
        with pytest.raises(ValueError):
            parse(bad)


# --- the shared pass ----------------------------------------------------------------------------

def test_the_pass_puts_each_message_where_the_runtime_does_it():
    """Tied gradients after each Bwd (and after the gradient it sends back, which the previous stage
    waits for), received before the Apply; the norm exchange right before the Apply; the evaluation
    point right after its wave's Push, its verdict from the last stage; DONE last."""
    assert _two_stages().to_text() == (
        "# hetpipe stages=2 minibatches=4 nm=2 d=0\n"
        "0: F0 SA0:1 F1 SA1:1 RG0:1 B0 ST0:1 RT0:1 SN0:1 RN0:1 A0 RG1:1 B1 ST1:1 RT1:1 SN1:1 RN1:1 A1 PUSH0 EVAL0 "
        "RV0:1 PULL1 F2 SA2:1 F3 SA3:1 RG2:1 B2 ST2:1 RT2:1 SN2:1 RN2:1 A2 RG3:1 B3 ST3:1 RT3:1 SN3:1 RN3:1 A3 PUSH1 "
        "DONE\n"
        "1: RA0:0 F0 B0 SG0:0 ST0:0 RT0:0 SN0:0 RN0:0 A0 RA1:0 F1 B1 SG1:0 ST1:0 RT1:0 SN1:0 RN1:0 A1 PUSH0 EVAL0 "
        "SV0:0 PULL1 RA2:0 F2 B2 SG2:0 ST2:0 RT2:0 SN2:0 RN2:0 A2 RA3:0 F3 B3 SG3:0 ST3:0 RT3:0 SN3:0 RN3:0 A3 PUSH1 "
        "DONE\n")


def test_tied_gradients_are_received_in_the_order_they_were_sent():
    """GPipe's backwards run last to first: the first Apply receives all of a peer's tied gradients."""
    s = generate("gpipe", ScheduleOptions(3, 4, messages=MessageOptions(tied=((0, 2),))))
    assert [str(i) for i in s.streams[0] if isinstance(i, (SendTied, RecvTied, Apply))] == \
        "ST3:2 ST2:2 ST1:2 ST0:2 RT3:2 RT2:2 RT1:2 RT0:2 A0 A1 A2 A3".split()
    assert not any(isinstance(i, (SendTied, RecvTied)) for i in s.streams[1])


def test_split_minibatches_receive_every_peers_halves_before_their_apply():
    s = generate("hetpipe", ScheduleOptions(3, 3, 2, 0, split_startup=1,
                                            messages=MessageOptions(tied=((0, 1), (0, 2)))))
    stream = [str(i) for i in s.streams[0]]
    at = stream.index("A1")
    assert stream[at - 4:at] == ["RT0:1", "RT1:1", "RT0:2", "RT1:2"]


def test_norm_shares_go_only_with_the_steps_of_an_accumulating_run():
    s = generate("hetpipe", ScheduleOptions(2, 7, 2, 0, messages=MessageOptions(norm=True, accumulate=3)))
    assert [i.mb for i in s.streams[0] if isinstance(i, SendNorm)] == [2, 5, 6]
    one_stage = generate("hetpipe", ScheduleOptions(1, 7, 2, 0, messages=MessageOptions(norm=True)))
    assert not any(isinstance(i, (SendNorm, RecvNorm)) for i in one_stage.streams[0])


def test_evaluation_points_skip_the_last_wave():
    s = generate("hetpipe", ScheduleOptions(3, 8, 2, 1, messages=MessageOptions(eval_every=2)))
    assert [[i.wave for i in st if isinstance(i, Eval)] for st in s.streams] == [[1]] * 3
    assert [str(i) for i in s.streams[2] if isinstance(i, SendVerdict)] == ["SV1:0", "SV1:1"]


@pytest.mark.parametrize("name", ["hetpipe", "gpipe", "1f1b"])
def test_every_registered_schedule_with_messages_validates_and_strips_back(name):
    spec = get_schedule(name)
    count = 0
    for k, m, nm, d, split in itertools.product(range(1, 5), (1, 3, 5), (1, 2, 3), (0, 1), (0, 2)):
        if (nm > 1 or d or split) and not {"nm", "d", "split_startup"} <= spec.takes:
            continue
        if split > m:
            continue
        pairs = tuple((a, b) for a in range(k) for b in range(a + 1, k) if (a + b) % 2 == 1)
        o = ScheduleOptions(k, m, nm, d, split_startup=split,
                            messages=MessageOptions(pairs, norm=True, accumulate=2, eval_every=1))
        s = generate(name, o)
        validate(s)
        validate(s, buffers=buffer_counts(s))
        assert without_messages(s) == generate(name, dataclasses.replace(o, messages=None))
        assert Schedule.from_text(s.to_text()) == s
        count += 1
    assert count >= 12


def test_the_pass_refuses_a_schedule_that_has_messages_and_options_naming_absent_stages():
    with pytest.raises(ValueError, match="already has message"):
        with_messages(_two_stages(), EVERYTHING)
    with pytest.raises(ValueError, match=r"tied pairs \[\(1, 3\)\] name stages beyond the 3"):
        ScheduleOptions(3, 4, messages=MessageOptions(tied=((1, 3),)))
    with pytest.raises(ValueError, match="distinct stage pairs"):
        MessageOptions(tied=((2, 1),))


# --- validate() and the lock-step run -------------------------------------------------------------

def _without(s: Schedule, stage: int, text: str) -> Schedule:
    return _replace(s, stage, [i for i in s.streams[stage] if str(i) != text])


def _move(s: Schedule, stage: int, text: str, before: str) -> Schedule:
    """Stage ``stage``'s stream with instruction ``text`` moved right before ``before``."""
    stream = [i for i in s.streams[stage] if str(i) != text]
    at = [str(i) for i in stream].index(before)
    return _replace(s, stage, stream[:at] + [parse(text)] + stream[at:])


@pytest.mark.parametrize("broken, match", [
    (lambda s: _without(s, 1, "RN2:0"), r"norm exchange of A2 misses stage 0"),
    (lambda s: _without(_without(s, 1, "RN2:0"), 0, "SN2:1"), r"norm exchange of A2 misses stage 1"),
    (lambda s: _move(s, 0, "SN1:1", "PUSH0"), r"SN1:1 at position \d+ must come before A1"),
    (lambda s: _move(s, 0, "SN1:1", "RT1:1"), r"SN1:1 at position \d+ comes before the tied gradients"),
    (lambda s: _move(_flush(), 1, "RN1:0", "RN0:0"), r"stage 0 sends SendNorm to stage 1 in order \[0, 1, 2, 3\] "
                                                     r"but stage 1 receives \[1, 0, 2, 3\]"),
    (lambda s: _without(s, 0, "ST2:1"), r"stage 0 sends SendTied to stage 1 in order \[0, 1, 3\] but stage 1 "
                                        r"receives \[0, 1, 2, 3\]"),
    (lambda s: _move(s, 1, "RT3:0", "RT2:0"), r"stage 0 sends SendTied to stage 1 in order \[0, 1, 2, 3\] but "
                                              r"stage 1 receives \[0, 1, 3, 2\]"),
    (lambda s: _move(_tied_only(), 1, "RT2:0", "PUSH1"), r"RT2:0 at position \d+ must come before A2"),
    (lambda s: _move(s, 0, "ST1:1", "B1"), r"ST1:1 at position \d+ must come after B1"),
    (lambda s: _without(_without(s, 0, "ST3:1"), 1, "RT3:0"), r"tied gradients of micro-batches \[0, 1, 2\], "
                                                              r"not of every micro-batch"),
    (lambda s: _without(_without(s, 0, "EVAL0"), 0, "RV0:1"), r"the stages evaluate after different waves"),
    (lambda s: _without(s, 0, "RV0:1"), r"EVAL0 has no verdict RV0:1"),
    (lambda s: _move(s, 0, "EVAL0", "A1"), r"EVAL0 at position \d+ must come after PUSH0"),
    (lambda s: _move(s, 0, "DONE", "PUSH1"), r"DONE at position \d+ must end the stream"),
    (lambda s: _without(s, 1, "DONE"), r"stage\(s\) \[1\] do not end with DONE"),
], ids=["no-recv-norm", "no-norm-pair", "norm-after-apply", "norm-before-tied", "norm-misordered",
        "no-tied-send", "tied-misordered", "tied-after-apply", "tied-before-bwd", "tied-incomplete", "eval-missing",
        "verdict-missing", "eval-before-push", "done-early", "done-missing"])
def test_validate_rejects_missing_and_misordered_messages(broken, match):
    good = _two_stages()
    validate(good)
    with pytest.raises(ScheduleError, match=match):
        validate(broken(good))


def test_receiving_norm_shares_before_sending_them_deadlocks_in_the_lock_step_run():
    s = _two_stages()
    for stage, peer in ((0, 1), (1, 0)):
        s = _move(s, stage, f"SN2:{peer}", "A2")
    with pytest.raises(ScheduleError, match=r"deadlocks at step \d+: stage 0 on RN2:1, stage 1 on RN2:0") as e:
        validate(s)
    assert "*RN2:1" in str(e.value)


def test_the_lock_step_run_pairs_every_message_with_its_sender():
    s = generate("hetpipe", ScheduleOptions(3, 6, 2, 1, messages=MessageOptions(((0, 2),), True, 1, 1)))
    rep = lockstep(s)
    assert rep.completed
    done = {}
    for t, row in enumerate(rep.steps):
        for stage, ins in enumerate(row):
            if ins is not None:
                done[(stage, str(ins))] = t
    for stage, stream in enumerate(s.streams):
        for ins in stream:
            if isinstance(ins, (RecvTied, RecvNorm, RecvVerdict)):
                send = {RecvTied: "ST", RecvNorm: "SN", RecvVerdict: "SV"}[type(ins)]
                num = ins.wave if isinstance(ins, RecvVerdict) else ins.mb
                assert done[(ins.peer, f"{send}{num}:{stage}")] < done[(stage, str(ins))], ins
            if isinstance(ins, Eval) and stage > 0:
                assert done[(stage - 1, str(ins))] < done[(stage, str(ins))]
    for stage in range(s.num_stages):
        ran = [row[stage] for row in rep.steps if row[stage] is not None]
        assert len(ran) == len(s.streams[stage]) and isinstance(ran[-1], Done)


# --- the runtime executes them ----------------------------------------------------------------------

def test_a_stage_refuses_a_stream_without_the_messages_its_run_needs():
    from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic
    from hetpipe.run.replay import replay_run
    from hetpipe.run.trainer import Trainer

    plan = one_vw_plan([3], nm=2, d=0)
    spec = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan,
                   numerics=Numerics(clip_grad_norm=0.5)).spec(plan)
    assert any(isinstance(i, SendNorm) for i in spec.schedules[0].streams[0])
    spec.schedules = [generate("hetpipe", ScheduleOptions(2, spec.schedules[0].num_minibatches, 2, 0,
                                                          messages=MessageOptions()))]
    with pytest.raises(ValueError, match=r"stream of VW 0 stage 0 does not carry the messages the run needs"):
        replay_run(spec)


def test_an_early_stop_at_a_minibatch_inside_an_accumulation_group_steps_with_the_vws_norm():
    """Nm = 3, a step every 2 minibatches, clipping: a stop asked after wave 1 ends the run after wave 2,
    whose last minibatch (8) now takes the last step, with the VW's norm: each stage puts that step's norm
    exchange into its stream. The weights are bitwise those of the run given only those 9 minibatches."""
    from common import cross_entropy, mlp, one_vw_plan, sgd
    from hetpipe.run.callbacks import Callback
    from hetpipe.run.data import Batches
    from hetpipe.run.trainer import Trainer
    import torch

    class StopAt1(Callback):
        def on_eval(self, info):
            return info.wave >= 1

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16 * 24, 64, generator=g), torch.randint(0, 10, (16 * 24,), generator=g)
    plan = one_vw_plan([2, 4], nm=3, d=0)
    kw = dict(plan=plan, numerics=Numerics(clip_grad_norm=0.3, accumulate=2))
    stopped = Trainer(mlp(), cross_entropy, sgd(), Batches(x, y, 16, shuffle=False),
                      reporting=Reporting(progress=False, eval_every=1, callbacks=[StopAt1()]), **kw).replay()
    short = Trainer(mlp(), cross_entropy, sgd(), Batches(x[:16 * 9], y[:16 * 9], 16, shuffle=False),
                    reporting=Reporting(progress=False), **kw).replay()
    assert stopped.stopped_after == 2 and sorted(stopped.losses[0]) == list(range(9))
    assert stopped.losses == short.losses
    assert all(torch.equal(torch.from_numpy(stopped.weights[l]), torch.from_numpy(short.weights[l]))
               for l in short.weights)
