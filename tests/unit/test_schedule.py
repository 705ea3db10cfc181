"""Schedule IR, generators, lowering, buffer assignment and validate()."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.schedule import (
    Apply, Bwd, Fwd, Pull, Push, Recompute, RecvAct, RecvGrad, Schedule, ScheduleError, SendAct, SendGrad,
    buffer_counts, format_grid, gpipe_schedule, hetpipe_compute_schedule, hetpipe_schedule, lower,
    one_f_one_b_schedule, parse, parse_stream, lockstep, validate,
)
from hetpipe.schedule.generators import warmup

GOLDEN = Path(__file__).parent / "golden"

ALL_KINDS = [Fwd(3), Bwd(3), Recompute(3), Apply(3), SendAct(3, 1), RecvAct(3, 0), SendGrad(3, 0),
             RecvGrad(3, 1), Push(2), Pull(2)]


# --- IR --------------------------------------------------------------------------------------

@pytest.mark.parametrize("ins", ALL_KINDS, ids=str)
def test_instruction_text_round_trips(ins):
    assert parse(str(ins)) == ins


def test_text_forms_are_the_documented_ones():
    assert " ".join(map(str, ALL_KINDS)) == "F3 B3 R3 A3 SA3:1 RA3:0 SG3:0 RG3:1 PUSH2 PULL2"


@pytest.mark.parametrize("bad", ["X3", "F", "F3:1", "SA3", "PUSH", "3F"])
def test_parse_rejects_malformed_instructions(bad):
    with pytest.raises(ValueError):
        parse(bad)


def test_every_instruction_documents_meaning_and_pairing():
    for ins in ALL_KINDS:
        assert "Pairs with" in type(ins).__doc__


@pytest.mark.parametrize("sched", [hetpipe_schedule(3, 7, 2, 1, recompute=True, split_startup=2),
                                   gpipe_schedule(2, 3), one_f_one_b_schedule(4, 6)], ids=lambda s: s.name)
def test_schedule_text_round_trips(sched):
    assert Schedule.from_text(sched.to_text()) == sched


def test_instructions_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Fwd(1).mb = 2


def test_split_micro_batch_arithmetic():
    s = hetpipe_schedule(2, 5, 2, 0, split_startup=2)
    assert s.num_micro == 7
    assert [s.minibatch_of(j) for j in range(7)] == [0, 0, 1, 1, 2, 3, 4]
    assert [s.wave_of(j) for j in range(7)] == [0, 0, 0, 0, 1, 1, 2]
    assert [s.fraction_of(j) for j in range(7)] == [0.5] * 4 + [1.0] * 3
    applies = [i.mb for i in s.streams[0] if isinstance(i, Apply)]
    assert applies == [1, 3, 4, 5, 6]


# --- golden files ----------------------------------------------------------------------------

@pytest.mark.parametrize("fname,sched", [
    ("hetpipe_2st_4mb_nm2_d0.txt", lambda: hetpipe_schedule(2, 4, 2, 0)),
    ("hetpipe_2st_4mb_nm2_d1.txt", lambda: hetpipe_schedule(2, 4, 2, 1)),
    ("gpipe_3st_4mb.txt", lambda: gpipe_schedule(3, 4)),
    ("1f1b_3st_4mb.txt", lambda: one_f_one_b_schedule(3, 4)),
])
def test_golden(fname, sched):
    assert sched().to_text() == (GOLDEN / fname).read_text()


# --- generator rules -------------------------------------------------------------------------

def compute_only(stream):
    return [i for i in stream if isinstance(i, (Fwd, Bwd, Apply, Push, Pull, Recompute))]


def test_lowering_inserts_neighbour_transfers():
    s = lower(hetpipe_compute_schedule(3, 2, 2, 0))
    assert s.streams[1][:4] == parse_stream("RA0:0 F0 SA0:2 RA1:0")
    assert parse_stream("RG0:2 B0 SG0:0") == s.streams[1][s.streams[1].index(RecvGrad(0, 2)):][:3]
    assert not any(isinstance(i, (RecvAct, SendGrad)) for i in s.streams[0])
    assert not any(isinstance(i, (SendAct, RecvGrad)) for i in s.streams[2])


def test_lowering_rejects_lowered_input():
    with pytest.raises(ValueError, match="already has transfer"):
        lower(hetpipe_schedule(2, 2, 1, 0))


def test_recompute_lies_between_forward_and_receive_grad():
    s = hetpipe_schedule(2, 2, 2, 0, recompute=True)
    assert parse_stream("R0 RG0:1 B0") == s.streams[0][s.streams[0].index(Recompute(0)):][:3]


@given(k=st.integers(1, 6), nm=st.integers(1, 6))
def test_warmup_is_non_increasing_and_capped(k, nm):
    ws = [warmup(s, k, nm) for s in range(k)]
    assert ws == sorted(ws, reverse=True) and ws[-1] == 1 and max(ws) == min(nm, k)


def test_hetpipe_d0_drains_at_every_wave_boundary():
    s = hetpipe_schedule(4, 12, 3, 0)
    for stream in s.streams:
        for w in range(1, 4):
            first_f = stream.index(Fwd(3 * w))
            assert all(stream.index(Bwd(p)) < first_f for p in range(3 * w))
            assert stream.index(Push(w - 1)) < stream.index(Pull(w)) < first_f


def test_hetpipe_d1_does_not_drain():
    s = hetpipe_schedule(4, 12, 4, 1)
    st0 = s.streams[0]
    assert st0.index(Fwd(4)) < st0.index(Bwd(3))   # wave 1 starts before wave 0's backwards end


def test_pull_is_right_before_first_forward_and_push_right_after_last_apply():
    s = hetpipe_schedule(3, 9, 3, 1)
    for st_ in s.streams:
        c = compute_only(st_)
        for w in range(1, 3):
            assert c[c.index(Pull(w)) + 1] == Fwd(3 * w)
        for w in range(3):
            assert c[c.index(Push(w)) - 1] == Apply(3 * w + 2)


def test_last_stage_runs_backward_right_after_forward():
    s = hetpipe_compute_schedule(4, 8, 4, 1)
    last = [i for i in s.streams[-1] if isinstance(i, (Fwd, Bwd))]
    assert last == [x for p in range(8) for x in (Fwd(p), Bwd(p))]


def test_stage0_keeps_min_nm_k_in_flight():
    for k, nm in [(4, 2), (4, 4), (3, 6)]:
        st0 = hetpipe_compute_schedule(k, 12, nm, 2).streams[0]
        assert [type(i) for i in st0[:min(nm, k) + 1]] == [Fwd] * min(nm, k) + [Bwd]


def test_gpipe_and_1f1b_flush_every_apply_at_the_end():
    for s in (gpipe_schedule(3, 4), one_f_one_b_schedule(3, 4)):
        for st_ in s.streams:
            c = compute_only(st_)
            assert c[-5:] == [Apply(0), Apply(1), Apply(2), Apply(3), Push(0)]
            assert not any(isinstance(i, Pull) for i in st_)


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 5), m=st.integers(1, 10), nm=st.integers(1, 5), d=st.integers(0, 3),
       recompute=st.booleans(), split=st.integers(0, 2))
def test_generated_hetpipe_schedules_validate(k, m, nm, d, recompute, split):
    s = hetpipe_schedule(k, m, nm, d, recompute=recompute, split_startup=min(split, m))
    validate(s)
    validate(s, buffers=buffer_counts(s))


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 5), m=st.integers(1, 8))
def test_generated_baselines_validate(k, m):
    for s in (gpipe_schedule(k, m), one_f_one_b_schedule(k, m)):
        validate(s)
        validate(s, buffers=buffer_counts(s))


# --- mutations are rejected ------------------------------------------------------------------

def with_stream(s, stage, stream):
    streams = list(s.streams)
    streams[stage] = tuple(stream)
    return dataclasses.replace(s, streams=tuple(streams))


schedules = st.builds(hetpipe_schedule, st.integers(1, 4), st.integers(1, 7), st.integers(1, 4),
                      st.integers(0, 2))


@settings(max_examples=80, deadline=None)
@given(s=schedules, data=st.data())
def test_removing_any_instruction_is_rejected(s, data):
    stage = data.draw(st.integers(0, s.num_stages - 1))
    i = data.draw(st.integers(0, len(s.streams[stage]) - 1))
    stream = list(s.streams[stage])
    del stream[i]
    with pytest.raises(ScheduleError):
        validate(with_stream(s, stage, stream))


@settings(max_examples=80, deadline=None)
@given(s=schedules, data=st.data())
def test_swapping_two_instructions_of_one_micro_batch_is_rejected(s, data):
    stage = data.draw(st.integers(0, s.num_stages - 1))
    stream = list(s.streams[stage])
    j = data.draw(st.integers(0, s.num_micro - 1))
    idx = [n for n, ins in enumerate(stream)
           if isinstance(ins, (Fwd, Bwd, RecvAct, SendAct, RecvGrad, SendGrad)) and ins.mb == j]
    a, b = data.draw(st.lists(st.sampled_from(idx), min_size=2, max_size=2, unique=True))
    stream[a], stream[b] = stream[b], stream[a]
    with pytest.raises(ScheduleError):
        validate(with_stream(s, stage, stream))


@settings(max_examples=40, deadline=None)
@given(s=schedules, data=st.data())
def test_moving_push_before_its_last_apply_is_rejected(s, data):
    stage = data.draw(st.integers(0, s.num_stages - 1))
    stream = list(s.streams[stage])
    w = data.draw(st.integers(0, s.num_waves - 1))
    i = stream.index(Push(w))
    stream[i - 1], stream[i] = stream[i], stream[i - 1]
    with pytest.raises(ScheduleError, match=f"PUSH{w} at position .* must come after"):
        validate(with_stream(s, stage, stream))


def test_apply_after_its_waves_push_is_rejected():
    ok = Schedule("ok", 1, 2, 2, 0, (parse_stream("F0 F1 B0 B1 A0 A1 PUSH0"),))
    validate(ok)
    late = dataclasses.replace(ok, name="late", streams=(parse_stream("F0 F1 B0 B1 A1 PUSH0 A0"),))
    with pytest.raises(ScheduleError, match=r"stage 0: PUSH0 at position 5 must come after A0 at position 6"):
        validate(late)


def test_split_minibatch_apply_after_its_waves_push_is_rejected():
    s = hetpipe_schedule(1, 3, 2, 0, split_startup=1)
    stream = list(s.streams[0])
    a, push = stream.index(Apply(1)), stream.index(Push(0))
    assert a < push
    stream.insert(push, stream.pop(a))
    with pytest.raises(ScheduleError, match="PUSH0 .* must come after A1 .*minibatch 0"):
        validate(with_stream(s, 0, stream))


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 4), m=st.integers(1, 7), nm=st.integers(1, 4), d=st.integers(0, 2),
       recompute=st.booleans(), data=st.data())
def test_moving_any_apply_past_its_waves_push_is_rejected(k, m, nm, d, recompute, data):
    s = hetpipe_schedule(k, m, nm, d, recompute, data.draw(st.integers(0, min(m, 2))))
    stage = data.draw(st.integers(0, s.num_stages - 1))
    stream = list(s.streams[stage])
    applies = [n for n, ins in enumerate(stream) if isinstance(ins, Apply)]
    a = data.draw(st.sampled_from(applies))
    w = s.wave_of(stream[a].mb)
    push = stream.index(Push(w))
    dest = data.draw(st.integers(push, len(stream) - 1))
    moved = stream.pop(a)
    stream.insert(dest, moved)
    with pytest.raises(ScheduleError, match=f"stage {stage}: PUSH{w} at position .* must come after {moved}"):
        validate(with_stream(s, stage, stream))


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 4), nm=st.integers(1, 4), waves=st.integers(1, 4))
def test_d1_schedule_claimed_as_d0_deadlocks_exactly_when_it_overlaps_waves(k, nm, waves):
    s1 = hetpipe_schedule(k, nm * waves, nm, 1)
    claimed = dataclasses.replace(s1, d=0)
    if k >= 2 and nm >= 2 and waves >= 2:
        with pytest.raises(ScheduleError, match="deadlocks"):
            validate(claimed)
    else:
        assert claimed == hetpipe_schedule(k, nm * waves, nm, 0)
        validate(claimed)


def test_deadlock_report_shows_grid_and_stuck_stages():
    s = dataclasses.replace(hetpipe_schedule(2, 4, 2, 1), d=0)
    with pytest.raises(ScheduleError) as e:
        validate(s)
    msg = str(e.value)
    assert "stage 0 on PULL1, stage 1 on PULL1" in msg
    assert "step  | stage 0" in msg and "stuck | *PULL1" in msg


def test_send_order_mismatch_is_rejected():
    s = hetpipe_schedule(2, 4, 4, 0)
    stream = list(s.streams[0])
    a, b = stream.index(SendAct(0, 1)), stream.index(SendAct(1, 1))
    stream[a], stream[b] = SendAct(1, 1), SendAct(0, 1)
    with pytest.raises(ScheduleError):
        validate(with_stream(s, 0, stream))
    stream = list(s.streams[1])
    a, b = stream.index(RecvAct(0, 0)), stream.index(RecvAct(1, 0))
    stream[a], stream[b] = RecvAct(1, 0), RecvAct(0, 0)
    with pytest.raises(ScheduleError):
        validate(with_stream(s, 1, stream))


def test_in_flight_bound_is_enforced():
    s = hetpipe_schedule(3, 6, 3, 2)
    with pytest.raises(ScheduleError, match="in flight|local staleness"):
        validate(dataclasses.replace(s, nm=2, num_minibatches=6))


def test_wrong_peer_is_rejected():
    s = hetpipe_schedule(3, 2, 2, 0)
    stream = [SendAct(i.mb, 2) if isinstance(i, SendAct) else i for i in s.streams[0]]
    with pytest.raises(ScheduleError, match="must name the next stage 1"):
        validate(with_stream(s, 0, stream))


def test_pull_of_wave_zero_is_rejected():
    s = hetpipe_schedule(1, 2, 1, 0)
    with pytest.raises(ScheduleError, match="PULL0"):
        validate(with_stream(s, 0, (Pull(0),) + s.streams[0]))


# --- buffers, grid ---------------------------------------------------------------------------

def test_buffer_counts():
    assert buffer_counts(gpipe_schedule(3, 4)) == [(0, 1), (4, 1), (4, 0)]
    assert buffer_counts(one_f_one_b_schedule(3, 4)) == [(0, 1), (2, 1), (1, 0)]
    assert buffer_counts(hetpipe_schedule(4, 8, 4, 1)) == [(0, 1), (3, 1), (2, 1), (1, 0)]


def test_too_few_buffers_deadlock():
    s = gpipe_schedule(3, 4)
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(s, buffers=[(0, 1), (3, 1), (4, 0)])


def test_format_grid_lists_every_instruction_once():
    s = one_f_one_b_schedule(3, 4)
    text = format_grid(s)
    lines = text.splitlines()
    assert lines[0].split() == ["step", "|", "stage", "0", "stage", "1", "stage", "2"]
    assert lines[2].split() == ["0", "|", "F0", ".", "."]
    cells = [c for ln in lines[2:] for c in ln.split("|")[1].split() if c != "."]
    assert sorted(cells) == sorted(str(i) for stream in s.streams for i in stream)
    assert len(lines) - 2 == len(lockstep(s).steps)


def test_schedule_package_imports_without_torch_mpi_or_core():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'mpi4py', 'hetpipe_core'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import hetpipe.schedule, hetpipe.schedule.simulate, hetpipe.schedule.gantt\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_each_stage_pushes_as_soon_as_its_own_last_backward_of_the_wave_is_done():
    s = hetpipe_schedule(4, 8, 4, 1)
    rep = lockstep(s)
    step_of = {(st_, str(ins)): t for t, row in enumerate(rep.steps) for st_, ins in enumerate(row) if ins}
    for w in range(2):
        push_steps = [step_of[(st_, f"PUSH{w}")] for st_ in range(4)]
        assert push_steps == sorted(push_steps, reverse=True)   # the last stage pushes first
        for st_ in range(4):
            c = compute_only(s.streams[st_])
            assert c[c.index(Push(w)) - 2] == Bwd(4 * w + 3)
