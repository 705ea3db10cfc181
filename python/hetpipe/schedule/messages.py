"""The run's messages in a schedule: tied gradients, gradient-norm shares, VW 0's evaluation points
and their verdicts, and DONE, inserted into any lowered schedule by one shared pass.

Which of them a stage's stream carries depends on the run, not on the schedule: the stages holding a
tied parameter together exchange its gradients; clipping by the VW's norm and fp16's loss scaling
exchange norm shares; ``eval_every`` adds VW 0's evaluation points; every stream a runtime executes
ends with DONE. :class:`MessageOptions` says which (``ScheduleOptions.messages``), and
:func:`with_messages` inserts them into what a registered generator returns, built-in or not, where
the runtime did them before they were instructions, so numbers and message order stay as they were.
On stage ``s`` of ``k``:

* ``SendTied(mb, t)`` right after ``Bwd(mb)``, for each tied peer ``t`` in stage order; after the
  ``SendGrad(mb)`` that follows the ``Bwd`` (the lowered schedules put it there), so that the
  gradient the previous stage waits for is queued first and never behind a tied parameter's.
* Before each ``Apply(mb)`` of minibatch ``p``: ``RecvTied`` of each peer in stage order, receiving the
  peer's messages in the order it sent them, up to the last one of ``p``'s micro-batches. Then, when
  norm shares are exchanged and ``p`` takes a step (every ``accumulate`` minibatches and after the
  last one), ``SendNorm(mb, t)`` to every other stage, then ``RecvNorm(mb, t)`` from each, in stage order.
* Right after ``Push(w)`` when ``(w + 1) % eval_every == 0`` and ``w`` is not the last wave:
  ``Eval(w)``, then on the last stage ``SendVerdict(w, t)`` to every other stage, on the others
  ``RecvVerdict(w, k - 1)``.
* ``Done()`` at the end.

No wait cycle (docs/design.md, "Tied weights", "Gradient norm ...", "Evaluation and early
stopping"): a stage sends tied gradients and norm shares after its own ``Bwd``, which never waits for
another stage's ``Apply``; evaluation flows forward and its verdict from the last stage.
``validate`` checks these rules and the pairing; the lock-step run checks that nothing deadlocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Set, Tuple

from hetpipe.schedule.ir import (MESSAGES, Apply, Bwd, Done, Eval, Instr, Push, RecvNorm, RecvTied, RecvVerdict,
                                 Schedule, SendGrad, SendNorm, SendTied, SendVerdict)


@dataclass(frozen=True)
class MessageOptions:
    """What a run's streams exchange besides activations and gradients (module docstring).

    ``tied``: the pairs of stages ``(a, b)``, ``a < b``, holding a tied parameter together; ``norm``:
    exchange gradient-norm shares at each step (clipping, fp16); ``accumulate``: a step every
    ``accumulate`` minibatches (and after the last); ``eval_every``: VW 0's evaluation points every
    ``eval_every`` waves (0: none; the other VWs' streams have none), the stream's wave ``w`` being the
    run's wave ``eval_offset + w`` (a resumed run's).
    """

    tied: Tuple[Tuple[int, int], ...] = ()
    norm: bool = False
    accumulate: int = 1
    eval_every: int = 0
    eval_offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.norm, bool):
            raise ValueError(f"message options: norm must be a bool, got {self.norm!r}")
        for name, lo in (("accumulate", 1), ("eval_every", 0), ("eval_offset", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"message options: {name} must be an int >= {lo}, got {v!r}")
        pairs = tuple(tuple(p) for p in self.tied)
        if any(len(p) != 2 or not all(isinstance(x, int) and x >= 0 for x in p) or p[0] >= p[1] for p in pairs) \
                or len(set(pairs)) != len(pairs):
            raise ValueError(f"message options: tied must list distinct stage pairs (a, b) with 0 <= a < b, "
                             f"got {self.tied!r}")
        object.__setattr__(self, "tied", tuple(sorted(pairs)))

    def check(self, stages: int) -> None:
        """ValueError unless every tied pair names stages of a ``stages``-stage VW."""
        outside = [p for p in self.tied if p[1] >= stages]
        if outside:
            raise ValueError(f"message options: tied pairs {outside} name stages beyond the {stages} of the VW")

    def tied_peers(self, stage: int) -> List[int]:
        """The stages ``stage`` exchanges tied gradients with, in stage order."""
        return sorted({b for a, b in self.tied if a == stage} | {a for a, b in self.tied if b == stage})


def step_minibatches(schedule: Schedule, accumulate: int) -> Set[int]:
    """The minibatches whose Apply takes a step: every ``accumulate``-th, and the last."""
    last = schedule.num_minibatches - 1
    return {p for p in range(schedule.num_minibatches) if (p + 1) % accumulate == 0 or p == last}


def norm_exchange(stage: int, num_stages: int, mb: int) -> List[Instr]:
    """Stage ``stage``'s norm exchange before ``Apply(mb)``: its share to every other stage, then theirs."""
    others = [t for t in range(num_stages) if t != stage]
    return [SendNorm(mb, t) for t in others] + [RecvNorm(mb, t) for t in others]


def eval_waves(schedule: Schedule, every: int, offset: int = 0) -> List[int]:
    """The waves after whose Push VW 0 evaluates: ``(offset + w + 1) % every == 0``, the last wave excepted."""
    return [w for w in range(schedule.num_waves - 1) if (offset + w + 1) % every == 0] if every else []


def with_messages(schedule: Schedule, options: MessageOptions) -> Schedule:
    """``schedule`` (lowered, valid, without messages) with the messages ``options`` ask for (module
    docstring); ValueError if it already has some."""
    k = schedule.num_stages
    options.check(k)
    for s, stream in enumerate(schedule.streams):
        extra = next((i for i in stream if isinstance(i, MESSAGES)), None)
        if extra is not None:
            raise ValueError(f"with_messages: schedule {schedule.name!r} stage {s} already has message {extra}")
    peers = [options.tied_peers(s) for s in range(k)]
    streams = [_tied_sends(stream, peers[s]) for s, stream in enumerate(schedule.streams)]
    # Per (sender, receiver): the micro-batches of its tied messages, in the order it sends them.
    sent = {(s, t): [i.mb for i in streams[s] if isinstance(i, SendTied) and i.peer == t]
            for s in range(k) for t in peers[s]}
    position = {key: {mb: n for n, mb in enumerate(order)} for key, order in sent.items()}
    steps = step_minibatches(schedule, options.accumulate) if options.norm and k > 1 else set()
    evals = set(eval_waves(schedule, options.eval_every, options.eval_offset))
    out_streams = []
    for s, stream in enumerate(streams):
        received: Dict[int, int] = {t: 0 for t in peers[s]}
        out: List[Instr] = []
        for ins in stream:
            if isinstance(ins, Apply):
                p = schedule.minibatch_of(ins.mb)
                for t in peers[s]:
                    at = position[(t, s)]
                    missing = [m for m in schedule.micros_of(p) if m not in at]
                    if missing:
                        raise ValueError(f"with_messages: schedule {schedule.name!r} stage {t} never sends the tied "
                                         f"gradients of micro-batch(es) {missing} (no Bwd)")
                    upto = 1 + max(at[m] for m in schedule.micros_of(p))
                    out += [RecvTied(mb, t) for mb in sent[(t, s)][received[t]:upto]]
                    received[t] = max(received[t], upto)
                if p in steps:
                    out += norm_exchange(s, k, ins.mb)
            out.append(ins)
            if isinstance(ins, Push) and ins.wave in evals:
                out.append(Eval(ins.wave))
                out += [SendVerdict(ins.wave, t) for t in range(k - 1)] if s == k - 1 else \
                    [RecvVerdict(ins.wave, k - 1)]
        out.append(Done())
        out_streams.append(tuple(out))
    return Schedule(schedule.name, k, schedule.num_minibatches, schedule.nm, schedule.d, tuple(out_streams),
                    schedule.split)


def _tied_sends(stream: Sequence[Instr], peers: Sequence[int]) -> List[Instr]:
    """``stream`` with ``SendTied(mb, t)`` for each of ``peers`` after each ``Bwd(mb)``, or after the
    ``SendGrad(mb)`` right after it."""
    out: List[Instr] = []
    for n, ins in enumerate(stream):
        out.append(ins)
        nxt = stream[n + 1] if n + 1 < len(stream) else None
        if isinstance(ins, Bwd) and isinstance(nxt, SendGrad) and nxt.mb == ins.mb:
            continue                                # after the SendGrad
        if isinstance(ins, Bwd) or (isinstance(ins, SendGrad) and n and isinstance(stream[n - 1], Bwd)
                                    and stream[n - 1].mb == ins.mb):
            out += [SendTied(ins.mb, t) for t in peers]
    return out


def without_messages(schedule: Schedule) -> Schedule:
    """``schedule`` with every message instruction removed (what a generator returned)."""
    return Schedule(schedule.name, schedule.num_stages, schedule.num_minibatches, schedule.nm, schedule.d,
                    tuple(tuple(i for i in stream if not isinstance(i, MESSAGES)) for stream in schedule.streams),
                    schedule.split)
