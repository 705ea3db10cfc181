"""Lock-step execution of all stages' streams of one schedule: the execution model validate, the grid
printer, buffer assignment and the simulator share.

Model: in every step, each stage whose next instruction can run executes it; effects become visible
in the next step. Sends never block unless ``buffers`` bounds the receiving stage's buffers; a
receive runs once the matching message has been sent (channels are FIFO per kind and direction and
a receive must find its own message at the head); ``Pull(w)`` runs once every stage has executed
``Push(w - d - 1)``; everything else always runs. A run that stops with stages unfinished and
none able to run is a deadlock.

The run's messages (:mod:`hetpipe.schedule.messages`) are channels too: tied gradients
(``SendTied``/``RecvTied``), norm shares (``SendNorm``/``RecvNorm``) and verdicts
(``SendVerdict``/``RecvVerdict``), each FIFO per pair of stages. ``Eval(w)`` stands for its
evaluation pass's EVAL stream: on stage ``s > 0`` it runs once stage ``s - 1`` ran its ``Eval(w)``
(the pass forwards each evaluation minibatch as soon as its input arrived, so a stage finishes its
pass only after its predecessor's), and it lets stage ``s + 1``'s run. ``Done`` always runs.

Bounded buffers: an activation buffer on stage ``s`` is taken when stage ``s - 1`` executes
``SendAct(mb, s)`` and released when stage ``s`` finishes ``Bwd(mb)`` (the received input is kept for
the backward); a gradient buffer on stage ``s`` is taken by ``SendGrad(mb, s)`` of stage ``s + 1`` and
released by ``Bwd(mb)`` on stage ``s``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

from hetpipe.schedule.ir import (Bwd, Eval, Instr, Pull, Push, RecvAct, RecvGrad, RecvNorm, RecvTied, RecvVerdict,
                                 Schedule, SendAct, SendGrad, SendNorm, SendTied, SendVerdict)

BufferCaps = Union[None, int, Sequence[Tuple[int, int]]]

# The channel each send and receive uses, by kind: activations, gradients, tied gradients, norm
# shares, verdicts (the EVAL stream is "E", between Eval instructions).
_SENDS = {SendAct: "A", SendGrad: "G", SendTied: "T", SendNorm: "N", SendVerdict: "V"}
_RECVS = {RecvAct: "A", RecvGrad: "G", RecvTied: "T", RecvNorm: "N", RecvVerdict: "V"}


def _key(ins: Instr) -> int:
    """What a message names: its micro-batch, or its wave (verdicts)."""
    return ins.wave if isinstance(ins, (SendVerdict, RecvVerdict, Eval)) else ins.mb


@dataclass(frozen=True)
class Lockstep:
    """The outcome of a lock-step run. ``steps[t][s]`` is what stage ``s`` executed in step ``t`` (None: it
    waited or was done). ``stuck`` maps each unfinished stage to the instruction it is blocked on;
    it is empty when every stream ran to its end."""

    schedule: Schedule
    steps: Tuple[Tuple[Optional[Instr], ...], ...]
    stuck: Dict[int, Instr]

    @property
    def completed(self) -> bool:
        return not self.stuck

    def order(self) -> List[Tuple[int, Instr]]:
        """A topological order of all executed instructions: ``(stage, instr)`` step by step."""
        return [(s, ins) for row in self.steps for s, ins in enumerate(row) if ins is not None]


def _buffer_caps(schedule: Schedule, buffers: BufferCaps) -> Optional[List[Tuple[int, int]]]:
    if buffers is None:
        return None
    if isinstance(buffers, int):
        return [(buffers, buffers)] * schedule.num_stages
    caps = [tuple(c) for c in buffers]
    if len(caps) != schedule.num_stages:
        raise ValueError(f"lockstep: {len(caps)} buffer-count pairs for {schedule.num_stages} stages")
    return caps  # type: ignore[return-value]


def lockstep(schedule: Schedule, buffers: BufferCaps = None) -> Lockstep:
    """Run ``schedule`` step by step; ``buffers`` bounds each stage's (activation, gradient) buffers
    (an int applies to every stage; None means unbounded)."""
    k = schedule.num_stages
    caps = _buffer_caps(schedule, buffers)
    streams = schedule.streams
    pos = [0] * k
    chan: Dict[Tuple[str, int, int], Deque[int]] = {}
    held: List[List[set]] = [[set(), set()] for _ in range(k)]   # buffers in use: [act mbs, grad mbs]
    pushed: Dict[int, int] = {}
    steps: List[Tuple[Optional[Instr], ...]] = []

    def ready(s: int, ins: Instr) -> bool:
        kind = _RECVS.get(type(ins))
        if kind is not None:
            q = chan.get((kind, ins.peer, s))
            return bool(q) and q[0] == _key(ins)
        if isinstance(ins, Eval) and s > 0:
            q = chan.get(("E", s - 1, s))
            return bool(q) and q[0] == ins.wave
        if isinstance(ins, (SendAct, SendGrad)) and caps is not None:
            kind = 0 if isinstance(ins, SendAct) else 1
            if not 0 <= ins.peer < k:
                return True
            return len(held[ins.peer][kind]) < caps[ins.peer][kind]
        if isinstance(ins, Pull):
            gate = ins.wave - schedule.d - 1
            return gate < 0 or pushed.get(gate, 0) >= k
        return True

    def execute(s: int, ins: Instr) -> None:
        if type(ins) in _SENDS:
            kind = _SENDS[type(ins)]
            chan.setdefault((kind, s, ins.peer), deque()).append(_key(ins))
            if kind in "AG" and 0 <= ins.peer < k:
                held[ins.peer][0 if kind == "A" else 1].add(ins.mb)
        elif type(ins) in _RECVS:
            chan[(_RECVS[type(ins)], ins.peer, s)].popleft()
        elif isinstance(ins, Eval):
            if s > 0:
                chan[("E", s - 1, s)].popleft()
            if s < k - 1:
                chan.setdefault(("E", s, s + 1), deque()).append(ins.wave)
        elif isinstance(ins, Bwd):
            held[s][0].discard(ins.mb)
            held[s][1].discard(ins.mb)
        elif isinstance(ins, Push):
            pushed[ins.wave] = pushed.get(ins.wave, 0) + 1

    while True:
        runnable = [(s, streams[s][pos[s]]) for s in range(k)
                    if pos[s] < len(streams[s]) and ready(s, streams[s][pos[s]])]
        if not runnable:
            break
        row: List[Optional[Instr]] = [None] * k
        for s, ins in runnable:
            execute(s, ins)
            pos[s] += 1
            row[s] = ins
        steps.append(tuple(row))
    stuck = {s: streams[s][pos[s]] for s in range(k) if pos[s] < len(streams[s])}
    return Lockstep(schedule, tuple(steps), stuck)
