"""Lowering: insert the sends and receives that a compute-only schedule implies."""

from __future__ import annotations

from typing import List

from hetpipe.schedule.ir import COMMS, Bwd, Fwd, Instr, RecvAct, RecvGrad, Schedule, SendAct, SendGrad


def lower(schedule: Schedule) -> Schedule:
    """The schedule with activation and gradient transfers between neighbouring stages inserted.

    On stage ``s`` of ``k``: ``RecvAct(mb, s-1)`` right before each ``Fwd(mb)`` (s > 0),
    ``SendAct(mb, s+1)`` right after it (s < k-1), ``RecvGrad(mb, s+1)`` right before each
    ``Bwd(mb)`` (s < k-1; after any ``Recompute(mb)``, so recomputation overlaps the transfer) and
    ``SendGrad(mb, s-1)`` right after it (s > 0). Every other instruction keeps its place.
    Raises ValueError if the input already contains transfers.
    """
    k = schedule.num_stages
    streams = []
    for s, stream in enumerate(schedule.streams):
        out: List[Instr] = []
        for ins in stream:
            if isinstance(ins, COMMS):
                raise ValueError(f"lower: schedule {schedule.name!r} stage {s} already has transfer {ins}")
            if isinstance(ins, Fwd):
                if s > 0:
                    out.append(RecvAct(ins.mb, s - 1))
                out.append(ins)
                if s < k - 1:
                    out.append(SendAct(ins.mb, s + 1))
            elif isinstance(ins, Bwd):
                if s < k - 1:
                    out.append(RecvGrad(ins.mb, s + 1))
                out.append(ins)
                if s > 0:
                    out.append(SendGrad(ins.mb, s - 1))
            else:
                out.append(ins)
        streams.append(tuple(out))
    return Schedule(schedule.name, k, schedule.num_minibatches, schedule.nm, schedule.d, tuple(streams),
                    schedule.split)
