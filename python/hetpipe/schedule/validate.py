"""validate(): the checks a schedule must pass before any runtime executes it."""

from __future__ import annotations

from typing import Dict, List, Tuple

from hetpipe.schedule.grid import format_lockstep
from hetpipe.schedule.ir import (
    MESSAGES, Apply, Bwd, Done, Eval, Fwd, Pull, Push, Recompute, RecvAct, RecvGrad, RecvNorm, RecvTied, RecvVerdict,
    Schedule, SendAct, SendGrad, SendNorm, SendTied, SendVerdict,
)
from hetpipe.schedule.lockstep import BufferCaps, lockstep
from hetpipe.util.errors import HetpipeError

# The fixed order of one micro-batch's instructions on a stage (Recompute is checked separately,
# and SendGrad / Apply may come in either order).
_CHAIN = (RecvAct, Fwd, SendAct, RecvGrad, Bwd, SendGrad)


class ScheduleError(HetpipeError, ValueError):
    """A schedule breaks a rule; the message names the stage and instruction (and, for a deadlock,
    shows the step × stage grid ending in the stuck stages)."""


def _fail(schedule: Schedule, stage: int, msg: str) -> None:
    raise ScheduleError(f"schedule {schedule.name!r} stage {stage}: {msg}")


def _check_stage(schedule: Schedule, s: int) -> None:
    k, micro = schedule.num_stages, schedule.num_micro
    stream = schedule.streams[s]
    where: Dict[Tuple[type, int], int] = {}
    for i, ins in enumerate(stream):
        if isinstance(ins, MESSAGES):
            continue                            # checked by _check_messages
        num = ins.wave if isinstance(ins, (Push, Pull)) else ins.mb
        if isinstance(ins, (Push, Pull)):
            if not 0 <= num < schedule.num_waves:
                _fail(schedule, s, f"{ins} names wave {num}; the schedule has waves 0..{schedule.num_waves - 1}")
        elif not 0 <= num < micro:
            _fail(schedule, s, f"{ins} names micro-batch {num}; the schedule has 0..{micro - 1}")
        if isinstance(ins, (SendAct, RecvGrad)) and ins.peer != s + 1:
            _fail(schedule, s, f"{ins} must name the next stage {s + 1}")
        if isinstance(ins, (RecvAct, SendGrad)) and ins.peer != s - 1:
            _fail(schedule, s, f"{ins} must name the previous stage {s - 1}")
        if (type(ins), num) in where:
            _fail(schedule, s, f"{ins} appears twice (positions {where[(type(ins), num)]} and {i})")
        where[(type(ins), num)] = i

    need = [Fwd, Bwd] + ([RecvAct, SendGrad] if s > 0 else []) + ([SendAct, RecvGrad] if s < k - 1 else [])
    for j in range(micro):
        for kind in need:
            if (kind, j) not in where:
                _fail(schedule, s, f"{kind.__name__}({j}) is missing")
        chain = [(kind, where[(kind, j)]) for kind in _CHAIN if (kind, j) in where]
        for (ka, ia), (kb, ib) in zip(chain, chain[1:]):
            if ia > ib:
                _fail(schedule, s, f"{stream[ib]} at position {ib} must come after {stream[ia]} at {ia}")
        if (Recompute, j) in where and not where[(Fwd, j)] < where[(Recompute, j)] < where[(Bwd, j)]:
            _fail(schedule, s, f"R{j} must lie between F{j} and B{j}")
    for j in range(micro):
        if (Apply, j) in where and j != schedule.micros_of(schedule.minibatch_of(j))[-1]:
            _fail(schedule, s, f"A{j}: Apply must name the last micro-batch of its minibatch")
    for p in range(schedule.num_minibatches):
        last = schedule.micros_of(p)[-1]
        if (Apply, last) not in where:
            _fail(schedule, s, f"A{last} (the update of minibatch {p}) is missing")
        for j in schedule.micros_of(p):
            if where[(Bwd, j)] > where[(Apply, last)]:
                _fail(schedule, s, f"A{last} must come after B{j}")
        # The delta Push(c) sends is the sum of the wave's updates: an Apply after it would be lost.
        c = p // schedule.nm
        if (Push, c) not in where:
            _fail(schedule, s, f"PUSH{c} is missing (each wave is pushed exactly once per stage)")
        if where[(Apply, last)] > where[(Push, c)]:
            _fail(schedule, s, f"PUSH{c} at position {where[(Push, c)]} must come after A{last} at position "
                               f"{where[(Apply, last)]}: every update of wave {c} (here minibatch {p}) "
                               f"belongs in the delta PUSH{c} sends")
        if p >= schedule.nm:
            older = schedule.micros_of(p - schedule.nm)[-1]
            if where[(Apply, older)] > where[(Fwd, schedule.micros_of(p)[0])]:
                _fail(schedule, s, f"F{schedule.micros_of(p)[0]} runs before A{older}: local staleness "
                                   f"exceeds nm - 1 = {schedule.nm - 1}")

    fwd_order = [ins.mb for ins in stream if isinstance(ins, Fwd)]
    if fwd_order != sorted(fwd_order):
        _fail(schedule, s, f"forwards must run in micro-batch order, got {' '.join(f'F{j}' for j in fwd_order)}")

    in_flight: set = set()
    for ins in stream:
        if isinstance(ins, Fwd):
            in_flight.add(schedule.minibatch_of(ins.mb))
            if len(in_flight) > schedule.nm:
                _fail(schedule, s, f"at {ins}, {len(in_flight)} minibatches are in flight; nm = {schedule.nm}")
        elif isinstance(ins, Bwd):
            p = schedule.minibatch_of(ins.mb)
            if all(where[(Bwd, j)] <= where[(Bwd, ins.mb)] for j in schedule.micros_of(p)):
                in_flight.discard(p)

    for c in range(1, schedule.num_waves):
        if (Pull, c) not in where:
            _fail(schedule, s, f"PULL{c} is missing (every wave after the first starts with a Pull)")
        first = schedule.first_micro_of_wave(c)
        if where[(Pull, c)] > where[(Fwd, first)]:
            _fail(schedule, s, f"PULL{c} must come before F{first}, the first forward of wave {c}")
        if (Pull, c - 1) in where and where[(Pull, c - 1)] > where[(Pull, c)]:
            _fail(schedule, s, f"PULL{c} comes before PULL{c - 1}")
    if (Pull, 0) in where:
        _fail(schedule, s, "PULL0 is not allowed: wave 0 starts from the initial weights")


def _check_pairing(schedule: Schedule, s: int) -> None:
    """Stage ``s`` and ``s + 1`` send and receive the same messages in the same order."""
    up, down = schedule.streams[s], schedule.streams[s + 1]
    for send, recv, src, dst, a, b in ((SendAct, RecvAct, s, s + 1, up, down),
                                       (SendGrad, RecvGrad, s + 1, s, down, up)):
        sent = [i.mb for i in a if isinstance(i, send)]
        got = [i.mb for i in b if isinstance(i, recv)]
        if sent != got:
            at = next((n for n, (x, y) in enumerate(zip(sent, got)) if x != y), min(len(sent), len(got)))
            raise ScheduleError(
                f"schedule {schedule.name!r}: stage {src} sends {send.__name__} to stage {dst} in order "
                f"{sent} but stage {dst} receives {got} (first difference at message {at})")


def _positions(schedule: Schedule, s: int) -> Dict[Tuple[type, int, int], int]:
    """Stage ``s``'s instructions by (type, micro-batch or wave, peer or -1), with their positions;
    a message named twice is an error."""
    where: Dict[Tuple[type, int, int], int] = {}
    for i, ins in enumerate(schedule.streams[s]):
        num = -1 if isinstance(ins, Done) else getattr(ins, "mb", getattr(ins, "wave", -1))
        key = (type(ins), num, getattr(ins, "peer", -1))
        if key in where and isinstance(ins, MESSAGES):
            _fail(schedule, s, f"{ins} appears twice (positions {where[key]} and {i})")
        where[key] = i
    return where


def _check_message_stage(schedule: Schedule, s: int, where: Dict[Tuple[type, int, int], int]) -> None:
    """Stage ``s``'s messages: peers, and each one's place relative to the compute it serves."""
    k, stream = schedule.num_stages, schedule.streams[s]
    at = {(t, num): i for (t, num, _), i in where.items()}
    last_tied: Dict[int, int] = {}          # minibatch -> position of its last RecvTied
    last_bwd: Dict[int, Tuple[int, int]] = {}   # norm exchange's micro-batch -> (position, mb) of its last Bwd
    for (t, num, _), i in where.items():
        if t is RecvTied:
            p = schedule.minibatch_of(num)
            last_tied[p] = max(last_tied.get(p, -1), i)
    for i, ins in enumerate(stream):
        if not isinstance(ins, MESSAGES) or isinstance(ins, Done):
            if isinstance(ins, Done) and i != len(stream) - 1:
                _fail(schedule, s, f"DONE at position {i} must end the stream")
            continue
        peer = getattr(ins, "peer", None)
        if peer is not None and not (0 <= peer < k and peer != s):
            _fail(schedule, s, f"{ins} must name another stage of the {k}")
        if isinstance(ins, (SendTied, RecvTied, SendNorm, RecvNorm)):
            if not 0 <= ins.mb < schedule.num_micro:
                _fail(schedule, s, f"{ins} names micro-batch {ins.mb}; the schedule has 0..{schedule.num_micro - 1}")
            last = schedule.micros_of(schedule.minibatch_of(ins.mb))[-1]
            apply = at.get((Apply, last), -1)
            if isinstance(ins, SendTied) and not at.get((Bwd, ins.mb), len(stream)) < i:
                _fail(schedule, s, f"{ins} at position {i} must come after B{ins.mb}, whose gradients it sends")
            if not isinstance(ins, SendTied) and not i < apply:
                _fail(schedule, s, f"{ins} at position {i} must come before A{last}, which uses it")
        if isinstance(ins, (SendNorm, RecvNorm)):
            if ins.mb not in last_bwd:          # once per exchange: its Apply, its backwards, every stage in it
                micros = schedule.micros_of(schedule.minibatch_of(ins.mb))
                if ins.mb != micros[-1]:
                    _fail(schedule, s, f"{ins} must name its minibatch's Apply, the last micro-batch")
                last_bwd[ins.mb] = max((where.get((Bwd, j, -1), len(stream)), j) for j in micros)
                for t in range(k):
                    if t != s and ((SendNorm, ins.mb, t) not in where or (RecvNorm, ins.mb, t) not in where):
                        _fail(schedule, s, f"the norm exchange of A{ins.mb} misses stage {t} (every stage sends its "
                                           "share to every other one and receives theirs)")
            bwd, j = last_bwd[ins.mb]
            if not bwd < i:
                _fail(schedule, s, f"{ins} at position {i} must come after B{j}: the share covers its gradients")
            if isinstance(ins, SendNorm) and last_tied.get(schedule.minibatch_of(ins.mb), -1) > i:
                late = {t for (typ, num, t), j in where.items() if typ is RecvTied and j > i
                        and schedule.minibatch_of(num) == schedule.minibatch_of(ins.mb)}
                _fail(schedule, s, f"{ins} at position {i} comes before the tied gradients of its minibatch "
                                   f"from stage(s) {sorted(late)}: its share covers them")
        if isinstance(ins, (Eval, SendVerdict, RecvVerdict)):
            if not 0 <= ins.wave < schedule.num_waves - 1:
                _fail(schedule, s, f"{ins} names wave {ins.wave}; evaluation points follow waves "
                                   f"0..{schedule.num_waves - 2}")
            if not at.get((Push, ins.wave), len(stream)) < i:
                _fail(schedule, s, f"{ins} at position {i} must come after PUSH{ins.wave}")
        if isinstance(ins, (SendVerdict, RecvVerdict)):
            sender = s if isinstance(ins, SendVerdict) else ins.peer
            if sender != k - 1:
                _fail(schedule, s, f"{ins}: verdicts go from the last stage {k - 1} to the others")
            if not at.get((Eval, ins.wave), len(stream)) < i:
                _fail(schedule, s, f"{ins} at position {i} must come after EVAL{ins.wave}")
        if isinstance(ins, Eval):
            want = [SendVerdict(ins.wave, t) for t in range(k - 1)] if s == k - 1 else [RecvVerdict(ins.wave, k - 1)]
            missing = [str(v) for v in want if (type(v), v.wave, v.peer) not in where]
            if missing:
                _fail(schedule, s, f"EVAL{ins.wave} has no verdict {' '.join(missing)}")


def _check_messages(schedule: Schedule) -> None:
    """The run's messages (:mod:`hetpipe.schedule.messages`): each stage's are in place, and every
    send has its receive on the peer, in the same order; tied gradients cover every micro-batch
    between two holders; every stage evaluates at the same waves; DONE ends every stream or none."""
    k = schedule.num_stages
    where = [_positions(schedule, s) for s in range(k)]
    for s in range(k):
        _check_message_stage(schedule, s, where[s])
    done = [bool(schedule.streams[s]) and isinstance(schedule.streams[s][-1], Done) for s in range(k)]
    if any(done) and not all(done):
        raise ScheduleError(f"schedule {schedule.name!r}: stage(s) {[s for s in range(k) if not done[s]]} do not end "
                            "with DONE, the others do")
    evals = [[i.wave for i in schedule.streams[s] if isinstance(i, Eval)] for s in range(k)]
    if any(e != evals[0] for e in evals):
        raise ScheduleError(f"schedule {schedule.name!r}: the stages evaluate after different waves: "
                            + "; ".join(f"stage {s}: {e}" for s, e in enumerate(evals)))
    # (stage, instruction type, peer) -> what its messages name, in stream order
    named: Dict[Tuple[int, type, int], List[int]] = {}
    for s in range(k):
        for i in schedule.streams[s]:
            if isinstance(i, (SendTied, RecvTied, SendNorm, RecvNorm, SendVerdict, RecvVerdict)):
                named.setdefault((s, type(i), i.peer), []).append(_key(i))
    for send, recv in ((SendTied, RecvTied), (SendNorm, RecvNorm), (SendVerdict, RecvVerdict)):
        for s in range(k):
            for t in range(k):
                sent, got = named.get((s, send, t), []), named.get((t, recv, s), [])
                if sent != got:
                    at = next((n for n, (x, y) in enumerate(zip(sent, got)) if x != y), min(len(sent), len(got)))
                    raise ScheduleError(f"schedule {schedule.name!r}: stage {s} sends {send.__name__} to stage {t} "
                                        f"in order {sent} but stage {t} receives {got} (first difference at message "
                                        f"{at})")
                if send is SendTied and bool(sent) != bool(named.get((t, send, s))):
                    raise ScheduleError(f"schedule {schedule.name!r}: stage {s if sent else t} sends stage "
                                        f"{t if sent else s} tied gradients but gets none back: holders exchange "
                                        "them both ways")
                if send is SendTied and sent and sorted(sent) != list(range(schedule.num_micro)):
                    raise ScheduleError(f"schedule {schedule.name!r}: stage {s} sends stage {t} the tied gradients of "
                                        f"micro-batches {sorted(sent)}, not of every micro-batch")


def _key(ins) -> int:
    return ins.wave if isinstance(ins, (SendVerdict, RecvVerdict)) else ins.mb


def validate(schedule: Schedule, buffers: BufferCaps = None) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is executable and honours WSP.

    Checks, per stage: every micro-batch has its Fwd and Bwd and the transfers its position needs,
    in the order ``RecvAct < Fwd < SendAct < RecvGrad < Bwd < SendGrad`` (``Recompute`` between Fwd
    and Bwd); forwards in micro-batch order; each minibatch's Apply after its Bwd(s); local staleness
    (``Fwd`` of minibatch ``p`` after ``Apply`` of ``p - nm``); at most ``nm`` minibatches in flight;
    each wave pushed exactly once, after every Apply of the wave; ``Pull(w)`` for every wave ``w >= 1`` before
    the wave's first Fwd. Between neighbours: sends and receives pair up in the same order. The
    run's messages, where the schedule has them (:mod:`hetpipe.schedule.messages`): ``SendTied(mb)``
    after ``Bwd(mb)``; ``RecvTied`` and the norm exchange before the Apply they serve (the tied
    gradients first, the exchange after the minibatch's backwards, with every other stage); ``Eval(w)``
    after ``Push(w)`` with its verdicts after it, from the last stage; each send paired with its
    receive on the peer in the same order; ``DONE`` ending every stream or none. Finally
    the lock-step run of all stages (:mod:`hetpipe.schedule.lockstep`, with ``Pull(w)`` blocked until
    every stage has pushed ``w - d - 1``, and buffers bounded by ``buffers`` if given) must finish;
    otherwise the error shows the last steps of the grid and the stuck stages.
    """
    for s in range(schedule.num_stages):
        _check_stage(schedule, s)
    for s in range(schedule.num_stages - 1):
        _check_pairing(schedule, s)
    _check_messages(schedule)
    rep = lockstep(schedule, buffers)
    if rep.stuck:
        blocked = ", ".join(f"stage {s} on {ins}" for s, ins in sorted(rep.stuck.items()))
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks at step {len(rep.steps)}: {blocked}\n"
                            + format_lockstep(rep, last=12))

