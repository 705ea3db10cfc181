"""Where a stage's pull requests leave ahead of their Pull instruction (hetpipe.stage.executor.pull_points):
right after the stage's own Push(w - D - 1) and never before the previous Pull, on every stream of the
built-in WSP schedule with VW 0's evaluation points; and never for a Pull that an early stop decided at
an evaluation point before the request could still remove (docs/design.md, "Early stop")."""

import itertools

import pytest

from hetpipe.schedule.ir import Eval, Pull, Push
from hetpipe.schedule.messages import MessageOptions
from hetpipe.schedule.registry import ScheduleOptions, generate
from hetpipe.stage.executor import pull_points


def streams(stages: int, nm: int, d: int, waves: int = 6, eval_every: int = 1):
    options = ScheduleOptions(stages, waves * nm, nm=nm, d=d, messages=MessageOptions(eval_every=eval_every))
    return generate("hetpipe", options).streams


def test_at_d0_a_pull_is_asked_for_right_after_the_push_before_it():
    for stream in streams(2, 4, 0, eval_every=0):
        assert pull_points(stream, 0) == {}, "the Push is the instruction before the Pull"
    for stream in streams(2, 4, 0):
        at = {i: ins for i, ins in enumerate(stream)}
        points = pull_points(stream, 0)
        assert sorted(points.values()) == list(range(1, 6)), "an evaluation point lies between them"
        assert all(at[i] == Push(w - 1) for i, w in points.items())


def test_at_d1_stage_0_asks_right_after_its_push_of_two_waves_before_and_the_last_stage_after_its_pull():
    first, last = streams(2, 4, 1)
    at = {i: ins for i, ins in enumerate(first)}
    assert all(at[i] == Push(w - 2) for i, w in pull_points(first, 1).items() if w >= 2)
    pulls = {ins.wave: i for i, ins in enumerate(last) if isinstance(ins, Pull)}
    assert pull_points(last, 1) == {-1: 1, **{pulls[w - 1]: w for w in range(2, 6)}}


@pytest.mark.parametrize("stages, nm, d", list(itertools.product((1, 2, 3), (1, 2, 4), (0, 1, 2))))
def test_requests_follow_wsp_and_precede_their_pull(stages, nm, d):
    for stream in streams(stages, nm, d):
        points = pull_points(stream, d)
        pulls = {ins.wave: j for j, ins in enumerate(stream) if isinstance(ins, Pull)}
        pushes = {ins.wave: j for j, ins in enumerate(stream) if isinstance(ins, Push)}
        for i, w in points.items():
            j = pulls[w]
            assert i < j - 1, (i, w, stream)
            assert i >= pushes.get(w - d - 1, -1) and i >= pulls.get(w - 1, -1), (i, w)
            # A stop decided at Eval(x) ends the run after wave x + D + 1: every evaluation point whose
            # stop would remove Pull(w) lies before the request.
            for k, ins in enumerate(stream):
                if isinstance(ins, Eval) and w > ins.wave + d + 1:
                    assert k < i, (k, ins, i, w)
        # Every Pull not in the table is requested by its own instruction: nothing between the point
        # WSP allows and the Pull.
        for w, j in pulls.items():
            if w not in points.values():
                allowed = max(pushes.get(w - d - 1, -1), pulls.get(w - 1, -1))
                assert allowed >= j - 1, (w, j, allowed)
