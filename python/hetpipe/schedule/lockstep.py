"""Lock-step execution of all stages' streams of one schedule: the execution model validate, the grid
printer, buffer assignment and the simulator share.

Model: in every step, each stage whose next instruction can run executes it; effects become visible
in the next step. Sends never block unless ``buffers`` bounds the receiving stage's buffers; a
receive runs once the matching message has been sent (channels are FIFO per direction and a receive
must find its own message at the head); ``Pull(w)`` runs once every stage has executed
``Push(w - d - 1)``; everything else always runs. A run that stops with stages unfinished and
none able to run is a deadlock.

Bounded buffers: an activation buffer on stage ``s`` is taken when stage ``s - 1`` executes
``SendAct(mb, s)`` and released when stage ``s`` finishes ``Bwd(mb)`` (the received input is kept for
the backward); a gradient buffer on stage ``s`` is taken by ``SendGrad(mb, s)`` of stage ``s + 1`` and
released by ``Bwd(mb)`` on stage ``s``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

from hetpipe.schedule.ir import Bwd, Instr, Pull, Push, RecvAct, RecvGrad, Schedule, SendAct, SendGrad

BufferCaps = Union[None, int, Sequence[Tuple[int, int]]]


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
        if isinstance(ins, (RecvAct, RecvGrad)):
            q = chan.get(("A" if isinstance(ins, RecvAct) else "G", ins.peer, s))
            return bool(q) and q[0] == ins.mb
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
        if isinstance(ins, (SendAct, SendGrad)):
            kind = "A" if isinstance(ins, SendAct) else "G"
            chan.setdefault((kind, s, ins.peer), deque()).append(ins.mb)
            if 0 <= ins.peer < k:
                held[ins.peer][0 if kind == "A" else 1].add(ins.mb)
        elif isinstance(ins, (RecvAct, RecvGrad)):
            chan[("A" if isinstance(ins, RecvAct) else "G", ins.peer, s)].popleft()
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
